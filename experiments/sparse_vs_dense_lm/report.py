"""Sparse vs dense LM: gather the quality sweep and cost.json into results.json, table.md
and two figures (perplexity against time, cost against context).

  .venv/bin/python experiments/sparse_vs_dense_lm/report.py [--runs=DIR]  (default: runs/ here)
  .venv/bin/python experiments/sparse_vs_dense_lm/report.py --restore   # before re-running

The record is results.jsonl and curves.jsonl here (every run's row and validation
curve; flaxformer_lite/sweep/record.py), gathered from the sweep folders under --runs
when they exist (they are not committed) and read from here otherwise.

Quality is the validation perplexity of each pattern after the same steps and tokens
(mean ± sample std over seeds). Time is not the runs' wall clock (the sweep shared
the machine with other work) but each step priced by cost.json at 1,024 context, in
units of dense's step, so "equal compute" means equal step-time: the pattern's
validation perplexity when its budget is the cheapest pattern's whole run,
interpolated (in log perplexity) between the validation points of its curve.
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402

from flaxformer_lite.sweep import record  # noqa: E402

HERE = Path(__file__).resolve().parent
NAMES = {  # pattern spec in the sweep -> the name cost.py gives it
    "dense": "dense",
    "local:window=127": "local",
    "sparse_strided:stride=32": "strided",
    "bigbird:block=64,window=3,global=1,random=1": "bigbird",
    "topk:k=128": "topk",
    "moba:block=32,k=4": "moba",
    "nsa:block=32,k=2,window=64": "nsa",
}


def mean_std(values: list[float]) -> dict:
    return {
        "mean": statistics.fmean(values),
        "std": statistics.stdev(values) if len(values) > 1 else 0.0,
        "seeds": len(values),
    }


def validation_curve(curve: dict) -> list[tuple[int, float]]:
    """(step, nll) of every validation of a run, in step order (a resumed run's repeated
    steps keep the last)."""
    v = curve["validation"]
    return [(int(s), float(n)) for s, n in zip(v["step"], v["nll"], strict=True)]


def nll_at(curve: list[tuple[int, float]], step: float) -> float:
    steps, nlls = zip(*curve, strict=True)
    if step < steps[0] or step > steps[-1]:
        raise ValueError(f"step {step} outside the validation points {steps[0]}..{steps[-1]}")
    return float(np.interp(step, steps, nlls))


def gather(sweep: str) -> dict[str, dict]:
    curves = {c["run"]: c for c in record.curves(HERE) if c["sweep"] == sweep}
    out: dict[str, dict] = {}
    for row in record.rows(HERE):
        if row["sweep"] != sweep or row.get("status") != "ok":
            continue
        name = NAMES[row["overrides"]["model.attention_pattern"]]
        entry = out.setdefault(name, {"rows": [], "curves": []})
        entry["rows"].append(row)
        entry["curves"].append(validation_curve(curves[row["run"]]))
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--runs", type=Path, default=HERE / "runs")
    parser.add_argument("--restore", action="store_true", help="the record into --runs")
    args = parser.parse_args()
    if args.restore:
        record.restore(HERE, args.runs)
        return
    if args.runs.is_dir():
        record.collect(args.runs, HERE)
    cost = json.loads((HERE / "cost.json").read_text())
    price = {n: cost["lengths"]["1024"][n]["time_vs_dense"] for n in NAMES.values()}
    found = gather("context1024")
    steps = {n: e["rows"][0]["steps"] for n, e in found.items()}
    budget = min(steps[n] * price[n] for n in found)  # in dense steps
    quality = {}
    for name in NAMES.values():
        if name not in found:
            continue
        e = found[name]
        q = {
            "valid_nll": mean_std([r["valid_nll"] for r in e["rows"]]),
            "valid_perplexity": mean_std([r["valid_perplexity"] for r in e["rows"]]),
            "steps": steps[name],
            "step_time_vs_dense": price[name],
            "run_cost_dense_steps": steps[name] * price[name],
        }
        at = budget / price[name]
        first = max(c[0][0] for c in e["curves"])  # before it, no validation to read
        q["equal_compute"] = {
            "steps": at,
            "valid_perplexity": (
                mean_std([math.exp(nll_at(c, at)) for c in e["curves"]]) if at >= first else None
            ),
        }
        grid = sorted({s for c in e["curves"] for s, _ in c})
        q["curve"] = [
            {"step": s, **mean_std([dict(c)[s] for c in e["curves"] if s in dict(c)])} for s in grid
        ]
        quality[name] = q
    result = {"context": 1024, "budget_dense_steps": budget, "quality": quality, "cost": cost}
    (HERE / "results.json").write_text(json.dumps(result, indent=2) + "\n")
    write_table(quality, cost)
    draw(quality, cost)


def write_table(quality: dict, cost: dict) -> None:
    def pm(s, digits=1):
        return f"{s['mean']:.{digits}f} ± {s['std']:.{digits}f}"

    lines = [
        "| pattern | valid PPL, equal steps | step time vs dense (1k) | valid PPL, equal compute "
        "| step time vs dense (2k / 4k) | peak memory 1k / 2k / 4k (MiB) |",
        "|---|---:|---:|---:|---:|---:|",
    ]
    for name, q in quality.items():
        rows = [cost["lengths"][str(n)][name] for n in (1024, 2048, 4096)]
        equal = q["equal_compute"]["valid_perplexity"]
        lines.append(
            f"| {name} | {pm(q['valid_perplexity'])} | {q['step_time_vs_dense']:.2f}× | "
            f"{pm(equal) if equal else 'before the first validation'} "
            f"(step {q['equal_compute']['steps']:.0f}) | "
            f"{rows[1]['time_vs_dense']:.2f}× / {rows[2]['time_vs_dense']:.2f}× | "
            + " / ".join(f"{r['peak_bytes'] / 2**20:,.0f}" for r in rows)
            + " |"
        )
    (HERE / "table.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


def draw(quality: dict, cost: dict) -> None:
    fig, ax = plt.subplots(figsize=(6, 4))
    for name, q in quality.items():
        x = np.array([p["step"] for p in q["curve"]]) * q["step_time_vs_dense"]
        mean = np.exp([p["mean"] for p in q["curve"]])
        lo = np.exp([p["mean"] - p["std"] for p in q["curve"]])
        hi = np.exp([p["mean"] + p["std"] for p in q["curve"]])
        ax.plot(x, mean, marker="o", ms=3, label=name)
        ax.fill_between(x, lo, hi, alpha=0.2)
    ax.set_yscale("log")
    ax.set_xlabel("training time, in dense train steps at 1,024 context (cost.json)")
    ax.set_ylabel("validation perplexity (mean ± std, 3 seeds)")
    ax.set_title("KJV LM, 1,024 context: perplexity against compute", fontsize=9)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(HERE / "perplexity_vs_time.png", dpi=100)

    lengths = sorted(int(n) for n in cost["lengths"])
    fig, (a, b) = plt.subplots(1, 2, figsize=(9, 3.6))
    for name in NAMES.values():  # every pattern cost.py timed, trained or not
        a.plot(lengths, [cost["lengths"][str(n)][name]["time_vs_dense"] for n in lengths],
               marker="o", label=name)  # fmt: skip
        b.plot(lengths, [cost["lengths"][str(n)][name]["peak_bytes"] / 2**20 for n in lengths],
               marker="o", label=name)  # fmt: skip
    a.set_ylabel("train step time / dense's (same round)")
    a.set_yscale("log")
    b.set_ylabel("peak memory of the compiled step (MiB)")
    for axis in (a, b):
        axis.set_xscale("log", base=2)
        axis.set_xticks(lengths, [str(n) for n in lengths])
        axis.set_xlabel(f"context (tokens; {cost['tokens_per_step']:,} tokens a step)")
    a.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(HERE / "cost.png", dpi=100)


if __name__ == "__main__":
    main()
