"""Table 3 in miniature: gather the row sweeps of run.sh into results.json, table.md and
table3.png, with each row's change against the base model and the paper's direction.

  .venv/bin/python experiments/table3_mini/report.py [--runs=experiments/table3_mini/runs]

A change "moves in the paper's direction" when its mean differs from the base's by
more than the two standard deviations combined (sqrt(s_row^2 + s_base^2)) and has the
paper's sign; inside that spread it is "within noise" (nothing either way).
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

HERE = Path(__file__).resolve().parent

# (sweep, point, label, the paper's direction for perplexity: +1 worse, -1 better, 0 none,
#  what the paper reports for the corresponding change of its base model)
ROWS = [
    ("A_heads", "num_heads=1", "A: 1 head (d_k 128)", +1, "1 head: PPL 5.29 vs 4.92, BLEU -0.9"),
    ("A_heads", "num_heads=2", "A: 2 heads (d_k 64)", 0, "4 heads: PPL 5.00 (worse, slightly)"),
    ("A_heads", "num_heads=8", "A: 8 heads (d_k 16)", 0, "16 heads: PPL 4.91 (as base)"),
    ("B_dk", "d_k=16", "B: d_k 16 (4 heads)", +1, "d_k 32: PPL 5.01 vs 4.92"),
    ("B_dk", "d_k=8", "B: d_k 8 (4 heads)", +1, "d_k 16: PPL 5.16 vs 4.92"),
    ("C_layers", "num_encoder_layers+num_decoder_layers=1", "C: 1+1 layers", +1, "N=2: PPL 6.11"),
    ("C_layers", "num_encoder_layers+num_decoder_layers=3", "C: 3+3 layers", -1, "N=8: PPL 4.88"),
    ("C_width", "d_model=64", "C: d_model 64", +1, "d_model 256: PPL 5.75"),
    ("C_width", "d_model=256", "C: d_model 256", -1, "d_model 1024: PPL 4.66"),
    ("C_ffn", "d_ff=256", "C: d_ff 256", +1, "d_ff 1024: PPL 5.12"),
    ("C_ffn", "d_ff=1024", "C: d_ff 1024", -1, "d_ff 4096: PPL 4.75"),
    (
        "D_dropout",
        "embedding_dropout+residual_dropout=0.0",
        "D: dropout 0.0",
        +1,
        "P_drop 0.0: PPL 5.77",
    ),
    (
        "D_dropout",
        "embedding_dropout+residual_dropout=0.2",
        "D: dropout 0.2",
        0,
        "P_drop 0.2: PPL 4.95 (as base)",
    ),
    ("D_smoothing", "label_smoothing=0.0", "D: label smoothing 0.0", -1, "eps 0.0: PPL 4.67"),
    ("D_smoothing", "label_smoothing=0.2", "D: label smoothing 0.2", +1, "eps 0.2: PPL 5.47"),
    (
        "E_positions",
        "positional=learned",
        "E: learned positions",
        0,
        "PPL 4.92, BLEU 25.7 (as base)",
    ),
    ("ln", "ln_position=pre", "pre-LN (not in the paper)", 0, "—"),
    ("tying", "tie_embeddings=none", "untied embeddings (not in Table 3)", 0, "—"),
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


def load(runs: Path) -> dict[tuple[str, str], list[dict]]:
    out: dict[tuple[str, str], list[dict]] = {}
    for sweep in sorted(p for p in runs.iterdir() if (p / "results.jsonl").is_file()):
        for line in (sweep / "results.jsonl").read_text().splitlines():
            row = json.loads(line)
            out.setdefault((sweep.name, row["run"].rpartition("/")[0]), []).append(row)
    return out


def verdict(row: dict, base: dict, direction: int) -> str:
    delta = row["mean"] - base["mean"]
    spread = math.hypot(row["std"], base["std"])
    if abs(delta) <= spread:
        return "within noise" if direction else "no change (as in the paper)"
    if direction == 0:
        return "moves; the paper saw none"
    return "paper's direction" if (delta > 0) == (direction > 0) else "against the paper"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--runs", type=Path, default=HERE / "runs")
    args = parser.parse_args()
    found = load(args.runs)
    base_rows = found.get(("base", "base"), [])
    base = {m: stats(base_rows, m) for m in METRICS}
    base["parameters"] = base_rows[0]["parameters"] if base_rows else None
    table = []
    for sweep, point, label, direction, paper in ROWS:
        rows = found.get((sweep, point))
        if not rows or base["valid_perplexity"] is None:
            continue
        entry = {"row": label, "sweep": sweep, "point": point, "paper": paper}
        entry["parameters"] = rows[0].get("parameters")
        for m in METRICS:
            entry[m] = stats(rows, m)
        ppl = entry["valid_perplexity"]
        entry["verdict"] = verdict(ppl, base["valid_perplexity"], direction) if ppl else "—"
        table.append(entry)
    result = {"base": base, "rows": table}
    (HERE / "results.json").write_text(json.dumps(result, indent=2) + "\n")

    def fmt(s, digits):
        return "—" if s is None else f"{s['mean']:.{digits}f} ± {s['std']:.{digits}f}"

    lines = [
        "| row | params | valid PPL | test BLEU | paper (base: PPL 4.92, BLEU 25.8) "
        "| verdict (PPL) |",
        "|---|---:|---:|---:|---|---|",
        f"| base (ding_mini) | {base['parameters'] or 0:,} | "
        f"{fmt(base['valid_perplexity'], 2)} | {fmt(base['test_bleu'], 2)} | | |",
    ]
    for e in table:
        lines.append(
            f"| {e['row']} | {e['parameters'] or 0:,} | {fmt(e['valid_perplexity'], 2)} | "
            f"{fmt(e['test_bleu'], 2)} | {e['paper']} | {e['verdict']} |"
        )
    (HERE / "table.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))

    if table:
        fig, ax = plt.subplots(figsize=(8, 0.4 * len(table) + 1.5))
        b = base["valid_perplexity"]
        deltas = [e["valid_perplexity"]["mean"] - b["mean"] for e in table]
        errors = [math.hypot(e["valid_perplexity"]["std"], b["std"]) for e in table]
        ax.barh(range(len(table)), deltas, xerr=errors, color="#8fb3d9", capsize=3)
        ax.axvline(0, color="k", lw=1)
        ax.set_yticks(range(len(table)), [e["row"] for e in table], fontsize=8)
        ax.invert_yaxis()
        ax.set_xlabel("validation perplexity minus the base's (bars: combined std)")
        ax.set_title("Table 3 in miniature (ding_mini, 600 steps, 3 seeds)", fontsize=9)
        fig.tight_layout()
        fig.savefig(HERE / "table3.png", dpi=100)


if __name__ == "__main__":
    main()
