"""The long-range grid's tables and figure, from its committed records alone.

  .venv/bin/python experiments/long_range/report.py [--collect experiments/long_range/runs/listops]

Reads ``listops_results.jsonl`` (the sweep's results.jsonl, one row per run: the test
accuracy of the checkpoint with the best validation accuracy) and ``cost.json``
(cost.py: step time and peak memory of each pattern in one process), and writes
``table.md`` (accuracy mean ± sample std over seeds beside the Long Range Arena's
ListOps row, step time and memory against dense) and ``listops.png``. The majority
class's share is counted from the seeded generator's test split (no data needed).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from collections import Counter
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(HERE))

from grid import PATTERNS  # noqa: E402

from flaxformer_lite.data import synthetic  # noqa: E402

# The Long Range Arena's ListOps accuracies (Tay et al. 2021, Table 1) for the patterns
# it shares with the grid: Transformer, Local Attention, Sparse Transformer, Longformer,
# BigBird.
LRA = {"dense": 36.37, "local": 15.82, "strided": 17.07, "longformer": 35.63, "bigbird": 36.05}


def load_rows(path: Path) -> dict[str, list[dict]]:
    """The finished runs by pattern name (grid.PATTERNS' keys), seeds in order."""
    names = {spec: name for name, spec in PATTERNS.items()}
    by = {name: [] for name in PATTERNS}
    for line in path.read_text().splitlines():
        row = json.loads(line)
        if row.get("status") == "ok":
            by[names[row["overrides"]["model.attention_pattern"]]].append(row)
    return {k: sorted(v, key=lambda r: r["seed"]) for k, v in by.items() if v}


def mean_std(xs: list[float]) -> tuple[float, float]:
    return statistics.mean(xs), statistics.stdev(xs) if len(xs) > 1 else 0.0


def majority_share(dataset: str = "listops/l512") -> float:
    labels = Counter(int(ex["targets"][0]) for ex in synthetic.parse(dataset).examples("test"))
    return max(labels.values()) / sum(labels.values())


def table(rows: dict[str, list[dict]], cost: dict, majority: float) -> str:
    by_len = {run["length"]: run["patterns"] for run in cost["runs"]}
    lengths = sorted(by_len)
    head = (
        "| pattern | spec | test accuracy (mean ± std) | seeds | LRA ListOps "
        + "".join(f"| step at {n} (vs dense) | peak memory at {n} (vs dense) " for n in lengths)
        + "|"
    )
    lines = [head, "|" + "---|" * (5 + 2 * len(lengths))]
    for name, runs in rows.items():
        accs = [100 * r["test_accuracy"] for r in runs]
        m, s = mean_std(accs)
        cells = [
            name,
            f"`{PATTERNS[name]}`",
            f"{m:.1f} ± {s:.1f}",
            ", ".join(f"{a:.1f}" for a in accs),
            f"{LRA[name]:.1f}" if name in LRA else "—",
        ]
        for n in lengths:
            p = by_len[n].get(name)
            cells += (
                [f"{1e3 * p['step_s']:.0f} ms ({p['vs_dense']:.2f}×)",
                 f"{p['peak_mib']:.0f} MiB ({p['memory_vs_dense']:.2f}×)"]
                if p else ["—", "—"]
            )  # fmt: skip
        lines.append("| " + " | ".join(cells) + " |")
    rows_per = {n: next(r["rows"] for r in cost["runs"] if r["length"] == n) for n in lengths}
    lines += [
        "",
        f"Majority class of the test split: {100 * majority:.1f}%. Steps: "
        + ", ".join(f"{n} tokens × {rows_per[n]} rows" for n in lengths)
        + f"; times on {cost['machine']} (jax {cost['jax']}), median of {cost['rounds']} "
        "rounds timed round-robin in one process.",
    ]
    return "\n".join(lines) + "\n"


def draw(rows: dict[str, list[dict]], majority: float, path: Path) -> None:
    fig, ax = plt.subplots(figsize=(7.5, 3.6))
    names = list(rows)
    for i, name in enumerate(names):
        accs = [100 * r["test_accuracy"] for r in rows[name]]
        m, s = mean_std(accs)
        ax.bar(i, m, yerr=s, color="#8aa9c9", capsize=4, width=0.6)
        ax.scatter([i] * len(accs), accs, color="#1f3b5a", s=12, zorder=3)
        if name in LRA:
            ax.scatter([i], [LRA[name]], marker="_", s=400, color="#c0392b", zorder=4)
    ax.axhline(100 * majority, color="gray", ls=":", lw=1)
    ax.text(len(names) - 0.5, 100 * majority + 0.6, "majority class", ha="right", fontsize=8)
    ax.set_xticks(range(len(names)), names)
    ax.set_ylabel("test accuracy (%)")
    ax.set_title(
        "ListOps at 512 tokens: bars mean ± std over seeds, dots seeds, red LRA", fontsize=9
    )
    fig.tight_layout()
    fig.savefig(path, dpi=120, metadata={"Software": None})
    plt.close(fig)


def collect(sweep: Path, out: Path) -> None:
    """The sweep's rows into ``out``: results.jsonl once the sweep is done, else each
    finished run's sweep_result.json, in the sweep's order of patterns and seeds."""
    if (sweep / "results.jsonl").is_file():
        out.write_text((sweep / "results.jsonl").read_text())
        return
    order = {spec: i for i, spec in enumerate(PATTERNS.values())}
    rows = [json.loads(p.read_text()) for p in sweep.glob("*/seed*/sweep_result.json")]
    rows.sort(key=lambda r: (order[r["overrides"]["model.attention_pattern"]], r["seed"]))
    out.write_text("".join(json.dumps(r) + "\n" for r in rows))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--collect", default="", help="a sweep folder to read the rows from")
    args = parser.parse_args()
    if args.collect:
        collect(Path(args.collect), HERE / "listops_results.jsonl")
    rows = load_rows(HERE / "listops_results.jsonl")
    cost = json.loads((HERE / "cost.json").read_text())
    majority = majority_share()
    (HERE / "table.md").write_text(table(rows, cost, majority))
    draw(rows, majority, HERE / "listops.png")
    print((HERE / "table.md").read_text())


if __name__ == "__main__":
    main()
