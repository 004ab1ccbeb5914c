"""Static sparse-attention patterns as data.

A pattern says which keys ``j`` each query ``i`` may attend to, for a sequence
of ``n`` tokens. It answers two questions:

* ``allows(i, j, n)``: the exact rule, elementwise on integer arrays (numpy or
  jax), used for masks, for the reference implementation and inside the
  blocked kernel for the entries of the gathered blocks;
* ``plans(n, block)``: a *cover* of the allowed pairs that the blocked kernel
  can compute without an ``n x n`` array (:mod:`~flaxformer_lite.sparse.grammar.plans`). A
  cover may hold more pairs than allowed (``allows`` masks them); never fewer.

Patterns combine with ``|`` (union) and ``&`` (intersection), and every pattern
has a causal variant (``pattern.causal()``: additionally ``j <= i``).

The catalogue (n = sequence length; w, r, s, c, g, B integers):

=================  =========================================================
``Local(w)``       band: ``|i - j| <= w`` (Longformer's sliding window)
``Dilated(w, r)``  ``i - j`` a multiple of ``r`` and ``|i - j| <= w r``
``Strided(s)``     ``i - j`` a multiple of ``s`` (Sparse Transformer, 2nd head)
``Fixed(s, c)``    same chunk of ``s`` tokens, or ``j`` among the last ``c`` of
                   its chunk (Sparse Transformer "fixed")
``Global(pos)``    the tokens ``pos`` attend to all and are attended by all
``RandomBlocks``   each query block attends ``k`` key blocks drawn with a seed
``BlockLocal``     ``|i // B - j // B| <= radius`` (BigBird's block window)
``Full()``         everything (dense attention as a pattern)
=================  =========================================================

Factories for the published combinations: :func:`sparse_transformer_strided`,
:func:`sparse_transformer_fixed`, :func:`longformer`, :func:`etc`,
:func:`bigbird`. Random patterns are reproducible: the draw depends only on
``(seed, layer, block)``; the seed is a config field and ``for_layer(l)``
salts it per layer.

The file stays above 400 lines on purpose: it is the catalogue above, one small class
per pattern with its rule and cover, plus union, intersection and the published
combinations, kept together so that the table is its index.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from collections.abc import Sequence
from typing import ClassVar

import numpy as np

from flaxformer_lite.sparse.grammar.plans import (
    Plans,
    coarse_block_mask,
    lookup,
    lookup2,
    num_blocks,
    offset_block_mask,
)

# -- patterns --------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Pattern:
    """Base class. Subclasses define ``_allows`` (without causality) and ``_plans``."""

    is_causal: bool = dataclasses.field(default=False, kw_only=True)
    # Whether a pair's fate depends on i - j only, so that a sequence attends the same
    # wherever a packer puts it in a row (tests/test_packed_sparse.py holds each built-in
    # name to its value). False: counted from the row's start (blocks, global tokens,
    # random blocks), and the default for a pattern that does not say.
    offset_invariant: ClassVar[bool] = False

    def allows(self, i, j, n: int):
        """Elementwise: may query ``i`` attend key ``j`` (both ``< n``)?"""
        ok = self._allows(i, j, n)
        return (ok & (j <= i)) if self.is_causal else ok

    def plans(self, n: int, block: int) -> Plans:
        return self._plans(n, block)

    def causal(self) -> Pattern:
        return dataclasses.replace(self, is_causal=True)

    def for_layer(self, layer: int) -> Pattern:
        """The pattern for layer ``layer`` (random patterns re-draw; others are unchanged)."""
        return self

    def mask(self, n: int) -> np.ndarray:
        """The dense boolean ``[n, n]`` matrix (for tests, pictures and small inputs)."""
        i = np.arange(n)[:, None]
        j = np.arange(n)[None, :]
        return np.broadcast_to(self.allows(i, j, n), (n, n)).copy()

    def __or__(self, other: Pattern) -> Pattern:
        return Union((self, other))

    def __and__(self, other: Pattern) -> Pattern:
        return Intersection((self, other))

    # subclasses
    def _allows(self, i, j, n):  # pragma: no cover - abstract
        raise NotImplementedError

    def _plans(self, n, block) -> Plans:  # pragma: no cover - abstract
        raise NotImplementedError


def _check_positive(name: str, **values: int) -> None:
    for key, value in values.items():
        if not isinstance(value, int | np.integer) or value < 1:
            raise ValueError(f"{name}: {key}={value!r} must be a positive integer")


@dataclasses.dataclass(frozen=True)
class Full(Pattern):
    """Every pair (dense attention; with ``causal()`` the usual causal mask)."""

    offset_invariant = True

    def _allows(self, i, j, n):
        return (i >= 0) & (j >= 0)

    def _plans(self, n, block):
        nb = num_blocks(n, block)
        mask = np.ones((nb, nb), bool)
        return Plans(block_mask=np.tril(mask) if self.is_causal else mask)


@dataclasses.dataclass(frozen=True)
class Local(Pattern):
    """Band of half-width ``window``: ``|i - j| <= window`` (causal: ``0 <= i - j <= window``)."""

    offset_invariant = True

    window: int = 128

    def __post_init__(self):
        _check_positive("local", window=self.window)

    def _allows(self, i, j, n):
        d = i - j
        return (d <= self.window) & (d >= -self.window)

    def _plans(self, n, block):
        offsets = np.arange(-self.window, self.window + 1)
        return Plans(block_mask=offset_block_mask(offsets, n, block, self.is_causal))


@dataclasses.dataclass(frozen=True)
class Dilated(Pattern):
    """``window`` steps of ``dilation`` each side: ``i - j = k r`` with ``|k| <= window``."""

    offset_invariant = True

    window: int = 8
    dilation: int = 2

    def __post_init__(self):
        _check_positive("dilated", window=self.window, dilation=self.dilation)

    def _allows(self, i, j, n):
        d = i - j
        reach = self.window * self.dilation
        return (d % self.dilation == 0) & (d <= reach) & (d >= -reach)

    def _plans(self, n, block):
        offsets = np.arange(-self.window, self.window + 1) * self.dilation
        return Plans(block_mask=offset_block_mask(offsets, n, block, self.is_causal))


@dataclasses.dataclass(frozen=True)
class Strided(Pattern):
    """Every ``stride``-th key relative to the query: ``(i - j) % stride == 0``.

    Alone it attends ``n / stride`` keys per query; the Sparse Transformer pairs
    it with ``Local(stride - 1)`` (:func:`sparse_transformer_strided`).
    """

    offset_invariant = True

    stride: int = 64

    def __post_init__(self):
        _check_positive("strided", stride=self.stride)

    def _allows(self, i, j, n):
        return (i - j) % self.stride == 0

    def _plans(self, n, block):
        return Plans(strides=(self.stride,))


@dataclasses.dataclass(frozen=True)
class Fixed(Pattern):
    """Sparse Transformer "fixed": same chunk of ``stride`` tokens, or ``j`` is one of
    the last ``summary`` positions of its chunk (those act as summaries for all)."""

    stride: int = 64
    summary: int = 1

    def __post_init__(self):
        _check_positive("fixed", stride=self.stride, summary=self.summary)
        if self.summary > self.stride:
            raise ValueError(f"fixed: summary={self.summary} must be <= stride={self.stride}")

    def _allows(self, i, j, n):
        same = (i // self.stride) == (j // self.stride)
        return same | (j % self.stride >= self.stride - self.summary)

    def _plans(self, n, block):
        nb = num_blocks(n, block)
        first = np.arange(nb) * block // self.stride
        last = (np.minimum(np.arange(nb) * block + block, n) - 1) // self.stride
        a, b = first[:, None], last[:, None]
        mask = (a <= last[None, :]) & (first[None, :] <= b)
        if self.is_causal:
            mask &= np.tri(nb, dtype=bool)
        j = np.arange(n)
        columns = j[j % self.stride >= self.stride - self.summary]
        return Plans(block_mask=mask, columns=columns)


@dataclasses.dataclass(frozen=True)
class Global(Pattern):
    """Global tokens (Longformer/ETC): ``positions`` attend to every key and every
    query attends to them. Negative positions count from the end."""

    positions: tuple[int, ...] = (0,)

    def __post_init__(self):
        if not self.positions:
            raise ValueError("global: positions must name at least one token")

    def resolved(self, n: int) -> np.ndarray:
        pos = np.array([p + n if p < 0 else p for p in self.positions], np.int64)
        return np.unique(pos[(pos >= 0) & (pos < n)])

    def _table(self, n):
        table = np.zeros(max(n, 1), bool)
        table[self.resolved(n)] = True
        return table

    def _allows(self, i, j, n):
        table = self._table(n)
        return lookup(table, i) | lookup(table, j)

    def _plans(self, n, block):
        pos = self.resolved(n)
        return Plans(columns=pos, rows=pos)


@dataclasses.dataclass(frozen=True)
class BlockLocal(Pattern):
    """BigBird's window: query block ``a`` attends key blocks ``|a - b| <= radius``."""

    block_size: int = 64
    radius: int = 1

    def __post_init__(self):
        _check_positive("block_local", block_size=self.block_size)
        if self.radius < 0:
            raise ValueError(f"block_local: radius={self.radius} must be >= 0")

    def _allows(self, i, j, n):
        d = i // self.block_size - j // self.block_size
        return (d <= self.radius) & (d >= -self.radius)

    def _plans(self, n, block):
        return Plans(block_mask=coarse_block_mask(self, n, block))


@dataclasses.dataclass(frozen=True)
class RandomBlocks(Pattern):
    """Each query block of ``block_size`` attends ``num_blocks`` key blocks drawn
    uniformly without replacement (causal: among blocks ``<=`` its own), from a
    numpy generator seeded with ``(seed, layer, block_size)``, one query block
    after the other: a causal table for a longer sequence extends the shorter
    one, so step-by-step decoding sees the blocks the full forward pass saw."""

    block_size: int = 64
    num_blocks: int = 3
    seed: int = 0
    layer: int = 0

    def __post_init__(self):
        _check_positive("random", block_size=self.block_size, num_blocks=self.num_blocks)

    def for_layer(self, layer: int) -> Pattern:
        return dataclasses.replace(self, layer=layer)

    def table(self, n: int) -> np.ndarray:
        """``[nb, nb]`` bool: the drawn key blocks of each query block."""
        return _random_table(self, n)

    def _allows(self, i, j, n):
        return lookup2(self.table(n), i // self.block_size, j // self.block_size)

    def _plans(self, n, block):
        return Plans(block_mask=coarse_block_mask(self, n, block))


@functools.lru_cache(maxsize=64)
def _random_table(pattern: RandomBlocks, n: int) -> np.ndarray:
    nb = num_blocks(n, pattern.block_size)
    rng = np.random.default_rng([pattern.seed, pattern.layer, pattern.block_size])
    table = np.zeros((nb, nb), bool)
    for a in range(nb):
        choices = a + 1 if pattern.is_causal else nb
        k = min(pattern.num_blocks, choices)
        table[a, rng.choice(choices, size=k, replace=False)] = True
    table.flags.writeable = False
    return table


@dataclasses.dataclass(frozen=True)
class _Combination(Pattern):
    """What a union and an intersection share: their parts, drawn anew per layer, and
    offset-invariant when every part is."""

    parts: tuple[Pattern, ...] = ()

    @property
    def offset_invariant(self) -> bool:  # type: ignore[override]
        return all(part.offset_invariant for part in self.parts)

    def for_layer(self, layer):
        return dataclasses.replace(self, parts=tuple(p.for_layer(layer) for p in self.parts))


@dataclasses.dataclass(frozen=True)
class Union(_Combination):
    """Pairs allowed by any part; its cover is the union of the parts' covers."""

    def __post_init__(self):
        if not self.parts:
            raise ValueError("a union needs at least one pattern")

    def allows(self, i, j, n):
        out = self.parts[0].allows(i, j, n)
        for p in self.parts[1:]:
            out = out | p.allows(i, j, n)
        return (out & (j <= i)) if self.is_causal else out

    def plans(self, n, block):
        out = self.parts[0].plans(n, block)
        for p in self.parts[1:]:
            out = out | p.plans(n, block)
        return out

    def causal(self):
        return Union(tuple(p.causal() for p in self.parts), is_causal=True)

    def __or__(self, other):
        extra = other.parts if isinstance(other, Union) and not other.is_causal else (other,)
        return Union(self.parts + extra, is_causal=self.is_causal)


@dataclasses.dataclass(frozen=True)
class Intersection(_Combination):
    """Pairs allowed by every part. Its cover is the union of the parts' covers,
    and only the rows global in every part are computed densely."""

    def __post_init__(self):
        if not self.parts:
            raise ValueError("an intersection needs at least one pattern")

    def allows(self, i, j, n):
        out = self.parts[0].allows(i, j, n)
        for p in self.parts[1:]:
            out = out & p.allows(i, j, n)
        return (out & (j <= i)) if self.is_causal else out

    def plans(self, n, block):
        plans = [p.plans(n, block) for p in self.parts]
        out = plans[0]
        rows = plans[0].rows
        for p in plans[1:]:
            out = out | p
            rows = np.intersect1d(rows, p.rows)
        # Non-global rows of a part are covered by that part's other plans;
        # rows global in one part only must be covered by the others: keep
        # the union of the covers, which contains them.
        return dataclasses.replace(out, rows=rows.astype(np.int64))

    def causal(self):
        return Intersection(tuple(p.causal() for p in self.parts), is_causal=True)


# -- the published combinations ---------------------------------------------------------


def sparse_transformer_strided(stride: int) -> Pattern:
    """Child et al. (2019), strided: the previous ``stride`` tokens and every
    ``stride``-th one before them (use ``.causal()`` for the autoregressive model)."""
    return Local(stride - 1) | Strided(stride) if stride > 1 else Full()


def sparse_transformer_fixed(stride: int, summary: int = 1) -> Pattern:
    return Fixed(stride, summary)


def longformer(window: int = 256, global_positions: Sequence[int] = (0,)) -> Pattern:
    """Beltagy et al. (2020): sliding window plus task-chosen global tokens."""
    return Local(window) | Global(tuple(global_positions))


def etc(window: int = 128, num_global: int = 8) -> Pattern:
    """Ainslie et al. (2020), global-local attention, with the first ``num_global``
    tokens playing the global input."""
    return Local(window) | Global(tuple(range(num_global)))


def bigbird(
    block_size: int = 64,
    window_blocks: int = 3,
    global_blocks: int = 2,
    random_blocks: int = 3,
    seed: int = 0,
) -> Pattern:
    """Zaheer et al. (2020), ITC: ``window_blocks`` (odd) blocks around each query
    block, the first ``global_blocks`` blocks global, ``random_blocks`` random ones."""
    if window_blocks < 1 or window_blocks % 2 == 0:
        raise ValueError(f"bigbird: window_blocks={window_blocks} must be odd and >= 1")
    parts: list[Pattern] = [BlockLocal(block_size, window_blocks // 2)]
    if global_blocks:
        parts.append(Global(tuple(range(global_blocks * block_size))))
    if random_blocks:
        parts.append(RandomBlocks(block_size, random_blocks, seed))
    return Union(tuple(parts)) if len(parts) > 1 else parts[0]


def density(pattern: Pattern, n: int) -> float:
    """Fraction of the ``n x n`` pairs allowed (from the dense mask; for small ``n``)."""
    return float(pattern.mask(n).mean())


def default_stride(n: int) -> int:
    """``~sqrt(n)``, the Sparse Transformer's choice."""
    return max(1, int(math.isqrt(n)))
