"""A run's training examples as arrays, never as one Python object per example.

An :class:`ExampleTable` says, for each example, which :class:`~.token_store.Store`
holds it (``part``), at which row (``row``), and how many tokens of each feature it
takes (``lengths``, cut to ``max_length``). Selecting, shuffling, sharding and
concatenating examples are index operations on those arrays; the ids themselves are
read (from memory-mapped stores) only when a batch is filled, by :meth:`gather`.

An example longer than ``max_length`` (``data.too_long=truncate``) keeps its first
``max_length - 1`` ids and ends in EOS, as :func:`~.pipeline.tokenize_pairs` cuts it.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from flaxformer_lite.data.token_store import Store
from flaxformer_lite.data.tokenizer import EOS_ID


class ExampleTable:
    """Examples ``i`` = row ``row[i]`` of store ``stores[part[i]]``, ``lengths[i]`` long."""

    def __init__(
        self, stores: Sequence[Store], part: np.ndarray, row: np.ndarray, lengths: np.ndarray
    ):
        self.stores = list(stores)
        self.keys = self.stores[0].keys if self.stores else ()
        self.part = np.asarray(part, np.int16)
        # the narrowest types that hold them: a few bytes an example, millions of them
        wide = max((len(s) for s in self.stores), default=0) >= 2**31
        self.row = np.asarray(row, np.int64 if wide else np.int32)
        lengths = np.asarray(lengths)
        narrow = lengths.size == 0 or int(lengths.max()) < 2**16
        self.lengths = lengths.astype(np.uint16 if narrow else np.int32, copy=False).reshape(
            len(self.row), len(self.keys)
        )

    @classmethod
    def of_store(
        cls, store: Store, rows: np.ndarray | None = None, max_length: int | None = None
    ) -> ExampleTable:
        """``rows`` of ``store`` (all of them by default), cut to ``max_length``."""
        whole = rows is None
        rows = np.arange(len(store)) if whole else np.asarray(rows)
        lengths = store.lengths() if whole else store.lengths()[rows]
        if max_length is not None:
            np.minimum(lengths, max_length, out=lengths)
        return cls([store], np.zeros(len(rows), np.int16), rows, lengths)

    @classmethod
    def of(cls, examples) -> ExampleTable:
        """``examples`` as a table: a table itself, or a sequence of dicts of id arrays."""
        if isinstance(examples, ExampleTable):
            return examples
        examples = list(examples)
        if not examples:
            raise ValueError("no examples")
        return cls.of_store(Store.from_examples(examples))

    @classmethod
    def concat(cls, tables: Sequence[ExampleTable]) -> ExampleTable:
        """The examples of ``tables``, one after another (stores shared, not copied)."""
        tables = [t for t in tables if len(t)] or list(tables[:1])
        stores: list[Store] = []
        parts = []
        for t in tables:
            index = []
            for s in t.stores:
                ids = [id(x) for x in stores]
                if id(s) not in ids:
                    stores.append(s)
                    ids.append(id(s))
                index.append(ids.index(id(s)))
            parts.append(np.asarray(index, np.int16)[t.part] if len(t) else t.part)
        return cls(
            stores,
            np.concatenate(parts),
            np.concatenate([t.row for t in tables]),
            np.concatenate([t.lengths for t in tables]),
        )

    def __len__(self) -> int:
        return len(self.row)

    def take(self, indices) -> ExampleTable:
        """The examples at ``indices`` (an index array, or a slice), in that order."""
        return ExampleTable(
            self.stores, self.part[indices], self.row[indices], self.lengths[indices]
        )

    def __getitem__(self, i):
        if isinstance(i, slice):
            return self.take(i)
        i = int(i)
        ex = self.stores[self.part[i]].example(int(self.row[i]))
        for f, k in enumerate(self.keys):
            n = int(self.lengths[i, f])
            if len(ex[k]) > n:  # cut to max_length: the first n - 1 ids and EOS
                ex[k] = np.append(ex[k][: n - 1], EOS_ID).astype(np.int32)
        return ex

    def __iter__(self):
        return (self[i] for i in range(len(self)))

    def tokens(self) -> int:
        return int(self.lengths.sum())

    def gather(self, key: str, examples: np.ndarray) -> np.ndarray:
        """The ids of ``key`` of ``examples`` (indices), back to back, as cut."""
        f = self.keys.index(key)
        lengths = self.lengths[examples, f].astype(np.int64)
        out = np.empty(int(lengths.sum()), np.int32)
        ends = np.cumsum(lengths)
        firsts = ends - lengths  # where each example starts in ``out``
        parts = self.part[examples]
        for p in np.unique(parts):
            mine = np.flatnonzero(parts == p) if len(self.stores) > 1 else np.arange(len(examples))
            store = self.stores[p]
            start, stop = store.bounds(key, self.row[examples[mine]].astype(np.int64))
            n = lengths[mine]
            # source offsets of every token: each example's start, then +1 per token
            shift = np.repeat(start - firsts[mine], n)
            where = np.repeat(firsts[mine], n) + (
                np.arange(int(n.sum())) - np.repeat(np.cumsum(n) - n, n)
            )
            out[where] = store.ids[key][shift + where]
            cut = (stop - start) > n
            if cut.any():  # truncated: the last kept id becomes EOS
                out[ends[mine][cut] - 1] = EOS_ID
        return out
