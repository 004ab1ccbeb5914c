"""Table 3 in miniature: the row sweeps of run.sh into results.json, table.md and
table3.png, with each row's change against the base model and the paper's direction.

  .venv/bin/python experiments/table3_mini/report.py [--runs=experiments/table3_mini/runs]
  .venv/bin/python experiments/table3_mini/report.py --restore   # before re-running sweeps

The record is results.jsonl here (every run's row; flaxformer_lite/sweep/record.py),
gathered from the sweep folders under --runs when they exist (they are not committed)
and read from here otherwise, so a fresh clone redraws every table and figure.

A change moves (up or down) when its mean differs from the base's by more than the two
standard deviations combined (sqrt(s_row^2 + s_base^2)); then it is in the paper's
direction or against it; inside that spread it is "within noise" (nothing either way).
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
from pathlib import Path

import matplotlib

from flaxformer_lite.sweep import record

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

HERE = Path(__file__).resolve().parent

# (sweep, point, label, the paper's direction for perplexity and for BLEU (+1 up, -1 down,
#  0 no change), what the paper's Table 3 reports for the corresponding change of its
#  base model: N=6, d_model 512, d_ff 2048, h 8, d_k 64, P_drop 0.1, eps_ls 0.1: PPL 4.92,
#  BLEU 25.8). Ours: 2+2 layers, 128 wide, d_ff 512, h 4, d_k 32, the same dropout and
#  smoothing; a change of ours maps to the paper's change by the same factor. The paper's
#  direction is the sign of its change where |dPPL| > 0.05 or |dBLEU| > 0.3, else none.
ROWS = [
    ("A_heads", "num_heads=1", "A: 1 head (d_k 128)", +1, -1, "h 1: PPL 5.29, BLEU 24.9"),
    ("A_heads", "num_heads=2", "A: 2 heads (d_k 64)", +1, 0, "h 4: PPL 5.00, BLEU 25.5"),
    ("A_heads", "num_heads=8", "A: 8 heads (d_k 16)", 0, 0, "h 16: PPL 4.91, BLEU 25.8"),
    ("B_dk", "d_k=16", "B: d_k 16 (4 heads)", +1, -1, "d_k 32: PPL 5.01, BLEU 25.4"),
    (
        "C_layers",
        "num_encoder_layers+num_decoder_layers=1",
        "C: 1+1 layers",
        +1,
        -1,
        "N 4: PPL 5.19, BLEU 25.3",
    ),
    (
        "C_layers",
        "num_encoder_layers+num_decoder_layers=3",
        "C: 3+3 layers",
        -1,
        0,
        "N 8: PPL 4.88, BLEU 25.5",
    ),
    ("C_width", "d_model=64", "C: d_model 64 (d_k 16)", +1, -1, "d_model 256: PPL 5.75, BLEU 24.5"),
    (
        "D_dropout",
        "embedding_dropout+residual_dropout=0.0",
        "D: dropout 0.0",
        +1,
        -1,
        "P_drop 0.0: PPL 5.77, BLEU 24.6",
    ),
    (
        "D_dropout",
        "embedding_dropout+residual_dropout=0.3",
        "D: dropout 0.3",
        0,
        0,
        "P_drop 0.2: PPL 4.95, BLEU 25.5",
    ),
    (
        "D_smoothing",
        "label_smoothing=0.0",
        "D: label smoothing 0.0",
        -1,
        -1,
        "eps 0.0: PPL 4.67, BLEU 25.3",
    ),
    ("E_positions", "positional=learned", "E: learned positions", 0, 0, "PPL 4.92, BLEU 25.7"),
    ("ln", "ln_position=pre", "pre-LN (not in Table 3)", 0, 0, "—"),
    ("tying", "tie_embeddings=none", "untied embeddings (not in Table 3)", 0, 0, "—"),
]
METRICS = ("valid_perplexity", "test_bleu")


def stats(rows: list[dict], key: str) -> dict | None:
    values = [r[key] for r in rows if r.get("status") == "ok" and r.get(key) is not None]
    if not values:
        return None
    return {
        "mean": statistics.fmean(values),
        "std": statistics.stdev(values) if len(values) > 1 else 0.0,
        "seeds": len(values),
    }


def load() -> dict[tuple[str, str], list[dict]]:
    out: dict[tuple[str, str], list[dict]] = {}
    for row in record.rows(HERE):
        out.setdefault((row["sweep"], row["run"].rpartition("/")[0]), []).append(row)
    return out


def verdict(row: dict, base: dict, direction: int | None) -> str:
    """``direction``: the paper's sign of the change (0: none; None: the paper has no row)."""
    delta = row["mean"] - base["mean"]
    spread = math.hypot(row["std"], base["std"])
    if abs(delta) <= spread:
        return (
            "within noise"
            if direction
            else "no change" + ("" if direction is None else " (as the paper)")
        )
    moved = "up" if delta > 0 else "down"
    if direction is None:
        return moved
    if direction == 0:
        return f"{moved}; the paper: no change"
    return (
        f"{moved}: the paper's direction"
        if (delta > 0) == (direction > 0)
        else f"{moved}: against the paper"
    )


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
    found = load()
    base_rows = found.get(("base", "base"), [])
    base = {m: stats(base_rows, m) for m in METRICS}
    base["parameters"] = base_rows[0]["parameters"] if base_rows else None
    base["steps"] = base_rows[0]["steps"] if base_rows else None
    table = []
    for sweep, point, label, ppl_dir, bleu_dir, paper in ROWS:
        rows = found.get((sweep, point))
        if not rows or base["valid_perplexity"] is None:
            continue
        entry = {"row": label, "sweep": sweep, "point": point, "paper": paper}
        entry["parameters"] = rows[0].get("parameters")
        for m in METRICS:
            entry[m] = stats(rows, m)
        in_paper = paper != "—"
        for m, direction in (("valid_perplexity", ppl_dir), ("test_bleu", bleu_dir)):
            ok = entry[m] is not None and base[m] is not None
            entry[f"verdict_{m}"] = (
                verdict(entry[m], base[m], direction if in_paper else None) if ok else "—"
            )
        table.append(entry)
    result = {"base": base, "rows": table}
    (HERE / "results.json").write_text(json.dumps(result, indent=2) + "\n")

    def fmt(s, digits):
        return "—" if s is None else f"{s['mean']:.{digits}f} ± {s['std']:.{digits}f}"

    lines = [
        "| row | params | valid PPL | test BLEU | the paper (base: PPL 4.92, BLEU 25.8) "
        "| PPL | BLEU |",
        "|---|---:|---:|---:|---|---|---|",
        f"| base (ding_mini) | {base['parameters'] or 0:,} | "
        f"{fmt(base['valid_perplexity'], 2)} | {fmt(base['test_bleu'], 2)} | | | |",
    ]
    for e in table:
        lines.append(
            f"| {e['row']} | {e['parameters'] or 0:,} | {fmt(e['valid_perplexity'], 2)} | "
            f"{fmt(e['test_bleu'], 2)} | {e['paper']} | {e['verdict_valid_perplexity']} "
            f"| {e['verdict_test_bleu']} |"
        )
    (HERE / "table.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    if table:
        draw(base, table)


def draw(base: dict, table: list[dict]) -> None:
    fig, axes = plt.subplots(1, 2, figsize=(10, 0.4 * len(table) + 1.6), sharey=True)
    for ax, metric, label in (
        (axes[0], "valid_perplexity", "validation perplexity"),
        (axes[1], "test_bleu", "test BLEU (300 sentences)"),
    ):
        b = base[metric]
        shown = [e for e in table if e[metric] is not None]
        deltas = [e[metric]["mean"] - b["mean"] for e in shown]
        errors = [math.hypot(e[metric]["std"], b["std"]) for e in shown]
        rows = [table.index(e) for e in shown]
        ax.barh(rows, deltas, xerr=errors, color="#8fb3d9", capsize=3)
        ax.axvline(0, color="k", lw=1)
        ax.set_xlabel(f"{label} minus the base's\n(bars: combined std of the two)")
    axes[0].set_yticks(range(len(table)), [e["row"] for e in table], fontsize=8)
    axes[0].invert_yaxis()
    fig.suptitle(
        f"Table 3 in miniature (ding_mini, {base['steps']} steps, 3 seeds; "
        f"base PPL {base['valid_perplexity']['mean']:.1f}, BLEU {base['test_bleu']['mean']:.2f})",
        fontsize=9,
    )
    fig.tight_layout()
    fig.savefig(HERE / "table3.png", dpi=100)


if __name__ == "__main__":
    main()
