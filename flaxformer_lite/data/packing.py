"""Packed training batches on grain: shuffle, first-fit pack, shard, batch, prefetch.

Several sentence pairs share a row of ``max_length`` tokens, told apart by
``*_segment_ids`` (1, 2, ...; 0 = padding) and restarted ``*_positions``; the model's
segment masks keep them apart, so a packed batch computes exactly what the same pairs
padded one per row would (tests/test_data_pipeline.py). Every packed example holds at
least two tokens (a piece and its EOS: :func:`~flaxformer_lite.data.pipeline.tokenize_pairs`
skips empty texts), so a row of n tokens holds at most n/2 examples, the bound cuDNN's
packed layout is given (model/kernels.py).

A batch is a dict of int32 numpy arrays ``[batch, max_length]``: ``inputs``,
``targets`` and, when packed, ``inputs_segment_ids``, ``inputs_positions``,
``targets_segment_ids``, ``targets_positions``. The per-step work is index lookups
and first-fit packing in a prefetch thread, so the training step never waits on data
(benchmarks/train_step.py prints the real/synthetic step-time ratio).

Resuming: the training iterator's position is a small JSON state
(``iterator.get_state()``) stored with each checkpoint; restoring it replays the same
data order.
"""

from __future__ import annotations

from collections.abc import Sequence

import grain
import numpy as np
from grain import experimental as grain_exp

from flaxformer_lite.data.tokenizer import PAD_ID


def pad_batch(examples: Sequence[dict[str, np.ndarray]], length: int) -> dict[str, np.ndarray]:
    batch = {}
    for key in examples[0]:
        arr = np.full((len(examples), length), PAD_ID, np.int32)
        for i, ex in enumerate(examples):
            arr[i, : len(ex[key])] = ex[key]
        batch[key] = arr
    return batch


def plan_epoch(
    lengths: np.ndarray, order: np.ndarray, batch_size: int, max_length: int
) -> list[list[list[int]]]:
    """First-fit packing plan of one epoch: batches -> rows -> example indices.

    Examples arrive in ``order``; each goes into the first of ``batch_size``
    open rows where all its features (source and target) still fit; when none
    has room, the open rows are emitted as a batch and a new batch starts with
    it. ``lengths`` is ``[n, features]`` token counts.
    """
    batches: list[list[list[int]]] = []
    rows: list[list[int]] = [[] for _ in range(batch_size)]
    room = np.full((batch_size, lengths.shape[1]), max_length, np.int64)
    for idx in order:
        need = lengths[idx]
        fits = np.flatnonzero((room >= need).all(axis=1))
        if fits.size == 0:
            batches.append(rows)
            rows = [[] for _ in range(batch_size)]
            room[:] = max_length
            fits = np.zeros(1, np.int64)
        r = int(fits[0])
        rows[r].append(int(idx))
        room[r] -= need
    if any(rows):
        batches.append(rows)
    return batches


class PackedBatchIterator(grain.DatasetIterator):
    """Endless packed batches; state = (epoch, batch in epoch), so resume is exact."""

    def __init__(self, ds: PackedTrainDataset):
        super().__init__()
        self._ds = ds
        self._epoch, self._batch = 0, 0
        self._plan: list | None = None

    def _current_plan(self) -> list:
        if self._plan is None:
            self._plan = self._ds.plan(self._epoch)
        return self._plan

    def __next__(self) -> dict[str, np.ndarray]:
        plan = self._current_plan()
        if self._batch >= len(plan):
            self._epoch, self._batch, self._plan = self._epoch + 1, 0, None
            plan = self._current_plan()
        rows = plan[self._batch]
        self._batch += 1
        return self._ds.materialize(rows, self._epoch)

    def get_state(self) -> dict:
        return {"epoch": self._epoch, "batch": self._batch}

    def set_state(self, state: dict) -> None:
        self._epoch, self._batch, self._plan = int(state["epoch"]), int(state["batch"]), None


# Why a hand-written packer and not grain's FirstFitPackIterDataset: grain's applies
# the same rule (all bins emitted when an example fits none) and gives the same
# batches and padding (7.5% vs 7.7% of slots: it also packs across epoch ends), but
# packs ~30x fewer tokens per second of host time (benchmarks/packing.py: 75k vs
# 2.4M tokens/s on the Ding pairs). The default run consumes ~7k tokens/s, so grain's
# packer would take ~10% of a core from a 2-core training step; plan_epoch works on
# the length table with numpy, grain's packer handles every example in Python.
class PackedTrainDataset(grain.IterDataset):
    """Training batches packed from pre-tokenized examples, reshuffled every epoch.

    ``resample``, if given, maps an epoch to that epoch's examples (the same pairs
    in the same order, e.g. a a ``pipeline.SubwordSampler``); it is called once per epoch.
    ``ids=(offset, stride)`` adds ``example_ids`` to every batch: ``[rows, max_length]``
    ids ``offset + stride * index`` of the examples packed in each row (-1 after them)
    plus ``epoch * 2**32``, for auditing the data order (pop it before the model).
    """

    def __init__(
        self,
        examples,
        *,
        batch_size: int,
        max_length: int,
        seed: int,
        pack: bool,
        resample=None,
        ids: tuple[int, int] | None = None,
    ):
        super().__init__()
        self.examples = examples
        self.ids = ids
        self.resample = resample
        self._epoch_cache: tuple[int, list, np.ndarray] | None = None
        self.keys = tuple(examples[0])  # ("inputs", "targets") or ("targets",) for an LM
        self.lengths = np.array([[len(e[k]) for k in self.keys] for e in examples])
        self.batch_size, self.max_length, self.seed, self.pack = (
            batch_size,
            max_length,
            seed,
            pack,
        )

    def epoch_examples(self, epoch: int) -> tuple[list, np.ndarray]:
        """(examples, their ``[n, features]`` lengths) of ``epoch``."""
        if self.resample is None:
            return self.examples, self.lengths
        if self._epoch_cache is None or self._epoch_cache[0] != epoch:
            examples = self.resample(epoch)
            lengths = np.array([[len(e[k]) for k in self.keys] for e in examples])
            self._epoch_cache = (epoch, examples, lengths)
        return self._epoch_cache[1], self._epoch_cache[2]

    def plan(self, epoch: int) -> list:
        order = np.random.default_rng([self.seed, epoch]).permutation(len(self.examples))
        if self.pack:
            lengths = self.epoch_examples(epoch)[1]
            return plan_epoch(lengths, order, self.batch_size, self.max_length)
        n = len(order) // self.batch_size * self.batch_size
        return [
            [[int(i)] for i in order[s : s + self.batch_size]] for s in range(0, n, self.batch_size)
        ]

    def materialize(self, rows: list[list[int]], epoch: int = 0) -> dict[str, np.ndarray]:
        examples = self.epoch_examples(epoch)[0]
        shape = (self.batch_size, self.max_length)
        out = {}
        for key in self.keys:
            tokens = np.zeros(shape, np.int32)
            seg = np.zeros(shape, np.int32)
            pos = np.zeros(shape, np.int32)
            for r, row in enumerate(rows):
                start = 0
                for s, idx in enumerate(row, start=1):
                    ids = examples[idx][key]
                    end = start + len(ids)
                    tokens[r, start:end] = ids
                    seg[r, start:end] = s
                    pos[r, start:end] = np.arange(len(ids))
                    start = end
            out[key] = tokens
            if self.pack:
                out[f"{key}_segment_ids"], out[f"{key}_positions"] = seg, pos
        if self.ids is not None:
            offset, stride = self.ids
            ids = np.full(shape, -1, np.int64)
            for r, row in enumerate(rows):
                ids[r, : len(row)] = [(epoch << 32) + offset + stride * i for i in row]
            out["example_ids"] = ids
        return out

    def __iter__(self) -> PackedBatchIterator:
        return PackedBatchIterator(self)


def train_iterator(
    examples: Sequence[dict[str, np.ndarray]],
    *,
    batch_size: int,
    max_length: int,
    seed: int,
    pack: bool = True,
    process_index: int = 0,
    process_count: int = 1,
    prefetch: int = 4,
    resample=None,
    shards: int = 0,
    example_ids: bool = False,
):
    """An endless, checkpointable iterator of training batches (reshuffled every epoch).

    The examples are cut into ``shards`` (0: one per process): shard ``s`` takes every
    ``shards``-th example from the ``s``-th and packs its own ``batch_size / shards``
    rows of every global batch. Process ``p`` of ``process_count`` reads the
    contiguous shards ``p * shards / process_count ...`` and returns their rows side by
    side (its ``batch_size / process_count`` local rows), so the global batch --
    the processes' rows in process order -- depends on ``shards`` only, not on how
    many processes read them. ``pack=False`` gives one pair per padded row (the
    baseline that packing is tested against). ``resample`` (epoch -> all examples,
    e.g. a a ``pipeline.SubwordSampler``) is sharded the same way. ``example_ids`` adds each
    batch's example ids (indices into ``examples``, see :class:`PackedTrainDataset`).
    """
    shards = shards or process_count
    if shards % process_count or batch_size % (shards // process_count):
        raise ValueError(
            f"data.shards={shards} must be a multiple of the {process_count} processes "
            f"and its share ({shards // process_count or 1}) must divide the "
            f"{batch_size} rows of this process; pick data.shards accordingly"
        )
    mine = shards // process_count
    examples = list(examples)
    parts = []
    for s in range(process_index * mine, (process_index + 1) * mine):
        shard = examples[s::shards]
        shard_resample = None
        if resample is not None:
            shard_resample = lambda epoch, s=s: resample(epoch)[s::shards]  # noqa: E731
        rows = batch_size // mine
        if len(shard) < rows:
            raise ValueError(
                f"{len(shard)} training examples in data shard {s} of {shards} cannot fill "
                f"its {rows} rows of a batch; lower the batch size or add data"
            )
        ds: grain.IterDataset = PackedTrainDataset(
            shard,
            batch_size=rows,
            max_length=max_length,
            seed=seed,
            pack=pack,
            resample=shard_resample,
            ids=(s, shards) if example_ids else None,
        )
        if prefetch > 0:
            ds = grain_exp.ThreadPrefetchIterDataset(ds, prefetch_buffer_size=prefetch)
        parts.append((s, iter(ds)))
    if shards == 1:
        return parts[0][1]
    return ShardedBatchIterator(parts)


class ShardedBatchIterator:
    """The batches of several data shards side by side (rows of shard after shard).

    Its state names each shard's position (``{"shards": {"3": {...}}}``), so that the
    states of all processes merge into one, from which any process count that divides
    the shards resumes."""

    def __init__(self, parts):
        self.parts = parts

    def __iter__(self):
        return self

    def __next__(self) -> dict[str, np.ndarray]:
        batches = [next(it) for _, it in self.parts]
        return {k: np.concatenate([b[k] for b in batches]) for k in batches[0]}

    def get_state(self) -> dict:
        return {"shards": {str(s): it.get_state() for s, it in self.parts}}

    def set_state(self, state: dict) -> None:
        saved = state.get("shards", {})
        missing = [s for s, _ in self.parts if str(s) not in saved]
        if missing:
            raise ValueError(
                f"the data state has no position for shards {missing} (it has "
                f"{sorted(saved, key=int)}): the run was read in another number of "
                "data.shards; resume with the same data.shards"
            )
        for s, it in self.parts:
            it.set_state(saved[str(s)])

    def close(self) -> None:
        for _, it in self.parts:
            close = getattr(it, "close", None)
            if close is not None:
                close()
