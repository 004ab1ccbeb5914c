"""Input pipeline: tokenize, filter/truncate, resample; evaluation batches.

Training batches are packed by :mod:`~flaxformer_lite.data.packing` (several
sentence pairs share a row of ``max_length`` tokens, told apart by segment ids);
evaluation batches are padded one pair per row (:func:`eval_batches`).

The training splits are tokenized once per corpus and tokenizer into the token cache
(:mod:`~flaxformer_lite.data.token_store`); the functions here tokenize small splits
in memory (validation, running text, subword samples). The per-step work is index
lookups and first-fit packing in a prefetch thread, so the training step never waits
on data (benchmarks/train_step.py prints the real/synthetic step-time ratio). The
texts come from :mod:`~flaxformer_lite.data.sources`, a run's examples from
:mod:`~flaxformer_lite.data.assembly`.

A batch is a dict of int32 numpy arrays ``[batch, max_length]``: ``inputs``,
``targets`` and, when packed, ``inputs_segment_ids``, ``inputs_positions``,
``targets_segment_ids``, ``targets_positions``.

Resuming: the training iterator's position is a small JSON state
(``iterator.get_state()``: epoch, chunk, batch) stored with each checkpoint;
restoring it replays the same data order.
"""

from __future__ import annotations

import dataclasses
import threading
from collections.abc import Sequence

import numpy as np

from flaxformer_lite.config.experiment import TOO_LONG
from flaxformer_lite.data.packing import pad_batch
from flaxformer_lite.data.table import ExampleTable
from flaxformer_lite.data.tokenizer import EOS_ID, PAD_ID, Tokenizer


@dataclasses.dataclass(frozen=True)
class PipelineStats:
    """What tokenization kept and dropped of a split."""

    examples: int
    dropped_too_long: int
    truncated: int
    dropped_empty: int


def tokenize_pairs(
    pairs: Sequence[tuple[str, ...]],
    tokenizer: Tokenizer,
    max_length: int,
    too_long: str = "drop",
    kept_texts: list | None = None,
) -> tuple[list[dict[str, np.ndarray]], PipelineStats]:
    """Token ids (+EOS) of each (source, target) pair, or of each (text,) for a language
    model (feature ``targets`` only); entries over ``max_length`` dropped or truncated.
    ``kept_texts``, if given, receives the texts of the returned examples, in order."""
    if too_long not in TOO_LONG:
        raise ValueError(f"data.too_long={too_long!r} must be one of {', '.join(TOO_LONG)}")
    out, long_dropped, truncated, empty = [], 0, 0, 0
    for texts in pairs:
        keys = ("inputs", "targets") if len(texts) == 2 else ("targets",)
        if not all(t.strip() for t in texts):
            empty += 1
            continue
        ids = [tokenizer.side(i).encode(t) for i, t in enumerate(texts)]
        if max(len(x) for x in ids) > max_length:
            if too_long == "drop":
                long_dropped += 1
                continue
            truncated += 1
            ids = [
                np.append(x[: max_length - 1], EOS_ID).astype(np.int32)
                if len(x) > max_length
                else x
                for x in ids
            ]
        out.append(dict(zip(keys, ids, strict=True)))
        if kept_texts is not None:
            kept_texts.append(texts)
    return out, PipelineStats(len(out), long_dropped, truncated, empty)


def stream_rows(
    texts: Sequence[tuple[str, ...]], tokenizer: Tokenizer, max_length: int
) -> tuple[list[dict[str, np.ndarray]], PipelineStats]:
    """A language model's running text: the texts in order, each ending in EOS,
    concatenated and cut into rows of ``max_length`` tokens (the last one may be
    shorter). Nothing is dropped or truncated; attention spans text boundaries."""
    kept = [text for (text,) in texts if text.strip()]
    empty = len(texts) - len(kept)
    ids = tokenizer.encode_batch(kept) if kept else []
    if not ids:
        return [], PipelineStats(0, 0, 0, empty)
    stream = np.concatenate(ids).astype(np.int32)
    rows = [{"targets": stream[i : i + max_length]} for i in range(0, len(stream), max_length)]
    return rows, PipelineStats(len(rows), 0, 0, empty)


_SENTENCEPIECE_SAMPLING = threading.Lock()


class SubwordSampler:
    """Subword regularization (Kudo, 2018): epoch ``e``'s copy of the training
    examples, each side segmented by sampling from the unigram model (smoothing
    ``alpha``). Deterministic per (seed, epoch), so a resumed run sees the same
    segmentations; an example whose sample exceeds ``max_length`` keeps its best
    segmentation (``examples``)."""

    def __init__(
        self, texts, examples, tokenizer: Tokenizer, alpha: float, max_length: int, seed: int
    ):
        if len(texts) != len(examples):
            raise ValueError(f"{len(texts)} texts for {len(examples)} examples")
        self.texts, self.examples, self.tokenizer = texts, examples, tokenizer
        self.alpha, self.max_length, self.seed = alpha, max_length, seed

    def __call__(self, epoch: int) -> list[dict[str, np.ndarray]]:
        with _SENTENCEPIECE_SAMPLING:
            return self._sample(epoch)

    def _sample(self, epoch: int) -> list[dict[str, np.ndarray]]:
        import sentencepiece as spm

        # sentencepiece samples from one generator for the whole process: the seed
        # and every draw of an epoch happen under the lock, or another thread's
        # sampler (an iterator prefetching its next epoch) reseeds it mid-epoch.
        spm.set_random_generator_seed(
            int(np.random.default_rng([self.seed, epoch]).integers(2**31))
        )
        out, sides = [], [self.tokenizer.side(i) for i in range(2)]
        for texts, example in zip(self.texts, self.examples, strict=True):
            ids = [
                np.asarray(sides[i].ids([t], self.alpha)[0] + [EOS_ID], np.int32)
                for i, t in enumerate(texts)
            ]
            if max(len(x) for x in ids) > self.max_length:
                out.append(example)
            else:
                out.append(dict(zip(example, ids, strict=True)))
        return out


class SubsetSampler:
    """Epoch ``e``'s training examples: all of ``fixed``, then ``count`` examples of
    each ``(pool, count)`` in ``pools``, drawn in turn from a reshuffled pool (one
    permutation after another, seeded by ``seed``), so every example of a pool is
    seen once before any is seen again, and each epoch has the same number of
    examples (``data.resample_subsets``). Deterministic per (seed, epoch)."""

    def __init__(self, fixed, pools, seed: int):
        self.fixed, self.seed = ExampleTable.of(fixed), seed
        self.pools = [(ExampleTable.of(pool), count) for pool, count in pools]
        for pool, count in self.pools:
            if not 0 < count <= len(pool):
                raise ValueError(f"cannot draw {count} of a pool of {len(pool)} examples")

    def __len__(self) -> int:
        return len(self.fixed) + sum(count for _, count in self.pools)

    def indices(self, k: int, epoch: int) -> np.ndarray:
        """Pool ``k``'s draw for ``epoch``: positions ``epoch * count`` onwards in the
        endless sequence of the pool's permutations."""
        pool, count = self.pools[k]
        start, out = epoch * count, []
        while count > 0:
            cycle, offset = divmod(start, len(pool))
            perm = np.random.default_rng([self.seed, k, cycle]).permutation(len(pool))
            chunk = perm[offset : offset + count]
            out.append(chunk)
            start, count = start + len(chunk), count - len(chunk)
        return np.concatenate(out)

    def __call__(self, epoch: int) -> ExampleTable:
        draws = [pool.take(self.indices(k, epoch)) for k, (pool, _) in enumerate(self.pools)]
        return ExampleTable.concat([self.fixed, *draws])


def eval_batches(
    examples: Sequence[dict[str, np.ndarray]], *, batch_size: int, max_length: int
) -> list[dict[str, np.ndarray]]:
    """Padded evaluation batches, one pair per row; the last batch is padded with empty rows."""
    batches = []
    for start in range(0, len(examples), batch_size):
        chunk = list(examples[start : start + batch_size])
        batch = pad_batch(chunk, max_length)
        if len(chunk) < batch_size:  # keep one static shape: fill with all-padding rows
            fill = batch_size - len(chunk)
            batch = {
                k: np.concatenate([v, np.zeros((fill, max_length), v.dtype)])
                for k, v in batch.items()
            }
        batches.append(batch)
    return batches


def synthetic_batch(
    batch_size: int, max_length: int, vocab_size: int, seed: int = 0, mean_length: int = 14
) -> dict[str, np.ndarray]:
    """A packed batch of random tokens, shaped like the real ones (for benchmarks)."""
    rng = np.random.default_rng(seed)
    batch: dict[str, np.ndarray] = {}
    for key in ("inputs", "targets"):
        tokens = rng.integers(4, vocab_size, (batch_size, max_length)).astype(np.int32)
        seg = np.zeros((batch_size, max_length), np.int32)
        pos = np.zeros((batch_size, max_length), np.int32)
        for row in range(batch_size):
            start, s = 0, 1
            while start + mean_length <= max_length:
                seg[row, start : start + mean_length] = s
                pos[row, start : start + mean_length] = np.arange(mean_length)
                start, s = start + mean_length, s + 1
        tokens[seg == 0] = PAD_ID
        batch[key], batch[f"{key}_segment_ids"], batch[f"{key}_positions"] = tokens, seg, pos
    return batch


def describe(batch: dict[str, np.ndarray]) -> str:
    """Fill ratio of a batch (non-pad tokens / slots), for logs."""
    fill = {k: float((batch[k] != PAD_ID).mean()) for k in ("inputs", "targets") if k in batch}
    return ", ".join(f"{k} {v:.0%} full" for k, v in fill.items())
