"""The recipe's ladder and its seeds as a figure, from results.json.

.venv/bin/python experiments/translation_recipe/plot.py    # writes ladder.png
"""

import json
import statistics
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

HERE = Path(__file__).resolve().parent


def main() -> None:
    results = json.loads((HERE / "results.json").read_text())
    ladder = results["ladder"]
    seeds = [s["test_bleu"] for s in results["seeds"]]
    fig, ax = plt.subplots(figsize=(8, 0.42 * len(ladder) + 1.6))
    names = [row["recipe"] for row in ladder]
    ax.barh(range(len(ladder)), [row["test_bleu"] for row in ladder], color="#8fb3d9")
    last = len(ladder) - 1
    ax.errorbar(
        statistics.fmean(seeds), last, xerr=statistics.stdev(seeds), fmt="o", color="k",
        capsize=4, label=f"4 seeds: {statistics.fmean(seeds):.2f} ± {statistics.stdev(seeds):.2f}",
    )  # fmt: skip
    ax.set_yticks(range(len(ladder)), names, fontsize=7)
    ax.invert_yaxis()
    ax.set_xlabel("test BLEU (1,005 sentences, beam 4)")
    ax.set_title("ende_small on Ding: each row adds one change to the row above", fontsize=9)
    ax.legend(fontsize=8, loc="lower right")
    ax.grid(axis="x", alpha=0.3)
    fig.tight_layout()
    fig.savefig(HERE / "ladder.png", dpi=100)


if __name__ == "__main__":
    main()
