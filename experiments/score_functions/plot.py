"""Figures and results.json of the score-function comparison.

  .venv/bin/python experiments/score_functions/plot.py [--sweep=runs/sweeps/score_functions]

Reads bench.json (bench.py: time and memory) and, with --sweep, the sweep's
results.jsonl (quality at 600 steps of ding_mini); writes results.json, cost.png
and quality.png next to this file.
"""

from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

HERE = Path(__file__).resolve().parent
SCORES = ("scaled_dot", "dot", "additive", "bilinear")


def quality(sweep: Path) -> dict:
    rows = [json.loads(line) for line in (sweep / "results.jsonl").read_text().splitlines()]
    out = {}
    for score in SCORES:
        group = [
            r for r in rows if r.get("status") == "ok" and r["overrides"]["model.score_fn"] == score
        ]
        if not group:
            continue
        entry = {"seeds": len(group), "parameters": group[0]["parameters"]}
        for key in ("valid_nll", "valid_perplexity", "valid_accuracy", "tokens_per_sec"):
            values = [r[key] for r in group]
            entry[key] = {"mean": statistics.fmean(values), "std": statistics.stdev(values)}
        out[score] = entry
    return out


def plot_cost(bench: dict) -> None:
    fig, axes = plt.subplots(1, 4, figsize=(17, 3.6))
    for axis_name, col, xlabel in (
        ("vs_d_k", 0, "d_k (length 128)"),
        ("vs_length", 2, "length (d_k 32)"),
    ):
        xs = sorted(bench[axis_name], key=int)
        for score in SCORES:
            axes[col].plot(
                [int(x) for x in xs],
                [bench[axis_name][x][score]["time_vs_scaled_dot"] for x in xs],
                "o-",
                label=score,
            )
            axes[col + 1].plot(
                [int(x) for x in xs],
                [bench[axis_name][x][score]["temp_bytes"] / 2**20 for x in xs],
                "o-",
                label=score,
            )
        axes[col].set_title(f"time / scaled_dot, {xlabel}", fontsize=9)
        axes[col + 1].set_title(f"XLA temporary memory (MiB), {xlabel}", fontsize=9)
        axes[col + 1].set_yscale("log")
        for ax in axes[col : col + 2]:
            ax.set_xscale("log", base=2)
            ax.set_xlabel(xlabel)
            ax.grid(alpha=0.3, which="both")
    axes[0].set_yscale("log")
    axes[2].set_yscale("log")
    axes[0].legend(fontsize=8)
    fig.suptitle(
        f"one self-attention layer, forward + backward, batch {bench['batch']}, "
        f"{bench['heads']} heads, float32",
        fontsize=10,
    )
    fig.tight_layout()
    fig.savefig(HERE / "cost.png", dpi=100)
    plt.close(fig)


def plot_quality(result: dict) -> None:
    scores = [s for s in SCORES if s in result]
    fig, ax = plt.subplots(figsize=(5.5, 3.5))
    means = [result[s]["valid_perplexity"]["mean"] for s in scores]
    stds = [result[s]["valid_perplexity"]["std"] for s in scores]
    ax.bar(scores, means, yerr=stds, capsize=4, color="#8fb3d9")
    ax.set_ylim(min(means) * 0.9, max(means) * 1.05)
    ax.set_ylabel("validation perplexity (mean ± std, 3 seeds)")
    ax.set_title("ding_mini, 600 steps, d_k 32", fontsize=9)
    fig.tight_layout()
    fig.savefig(HERE / "quality.png", dpi=100)
    plt.close(fig)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--sweep", type=Path, help="the sweep folder of the quality runs")
    args = parser.parse_args()
    bench = json.loads((HERE / "bench.json").read_text())
    result = {"cost": bench}
    plot_cost(bench)
    if args.sweep:
        result["quality"] = quality(args.sweep)
        plot_quality(result["quality"])
    elif (HERE / "results.json").is_file():
        old = json.loads((HERE / "results.json").read_text())
        result.update({k: v for k, v in old.items() if k != "cost"})
    (HERE / "results.json").write_text(json.dumps(result, indent=2) + "\n")
    for score, q in result.get("quality", {}).items():
        p = q["valid_perplexity"]
        print(f"{score:10s} valid perplexity {p['mean']:.2f} ± {p['std']:.2f}")


if __name__ == "__main__":
    main()
