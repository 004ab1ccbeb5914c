"""Packing on the real corpus: grain's first-fit packer against the hand-written one.

  python benchmarks/packing.py [--batches 300] [--rounds 5]

Both pack the same tokenized Ding training pairs (the default config's shape:
rows of 64 tokens, 32 rows a batch, source and target fitting together) in the
same shuffled order. Each round draws ``--batches`` batches from a fresh
iterator of each packer, alternating, with no prefetch thread, so the time is
the packer's own host work; the table gives the median tokens/s (non-padding
source + target tokens per second) over rounds, the ratio grain / hand-written
measured in the same process, and the padding fraction (empty slots / all
slots, source and target) of the batches drawn. Writes
benchmarks/results/packing.{json,md}.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from collections.abc import Sequence
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import grain  # noqa: E402
from grain import experimental as grain_exp  # noqa: E402

from flaxformer_lite.data import packing, pipeline, sources  # noqa: E402
from flaxformer_lite.data.tokenizer import Tokenizer, train_tokenizer  # noqa: E402

BATCH, LENGTH, VOCAB = 32, 64, 8000


class EpochStream(grain.MapDataset):
    """The endless stream of training examples: element ``i`` is example ``i % n`` of
    epoch ``i // n``, where an epoch is the examples (``resample(epoch)`` if given, the
    same ``n`` in the same order) in a permutation seeded by ``(seed, epoch)``. A
    position in the stream is one integer, so grain's iterators checkpoint it exactly."""

    def __init__(self, examples: Sequence[dict[str, np.ndarray]], seed: int, resample=None):
        super().__init__()
        self.examples, self.seed, self.resample = list(examples), seed, resample
        self.n = len(self.examples)
        self._epoch: tuple[int, list, np.ndarray] | None = None

    def __len__(self) -> int:
        return sys.maxsize

    def epoch(self, epoch: int) -> tuple[list, np.ndarray]:
        """(that epoch's examples, their order)."""
        if self._epoch is None or self._epoch[0] != epoch:
            examples = self.resample(epoch) if self.resample is not None else self.examples
            if len(examples) != self.n:
                raise ValueError(f"epoch {epoch} has {len(examples)} examples, not {self.n}")
            order = np.random.default_rng([self.seed, epoch]).permutation(self.n)
            self._epoch = (epoch, examples, order)
        return self._epoch[1], self._epoch[2]

    def __getitem__(self, index):
        if isinstance(index, slice):
            return self.slice(index)
        epoch, k = divmod(int(index), self.n)
        examples, order = self.epoch(epoch)
        return examples[order[k]]


def grain_packed(examples, *, batch_size: int, max_length: int, seed: int):
    """Batches of grain's first-fit packer over the same shuffled epochs: ``batch_size``
    bins of ``max_length`` per feature, all emitted as one batch when an example fits
    none (the hand-written packer's rule, so the first epoch's batches are identical)."""
    ds = grain_exp.FirstFitPackIterDataset(
        EpochStream(examples, seed).to_iter_dataset(),
        length_struct={key: max_length for key in examples[0]},
        num_packing_bins=batch_size,
        shuffle_bins=False,
    ).batch(batch_size)
    return iter(ds)


def _examples(data_dir: str) -> list[dict[str, np.ndarray]]:
    pairs = sources.load_text_pairs("ding_de_en", "train", "en", "de", data_dir)
    path = Path(data_dir) / "bench_tokenizer.model"
    tokenizer = (
        Tokenizer.load(path)
        if path.exists()
        else train_tokenizer((s for p in pairs for s in p), path, VOCAB)
    )
    return pipeline.tokenize_pairs(pairs, tokenizer, LENGTH)[0]


def _draw(make, batches: int) -> tuple[float, int, int]:
    """(seconds, non-padding tokens, slots) of ``batches`` batches of a fresh iterator."""
    iterator = make()
    tokens = slots = 0
    start = time.perf_counter()
    for _ in range(batches):
        batch = next(iterator)
        for key in ("inputs", "targets"):
            tokens += int((batch[key] != 0).sum())
            slots += batch[key].size
    seconds = time.perf_counter() - start
    iterator.close()
    return seconds, tokens, slots


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batches", type=int, default=300)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--data_dir", default="data/tfds")
    parser.add_argument("--out", default=str(ROOT / "benchmarks" / "results"))
    args = parser.parse_args()
    examples = _examples(args.data_dir)
    shape = dict(batch_size=BATCH, max_length=LENGTH, seed=0)
    packers = {
        "hand-written": lambda: packing.train_iterator(examples, prefetch=0, **shape),
        "grain": lambda: grain_packed(examples, **shape),
    }
    iterators = [make() for make in packers.values()]
    first = [next(iterator) for iterator in iterators]
    for iterator in iterators:
        iterator.close()
    same = all(np.array_equal(first[0][k], first[1][k]) for k in first[0])
    speed = {name: [] for name in packers}
    padding = {}
    for _ in range(args.rounds):
        for name, make in packers.items():
            seconds, tokens, slots = _draw(make, args.batches)
            speed[name].append(tokens / seconds)
            padding[name] = 1 - tokens / slots
    rows = [
        {
            "packer": name,
            "tokens_per_s": statistics.median(speed[name]),
            "rounds": speed[name],
            "padding_fraction": padding[name],
        }
        for name in packers
    ]
    ratio = rows[1]["tokens_per_s"] / rows[0]["tokens_per_s"]
    result = {
        "examples": len(examples),
        "batch": BATCH,
        "length": LENGTH,
        "batches_per_round": args.batches,
        "rows": rows,
        "grain_over_hand_written": ratio,
        "first_batch_identical": same,
    }
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "packing.json").write_text(json.dumps(result, indent=2))
    lines = [
        "# Packing: grain's first-fit packer vs the hand-written one",
        "",
        f"`python benchmarks/packing.py --batches {args.batches} --rounds {args.rounds}`: "
        f"{len(examples)} Ding training pairs, {BATCH} rows of {LENGTH} tokens a batch, "
        "no prefetch thread (the packer's own host work), rounds alternating in one process.",
        "",
        "| packer | tokens/s (median) | padding fraction |",
        "|---|---|---|",
    ]
    for row in rows:
        lines.append(
            f"| {row['packer']} | {row['tokens_per_s']:,.0f} | {row['padding_fraction']:.4f} |"
        )
    lines += [
        "",
        f"grain / hand-written tokens/s: **{ratio:.3f}**; first batch identical: {same}",
        "",
    ]
    (out / "packing.md").write_text("\n".join(lines))
    print("\n".join(lines))


if __name__ == "__main__":
    main()
