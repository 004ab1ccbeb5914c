"""What starting every packed sequence on a multiple of P tokens costs, in tokens a step.

  python benchmarks/packing_alignment.py [--periods 1,8,16,32,64]

A packer that starts each sequence at a multiple of a sparse pattern's period (its
block size, its stride) makes blocks and strides counted from the row's start the
sequence's own: one way to make packing invisible to row-anchored patterns. The cost is
padding: each sequence occupies its length rounded up to a multiple of P. This plans the
first-fit packing the training pipeline uses (``data.packing.plan_rows``, the same
shuffled order for every P) of two recipes' real training examples:

- the demo (``ende_small``: Ding EN->DE pairs, rows of 64, 32 rows a step, source and
  target packed together);
- the language model (``lm_small``: KJV verses, rows of 128, 16 rows a step);

and prints the real (non-padding) tokens a step at each period and their ratio to
P = 1 (every length rounded up, the last sequence of a row too: an upper bound on the
cost by at most one period a row). Writes benchmarks/results/packing_alignment.{json,md}.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks.packing import _examples as demo_examples  # noqa: E402
from flaxformer_lite.data import packing, sources  # noqa: E402
from flaxformer_lite.data.tokenizer import Tokenizer, train_tokenizer  # noqa: E402

RECIPES = {"demo (ende_small)": (64, 32), "LM (lm_small)": (128, 16)}  # row length, rows


def _lm_lengths(data_dir: str) -> np.ndarray:
    texts = [t for (t,) in sources.load_texts("bible_en_es", "train", ("en",), data_dir)]
    path = Path(data_dir) / "bench_lm_tokenizer.model"
    tokenizer = Tokenizer.load(path) if path.exists() else train_tokenizer(iter(texts), path, 8000)
    lengths = np.asarray([len(tokenizer.encode(t)) + 1 for t in texts])  # + EOS
    return np.minimum(lengths, 128)[:, None]  # a longer verse is cut to the row


def _tokens_per_step(lengths: np.ndarray, period: int, rows: int, length: int) -> float:
    rounded = -(-lengths // period) * period
    order = np.random.default_rng(0).permutation(len(lengths))
    _, bounds = packing.plan_rows(rounded[order], rows, length)
    steps = len(bounds) - 1
    return float(lengths.sum()) / steps


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--periods", default="1,8,16,32,64")
    parser.add_argument("--data_dir", default="data/tfds")
    parser.add_argument("--out", default=str(ROOT / "benchmarks" / "results"))
    args = parser.parse_args()
    periods = [int(p) for p in args.periods.split(",")]
    demo = np.asarray([[len(e["inputs"]), len(e["targets"])] for e in demo_examples(args.data_dir)])
    corpora = {"demo (ende_small)": demo, "LM (lm_small)": _lm_lengths(args.data_dir)}
    rows = []
    for name, lengths in corpora.items():
        length, batch = RECIPES[name]
        base = _tokens_per_step(lengths, 1, batch, length)
        for period in periods:
            if length % period:
                continue
            tokens = _tokens_per_step(lengths, period, batch, length)
            rows.append({"recipe": name, "period": period, "tokens_per_step": tokens,
                         "ratio": tokens / base, "examples": int(len(lengths))})  # fmt: skip
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "packing_alignment.json").write_text(json.dumps(rows, indent=1) + "\n")
    lines = [
        "# Packing with every sequence starting at a multiple of P",
        "",
        "`python benchmarks/packing_alignment.py`: real (non-padding) tokens a step of the",
        "first-fit packer when each sequence's length is rounded up to a multiple of P,",
        "against P = 1 (the same order, the same rows).",
        "",
        "| recipe | P | real tokens / step | vs P = 1 |",
        "|---|---:|---:|---:|",
        *(f"| {r['recipe']} | {r['period']} | {r['tokens_per_step']:.0f} | {r['ratio']:.3f} |"
          for r in rows),
    ]  # fmt: skip
    (out / "packing_alignment.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
