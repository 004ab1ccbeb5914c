"""Collect the tokenizer-sample runs into results.json and print their table.

  python experiments/tokenizer_sample/collect.py RUNS_ROOT

RUNS_ROOT holds ``<sample>/seed<N>`` run folders (the README's commands): each one's
validation nll per piece at steps 1,400 and 1,560 (metrics.jsonl), the validation
split's target pieces and its total nll in nats at 1,400 (per piece is not comparable
across tokenizers that cut the same text into other pieces; the total is), and its
test BLEU and chrF (test_scores.json).
"""

from __future__ import annotations

import json
import statistics
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent


def _validation(run: Path) -> dict[int, dict]:
    rows = (json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines())
    return {r["step"]: r for r in rows if r.get("split") == "validation"}


def main() -> None:
    root = Path(sys.argv[1])
    rows = []
    for run in sorted(root.glob("*/seed*")):
        if not (run / "test_scores.json").is_file():
            continue
        scores = json.loads((run / "test_scores.json").read_text())
        nll = _validation(run)
        at = nll[1400]
        rows.append({
            "sample": run.parent.name, "seed": int(run.name[4:]),
            "nll_1400": at["nll"], "nll_1560": nll[1560]["nll"],
            "validation_pieces": at["tokens"], "nats_1400": at["nll"] * at["tokens"],
            "bleu": scores["bleu"], "chrf": scores["chrf"],
        })  # fmt: skip
    (HERE / "results.json").write_text(json.dumps(rows, indent=1) + "\n")
    for sample in sorted({r["sample"] for r in rows}):
        mine = [r for r in rows if r["sample"] == sample]
        line = [sample, f"{len(mine)} seeds"]
        for key in ("nll_1400", "validation_pieces", "nats_1400", "bleu", "chrf"):
            values = [r[key] for r in mine]
            spread = statistics.stdev(values) if len(values) > 1 else 0.0
            each = ", ".join(f"{v:.3f}" for v in values)
            line.append(f"{key} {statistics.mean(values):.3f} ± {spread:.3f} ({each})")
        print(" | ".join(line))


if __name__ == "__main__":
    main()
