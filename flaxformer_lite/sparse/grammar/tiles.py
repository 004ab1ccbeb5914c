"""A pattern's pairs as tiles: what a fused block-sparse kernel visits, and where it masks.

For a sequence of ``n`` tokens padded to ``m`` and cut into query tiles of ``bq`` and
key tiles of ``bk`` positions, :func:`tile_plan` lists, for each query tile, the key
tiles that hold at least one allowed pair (and, for the backward pass, the transpose:
for each key tile, the query tiles), and says of each listed tile whether every pair
in it is allowed (a *full* tile: no mask) or only some (a *partial* tile: the kernel
applies that tile's mask). Tiles outside the lists are never read.

How it is built, without an ``n x n`` array:

1. the candidates come from the pattern's cover (``pattern.plans``: a block mask,
   global key columns, global query rows, strides), coarsened to tiles; a cover may
   hold more pairs than allowed, never fewer;
2. the exact rule (``pattern.allows``) is evaluated on the pairs of each candidate tile
   only, which drops candidates with no allowed pair and separates full from partial
   tiles;
3. the partial tiles' masks are kept once each (deduplicated, as splash attention's
   mask info does): a band's diagonal tiles, a global column's tiles, the last tile's
   padding are a handful of distinct masks whatever ``n`` is. ``masks[0]`` is the
   full tile.

Strides are the exception: a stride's pairs fall in every tile (one per ``s`` keys),
so in the original order the candidates are every tile (causal: the lower triangle),
correct but as costly as dense attention. The kernel computes them on positions
regrouped by residue instead (:mod:`~flaxformer_lite.sparse.ops.block_sparse.regroup`), where they
fill
contiguous tiles; this module plans either order.
"""

from __future__ import annotations

import dataclasses
import functools

import numpy as np

# Tiles evaluated at once by the exact rule: bounds the working memory to ~16M pairs.
_CHUNK_PAIRS = 1 << 24


@dataclasses.dataclass(frozen=True, eq=False)
class TilePlan:
    """The tiles of one pattern at one length (see the module docstring).

    Attributes:
      n, m, bq, bk: real length, padded length (a multiple of both tiles), tile sizes.
      kv_tiles, kv_masks: ``[m / bq, width]`` int32: query tile ``a``'s key tiles in
        increasing order, and each one's mask (an index into ``masks``; 0 = full);
        entries past ``kv_count[a]`` are padding (0).
      kv_count: ``[m / bq]`` int32.
      q_tiles, q_masks, q_count: the same per key tile (its query tiles).
      masks: ``[u, bq, bk]`` int8, 1 = allowed; ``masks[0]`` is all ones.
      pairs: allowed pairs (the work a kernel that skips everything else computes).
    """

    n: int
    m: int
    bq: int
    bk: int
    kv_tiles: np.ndarray
    kv_masks: np.ndarray
    kv_count: np.ndarray
    q_tiles: np.ndarray
    q_masks: np.ndarray
    q_count: np.ndarray
    masks: np.ndarray
    pairs: int

    @property
    def tiles(self) -> int:
        """Tiles visited by one pass (forward or dq; dk/dv visits the same ones)."""
        return int(self.kv_count.sum())

    def tile_mask(self) -> np.ndarray:
        """``[m / bq, m / bk]`` int: -1 = not visited, else the tile's mask index."""
        out = np.full((self.m // self.bq, self.m // self.bk), -1, np.int64)
        for a, count in enumerate(self.kv_count):
            out[a, self.kv_tiles[a, :count]] = self.kv_masks[a, :count]
        return out

    def dense(self) -> np.ndarray:
        """``[n, n]`` bool: the pairs the plan lets a kernel compute (tests, pictures)."""
        bq, bk = self.bq, self.bk
        grid = self.tile_mask()
        out = np.zeros((self.m, self.m), bool)
        for a, b in zip(*np.nonzero(grid >= 0), strict=True):
            out[a * bq : (a + 1) * bq, b * bk : (b + 1) * bk] = self.masks[grid[a, b]] != 0
        return out[: self.n, : self.n]


def padded_length(n: int, bq: int, bk: int) -> int:
    """``n`` rounded up to a multiple of both tiles (powers of two: of the larger)."""
    block = max(bq, bk)
    return -(-n // block) * block


@functools.lru_cache(maxsize=64)
def tile_plan(pattern, n: int, bq: int, bk: int) -> TilePlan:
    """The :class:`TilePlan` of ``pattern`` for ``n`` tokens and tiles ``bq`` x ``bk``
    (powers of two). Cached per (pattern, n, tiles): a model's layers share it, and the
    same object keeps a jitted kernel's cache warm."""
    for name, tile in (("block_q", bq), ("block_k", bk)):
        if tile < 1 or tile & (tile - 1):
            raise ValueError(f"tile_plan: {name}={tile} must be a power of two")
    m = padded_length(n, bq, bk)
    qa, kb = np.nonzero(_candidates(pattern, n, m, bq, bk))
    kind, counts, masks = _classify(pattern, n, bq, bk, qa, kb)
    keep = kind >= 0
    qa, kb, mask_id = qa[keep], kb[keep], kind[keep].astype(np.int32)
    pairs = int(counts[keep].sum())
    kv = _lists(qa, kb, mask_id, m // bq)
    order = np.lexsort((qa, kb))  # the transpose: by key tile, then query tile
    q = _lists(kb[order], qa[order], mask_id[order], m // bk)
    return TilePlan(n, m, bq, bk, *kv, *q, masks, pairs)


def _candidates(pattern, n: int, m: int, bq: int, bk: int) -> np.ndarray:
    """``[m / bq, m / bk]`` bool: the tiles the pattern's cover reaches."""
    g = min(bq, bk)
    plans = pattern.plans(n, g)
    nq, nk = m // bq, m // bk
    out = np.zeros((nq, nk), bool)
    if plans.block_mask is not None:
        fine = np.zeros((m // g, m // g), bool)
        nb = plans.block_mask.shape[0]
        fine[:nb, :nb] = plans.block_mask
        out |= fine.reshape(nq, bq // g, nk, bk // g).any(axis=(1, 3))
    if len(plans.columns):
        out[:, np.unique(np.asarray(plans.columns) // bk)] = True
    if len(plans.rows):
        out[np.unique(np.asarray(plans.rows) // bq), :] = True
    if plans.strides:
        out[:] = True
    # Tiles wholly past n hold no real pair.
    out[-(-n // bq) :, :] = False
    out[:, -(-n // bk) :] = False
    return out


def _classify(pattern, n: int, bq: int, bk: int, qa: np.ndarray, kb: np.ndarray):
    """Of the candidate tiles (query tile ``qa``, key tile ``kb``): each one's mask index
    (-1: no allowed pair; 0: full; else into the deduplicated masks), its allowed pairs,
    and the masks ``[u, bq, bk]`` int8 (``masks[0]`` full).

    The rule is evaluated once per distinct tile: tiles that :func:`_tile_keys` gives
    one key hold the same pairs (a band's tiles at one offset, say), so a strided
    pattern's every-tile cover costs its distinct offsets, not its n^2 / (bq bk) tiles."""
    keys = _tile_keys(pattern, qa * bq, kb * bk, bq, bk, n)
    if keys is None:
        rep, inverse = np.arange(len(qa)), np.arange(len(qa))
    else:
        _, rep, inverse = np.unique(keys, axis=0, return_index=True, return_inverse=True)
        inverse = inverse.reshape(-1)
    rows = np.arange(bq)[None, :, None]
    cols = np.arange(bk)[None, None, :]
    step = max(1, _CHUNK_PAIRS // (bq * bk))
    kind = np.full(len(rep), -1, np.int64)
    counts = np.zeros(len(rep), np.int64)
    found: dict[bytes, int] = {}
    masks = [np.ones((bq, bk), np.int8)]
    for s in range(0, len(rep), step):
        chunk = rep[s : s + step]
        i = qa[chunk, None, None] * bq + rows
        j = kb[chunk, None, None] * bk + cols
        ok = np.broadcast_to(pattern.allows(i, j, n), (len(i), bq, bk)) & (i < n) & (j < n)
        counts[s : s + step] = ok.sum(axis=(1, 2))
        for t in np.nonzero(counts[s : s + step])[0]:
            if counts[s + t] == bq * bk:
                kind[s + t] = 0
                continue
            bits = np.packbits(ok[t]).tobytes()
            if bits not in found:
                found[bits] = len(masks)
                masks.append(ok[t].astype(np.int8))
            kind[s + t] = found[bits]
    return kind[inverse], counts[inverse], np.stack(masks)


def _tile_keys(pattern, i0: np.ndarray, j0: np.ndarray, bq: int, bk: int, n: int):
    """``[c, k]`` int64 keys of the tiles starting at (``i0``, ``j0``): two tiles with
    one key hold the same pairs. None where the pattern has no such rule (global,
    random, block patterns are evaluated tile by tile). A tile that reaches past ``n``
    gets a key of its own."""
    keys = _rule_keys(pattern, i0, j0, bq, bk)
    if keys is None:
        return None
    edge = (i0 + bq > n) | (j0 + bk > n)
    own = np.where(edge, np.arange(len(i0)) + 1, 0)
    return np.concatenate([keys, own[:, None]], axis=1)


def _rule_keys(pattern, i0, j0, bq: int, bk: int):
    name = type(pattern).__name__
    if hasattr(
        pattern, "tile_keys"
    ):  # a rule that knows its own (sparse/ops/block_sparse/regroup.py)
        keys = pattern.tile_keys(i0, j0, bq, bk)
        if keys is None:
            return None
    elif name in ("Full", "Local", "Dilated", "Strided"):  # a rule of i - j alone
        keys = (i0 - j0)[:, None]
    elif name == "Fixed" and pattern.stride % bq == 0 and pattern.stride % bk == 0:
        # A tile lies in one chunk of queries and one of keys: the rule depends on the
        # positions within the chunks and on whether the chunks are the same.
        s = pattern.stride
        keys = np.stack([i0 % s, j0 % s, np.clip(i0 // s - j0 // s, -1, 1)], axis=1)
    elif name in ("Union", "Intersection"):
        parts = [_rule_keys(p, i0, j0, bq, bk) for p in pattern.parts]
        if any(p is None for p in parts):
            return None
        keys = np.concatenate(parts, axis=1)
    else:
        return None
    if pattern.is_causal:  # j <= i: all, none, or by the exact offset in between
        keys = np.concatenate([keys, np.clip(i0 - j0, -bq, bk)[:, None]], axis=1)
    return keys


def _lists(outer: np.ndarray, inner: np.ndarray, mask_id: np.ndarray, count: int):
    """Per ``outer`` tile (sorted), its ``inner`` tiles and mask ids, padded to a power
    of two (Triton's loads), and the counts."""
    counts = np.bincount(outer, minlength=count).astype(np.int32)
    width = 1 << max(0, int(counts.max(initial=1)) - 1).bit_length()
    tiles = np.zeros((count, width), np.int32)
    masks = np.zeros((count, width), np.int32)
    starts = np.concatenate([[0], np.cumsum(counts)[:-1]])
    slot = np.arange(len(outer)) - starts[outer]
    tiles[outer, slot] = inner
    masks[outer, slot] = mask_id
    return tiles, masks, counts
