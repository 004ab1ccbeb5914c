"""Packed training batches on grain: shuffle, first-fit pack, shard, batch, prefetch.

Several sentence pairs share a row of ``max_length`` tokens, told apart by
``*_segment_ids`` (1, 2, ...; 0 = padding) and restarted ``*_positions``; the model's
segment masks keep them apart, so a packed batch computes exactly what the same pairs
padded one per row would (tests/test_data_pipeline.py). Every packed example holds at
least two tokens (a piece and its EOS: :func:`~flaxformer_lite.data.assembly.examples_of`
and :func:`~flaxformer_lite.data.pipeline.tokenize_pairs` skip empty texts), so a row of
n tokens holds at most n/2 examples, the bound cuDNN's packed layout is given
(model/kernels.py).

A batch is a dict of int32 numpy arrays ``[batch, max_length]``: ``inputs``,
``targets`` and, when packed, ``inputs_segment_ids``, ``inputs_positions``,
``targets_segment_ids``, ``targets_positions``. The per-step work is index lookups
and first-fit packing in a prefetch thread, so the training step never waits on data
(benchmarks/train_step.py prints the real/synthetic step-time ratio).

The examples are an :class:`~flaxformer_lite.data.table.ExampleTable` (lengths and
store rows as arrays; the ids memory-mapped), so an epoch of millions of pairs costs
arrays, not Python objects. An epoch is planned in chunks of ``CHUNK`` examples of its
shuffled order, each packed on its own: a restart plans one chunk (a second or so),
not the epoch, and loses at most a part-filled batch per chunk. A batch is filled with
numpy gathers from the stores.

Resuming: the training iterator's position is a small JSON state
(``iterator.get_state()``: epoch, chunk, batch in the chunk) stored with each
checkpoint; restoring it replays the same data order.
"""

from __future__ import annotations

from collections.abc import Sequence

import grain
import numpy as np
from grain import experimental as grain_exp

from flaxformer_lite.data.table import ExampleTable
from flaxformer_lite.data.tokenizer import PAD_ID

CHUNK = 1 << 18  # examples of an epoch's order packed together


def pad_batch(examples: Sequence[dict[str, np.ndarray]], length: int) -> dict[str, np.ndarray]:
    batch = {}
    for key in examples[0]:
        arr = np.full((len(examples), length), PAD_ID, np.int32)
        for i, ex in enumerate(examples):
            arr[i, : len(ex[key])] = ex[key]
        batch[key] = arr
    return batch


def plan_rows(
    lengths: np.ndarray, batch_size: int, max_length: int
) -> tuple[np.ndarray, np.ndarray]:
    """First-fit packing of examples arriving in order (``lengths``: ``[n, features]``
    token counts): ``(rows, bounds)``, the row of its batch each example goes to, and
    the batches as ranges of arrivals (batch ``b`` is arrivals ``bounds[b]:bounds[b+1]``).

    Each example goes into the first of ``batch_size`` open rows where all its features
    (source and target) still fit; when none has room, the open rows are emitted as a
    batch and a new batch starts with it. Plain Python on lists: ~1 us an example,
    3x faster than a numpy call per example.
    """
    n, features = lengths.shape
    if n == 0:
        return np.zeros(0, np.int32), np.zeros(1, np.int64)
    cols = [lengths[:, f].tolist() for f in range(min(features, 2))]
    least = [int(x) for x in lengths.min(axis=0)[:2]]  # rows with less room take nothing
    if features == 1:
        cols.append([0] * n)
        least.append(0)
    elif features > 2:
        raise ValueError(f"packing takes one or two features, not {features}")
    a_len, b_len = cols
    a_min, b_min = least
    room_a, room_b = [max_length] * batch_size, [max_length] * batch_size
    out, bounds = [0] * n, [0]
    first = 0  # the rows before it have room for no example
    for j in range(n):
        a, b = a_len[j], b_len[j]
        r = first
        while r < batch_size and (room_a[r] < a or room_b[r] < b):
            r += 1
        if r == batch_size:
            bounds.append(j)
            room_a, room_b = [max_length] * batch_size, [max_length] * batch_size
            r = first = 0
        room_a[r] -= a
        room_b[r] -= b
        out[j] = r
        while first < batch_size and (room_a[first] < a_min or room_b[first] < b_min):
            first += 1
    bounds.append(n)
    return np.asarray(out, np.int32), np.asarray(bounds, np.int64)


def plan_epoch(
    lengths: np.ndarray, order: np.ndarray, batch_size: int, max_length: int
) -> list[list[list[int]]]:
    """:func:`plan_rows` of ``order`` as nested lists: batches -> rows -> example indices."""
    rows, bounds = plan_rows(lengths[order], batch_size, max_length)
    batches = []
    for lo, hi in zip(bounds[:-1], bounds[1:], strict=True):
        batch: list[list[int]] = [[] for _ in range(batch_size)]
        for idx, r in zip(order[lo:hi], rows[lo:hi], strict=True):
            batch[r].append(int(idx))
        batches.append(batch)
    return batches


class PackedBatchIterator(grain.DatasetIterator):
    """Endless packed batches; state = (epoch, chunk, batch in chunk): resume is exact."""

    def __init__(self, ds: PackedTrainDataset):
        super().__init__()
        self._ds = ds
        self._epoch, self._chunk, self._batch = 0, 0, 0
        self._plan: tuple | None = None

    def _current_plan(self) -> tuple:
        while True:
            if self._plan is None:
                self._plan = self._ds.plan_chunk(self._epoch, self._chunk)
            if self._batch < len(self._plan[2]) - 1:
                return self._plan
            # past this chunk's batches: the next chunk, or the next epoch's first
            self._batch -= len(self._plan[2]) - 1
            if (self._chunk + 1) * self._ds.chunk < self._ds.epoch_size():
                self._chunk += 1
            else:
                self._epoch, self._chunk = self._epoch + 1, 0
            self._plan = None

    def __next__(self) -> dict[str, np.ndarray]:
        order, rows, bounds = self._current_plan()
        lo, hi = bounds[self._batch], bounds[self._batch + 1]
        self._batch += 1
        return self._ds.fill(order[lo:hi], rows[lo:hi], self._epoch)

    def get_state(self) -> dict:
        return {"epoch": self._epoch, "chunk": self._chunk, "batch": self._batch}

    def set_state(self, state: dict) -> None:
        self._epoch, self._batch = int(state["epoch"]), int(state["batch"])
        self._chunk, self._plan = int(state.get("chunk", 0)), None


# Why a hand-written packer and not grain's FirstFitPackIterDataset: grain's applies
# the same rule (all bins emitted when an example fits none) and gives the same
# batches and padding (7.5% vs 7.7% of slots: it also packs across epoch ends), but
# packs ~30x fewer tokens per second of host time (benchmarks/packing.py: 75k vs
# 2.4M tokens/s on the Ding pairs). The default run consumes ~7k tokens/s, so grain's
# packer would take ~10% of a core from a 2-core training step; plan_rows works on
# the length table, grain's packer handles every example as a Python object.
class PackedTrainDataset(grain.IterDataset):
    """Training batches packed from tokenized examples, reshuffled every epoch.

    ``examples``: an :class:`ExampleTable`, or a sequence of dicts of id arrays.
    ``resample``, if given, maps an epoch to that epoch's examples (the same number in
    the same order, e.g. a ``pipeline.SubwordSampler``); it is called once per epoch.
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
        chunk: int | None = None,
    ):
        super().__init__()
        self.examples = ExampleTable.of(examples)
        self.ids = ids
        self.resample = resample
        self._epoch_cache: tuple[int, ExampleTable] | None = None
        self._order: tuple[int, np.ndarray] | None = None
        self.keys = self.examples.keys  # ("inputs", "targets") or ("targets",) for an LM
        self.batch_size, self.max_length, self.seed, self.pack = (
            batch_size,
            max_length,
            seed,
            pack,
        )
        if len(self.examples) < (1 if pack else batch_size):
            raise ValueError(
                f"{len(self.examples)} training examples cannot fill a batch of "
                f"{batch_size} rows; lower the batch size or add data"
            )
        # unpacked batches need no planning: the whole epoch is one chunk
        self.chunk = (chunk or CHUNK) if pack else len(self.examples)

    def epoch_size(self) -> int:
        return len(self.examples)

    def epoch_examples(self, epoch: int) -> ExampleTable:
        """The examples of ``epoch`` (``resample(epoch)`` if given)."""
        if self.resample is None:
            return self.examples
        if self._epoch_cache is None or self._epoch_cache[0] != epoch:
            examples = ExampleTable.of(self.resample(epoch))
            if len(examples) != len(self.examples):
                raise ValueError(
                    f"epoch {epoch} has {len(examples)} examples, not {len(self.examples)}"
                )
            self._epoch_cache = (epoch, examples)
        return self._epoch_cache[1]

    def order(self, epoch: int) -> np.ndarray:
        """The shuffled order of ``epoch``'s examples (kept while the epoch lasts)."""
        if self._order is None or self._order[0] != epoch:
            order = np.random.default_rng([self.seed, epoch]).permutation(len(self.examples))
            self._order = (epoch, order.astype(np.int32 if len(order) < 2**31 else np.int64))
        return self._order[1]

    def plan_chunk(self, epoch: int, chunk: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """(example indices in arrival order, their rows, batch bounds) of ``chunk`` of
        ``epoch``'s shuffled order."""
        order = self.order(epoch)[chunk * self.chunk : (chunk + 1) * self.chunk]
        if self.pack:
            lengths = self.epoch_examples(epoch).lengths[order]
            rows, bounds = plan_rows(lengths, self.batch_size, self.max_length)
            return order, rows, bounds
        n = len(order) // self.batch_size * self.batch_size
        rows = (np.arange(n) % self.batch_size).astype(np.int32)
        return order[:n], rows, np.arange(0, n + 1, self.batch_size, dtype=np.int64)

    def plan(self, epoch: int) -> list:
        """The whole epoch's batches as nested lists (batches -> rows -> indices)."""
        batches = []
        for c in range(max(1, -(-self.epoch_size() // self.chunk))):
            order, rows, bounds = self.plan_chunk(epoch, c)
            for lo, hi in zip(bounds[:-1], bounds[1:], strict=True):
                batch: list[list[int]] = [[] for _ in range(self.batch_size)]
                for idx, r in zip(order[lo:hi], rows[lo:hi], strict=True):
                    batch[r].append(int(idx))
                batches.append(batch)
        return batches

    def materialize(self, rows: list[list[int]], epoch: int = 0) -> dict[str, np.ndarray]:
        """The batch of a plan's ``rows`` (lists of example indices)."""
        flat = [(i, r) for r, row in enumerate(rows) for i in row]
        examples = np.array([i for i, _ in flat], np.int64)
        return self.fill(examples, np.array([r for _, r in flat], np.int32), epoch)

    def fill(self, examples: np.ndarray, rows: np.ndarray, epoch: int = 0) -> dict[str, np.ndarray]:
        """The batch holding ``examples`` (indices, in arrival order) in ``rows``."""
        table = self.epoch_examples(epoch)
        shape = (self.batch_size, self.max_length)
        by_row = np.argsort(rows, kind="stable")  # a row's examples in arrival order
        examples, rows = np.asarray(examples)[by_row], np.asarray(rows)[by_row]
        new = np.ones(len(rows), bool)
        new[1:] = rows[1:] != rows[:-1]
        group = np.cumsum(new) - 1
        heads = np.flatnonzero(new)
        segment = np.arange(len(rows)) - heads[group] + 1  # 1, 2, ... within a row
        out = {}
        for f, key in enumerate(self.keys):
            lengths = table.lengths[examples, f].astype(np.int64)
            before = np.cumsum(lengths) - lengths  # tokens of earlier examples
            column = before - before[heads][group]  # where each starts in its row
            within = np.arange(int(lengths.sum())) - np.repeat(before, lengths)
            where = np.repeat(rows * self.max_length + column, lengths) + within
            tokens = np.zeros(shape, np.int32)
            tokens.flat[where] = table.gather(key, examples)
            out[key] = tokens
            if self.pack:
                seg, pos = np.zeros(shape, np.int32), np.zeros(shape, np.int32)
                seg.flat[where] = np.repeat(segment, lengths)
                pos.flat[where] = within
                out[f"{key}_segment_ids"], out[f"{key}_positions"] = seg, pos
        if self.ids is not None:
            offset, stride = self.ids
            ids = np.full(shape, -1, np.int64)
            ids[rows, segment - 1] = (epoch << 32) + offset + stride * examples.astype(np.int64)
            out["example_ids"] = ids
        return out

    def __iter__(self) -> PackedBatchIterator:
        return PackedBatchIterator(self)


def train_iterator(
    examples: ExampleTable | Sequence[dict[str, np.ndarray]],
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
    examples = ExampleTable.of(examples)
    parts = []
    for s in range(process_index * mine, (process_index + 1) * mine):
        shard = examples[s::shards]
        shard_resample = None
        if resample is not None:
            shard_resample = lambda epoch, s=s: ExampleTable.of(resample(epoch))[s::shards]  # noqa: E731
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
