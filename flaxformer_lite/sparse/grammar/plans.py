"""The cover of a pattern: which blocks, columns, strides and rows a kernel computes.

:class:`Plans` is what ``Pattern.plans(n, block)`` returns and the blocked kernel
(``blocked.py``) reads; the helpers here build block masks from a pattern's offsets or
from its own tiles, and look tables up with numpy or jax indices alike.
"""

from __future__ import annotations

import dataclasses

import numpy as np


@dataclasses.dataclass(frozen=True)
class Plans:
    """How the blocked kernel covers a pattern's pairs for length ``n``, block ``B``.

    Attributes:
      block_mask: ``[nb, nb]`` bool, ``nb = ceil(n / B)``: query block ``a``
        gathers key block ``b`` (``None``: no block part).
      columns: key positions every query gathers (global keys, summary columns).
      strides: for each stride ``s``, query ``i`` gathers every ``j`` with
        ``(i - j) % s == 0`` (computed on the sequence regrouped by residue).
      rows: query positions computed densely against all keys (global queries).
    """

    block_mask: np.ndarray | None = None
    columns: np.ndarray = dataclasses.field(default_factory=lambda: np.zeros(0, np.int64))
    strides: tuple[int, ...] = ()
    rows: np.ndarray = dataclasses.field(default_factory=lambda: np.zeros(0, np.int64))

    def __or__(self, other: Plans) -> Plans:
        if self.block_mask is None:
            block = other.block_mask
        elif other.block_mask is None:
            block = self.block_mask
        else:
            block = self.block_mask | other.block_mask
        return Plans(
            block_mask=block,
            columns=np.union1d(self.columns, other.columns).astype(np.int64),
            strides=tuple(dict.fromkeys(self.strides + other.strides)),
            rows=np.union1d(self.rows, other.rows).astype(np.int64),
        )


def num_blocks(n: int, block: int) -> int:
    return -(-n // block)


def lookup(table: np.ndarray, index):
    """``table[index]`` for numpy or jax index arrays (indices clipped into range)."""
    if isinstance(index, np.ndarray) or np.isscalar(index):
        return table[np.clip(index, 0, len(table) - 1)]
    import jax.numpy as jnp

    return jnp.asarray(table)[jnp.clip(index, 0, len(table) - 1)]


def lookup2(table: np.ndarray, a, b):
    if isinstance(a, np.ndarray) and isinstance(b, np.ndarray):
        return table[np.clip(a, 0, table.shape[0] - 1), np.clip(b, 0, table.shape[1] - 1)]
    import jax.numpy as jnp

    a, b = jnp.asarray(a), jnp.asarray(b)
    return jnp.asarray(table)[
        jnp.clip(a, 0, table.shape[0] - 1), jnp.clip(b, 0, table.shape[1] - 1)
    ]


def offset_block_mask(offsets: np.ndarray, n: int, block: int, causal: bool) -> np.ndarray:
    """Block mask of a pattern allowing exactly the offsets ``i - j`` in ``offsets``."""
    nb = num_blocks(n, block)
    delta = np.arange(-(nb - 1), nb)  # a - b
    # i - j ranges over [delta*B - (B-1), delta*B + (B-1)] for i in block a, j in block b.
    lo, hi = delta * block - (block - 1), delta * block + (block - 1)
    offsets = np.sort(offsets)
    touched = np.searchsorted(offsets, hi, side="right") > np.searchsorted(offsets, lo, "left")
    a = np.arange(nb)[:, None]
    b = np.arange(nb)[None, :]
    mask = touched[(a - b) + nb - 1]
    if causal:
        mask &= b <= a
    return mask


def coarse_block_mask(pattern, n: int, block: int) -> np.ndarray:
    """Kernel-block mask of a pattern defined on its own blocks (``pattern.block_size``).

    Evaluates the rule on the corners of every (kernel block x pattern block)
    cell: a pattern constant on its ``block_size`` tiles is covered exactly.
    """
    pb = pattern.block_size
    nb = num_blocks(n, block)
    # Pattern-block index ranges of each kernel block.
    starts = np.arange(nb) * block
    ends = np.minimum(starts + block, n) - 1
    first, last = starts // pb, ends // pb
    npb = num_blocks(n, pb)
    coarse = pattern.allows(
        np.arange(npb)[:, None] * pb, np.arange(npb)[None, :] * pb, n
    )  # tile rule evaluated at tile origins
    # Under causality the diagonal tile is partly allowed; its origin pair (i == j) is.
    coarse = np.broadcast_to(coarse, (npb, npb))
    mask = np.zeros((nb, nb), bool)
    for a in range(nb):
        rows = coarse[first[a] : last[a] + 1].any(axis=0)  # [npb]
        # kernel block b touches pattern blocks first[b]..last[b]
        cum = np.concatenate([[0], np.cumsum(rows)])
        mask[a] = cum[last + 1] - cum[first] > 0
    if pattern.is_causal:
        mask &= np.tri(nb, dtype=bool)
    return mask
