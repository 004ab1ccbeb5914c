"""Sparse attention computed block-wise, without any ``n x n`` array.

``sparse_attention(q, k, v, pattern)`` evaluates

    out_i = sum_{j in S_i} softmax_j(q_i . k_j / sqrt(d)) v_j,   S_i = {j : pattern allows (i, j)}

from the pattern's cover (:class:`~flaxformer_lite.sparse.grammar.plans.Plans`). Each
part of the cover yields a partial softmax (running max ``m``, sum ``l`` and
unnormalised output ``o`` per query), and the parts are merged exactly like
the blocks of an online softmax:

* block part: query block ``a`` reads the key/value blocks listed for it
  (``[nb, S]`` table built in numpy from the block mask), scores
  ``[nb, B, S*B]``: memory ``n * S * B``. Full diagonals of the block mask
  (bands) are read as shifted slices, the other blocks with a gather;
* column part: every query against a fixed set of key positions (global keys,
  Sparse Transformer summaries): ``n * g``;
* stride part: the sequence regrouped by residue ``i % s`` so that "every
  ``s``-th key" becomes a dense ``n/s x n/s`` block per residue: ``n^2 / s``
  (the Sparse Transformer's ``n sqrt(n)`` at ``s = sqrt(n)``);
* row part: global queries attend to all keys densely (``g * n``) and
  overwrite their rows.

A pair covered by two parts is counted once: the column part comes first, then
the blocks, then the strides, and each later part masks the pairs an earlier
one holds. Inside every part the exact rule ``pattern.allows(i, j)`` (and
segment ids for padding/packing) masks the entries, so the result equals
dense attention under the pattern's mask for any pattern, union or
intersection (tests compare values and gradients with a dense oracle).
Lengths that are not a multiple of the block size are padded and masked
internally. The parts share their inputs through one frozen :class:`Problem`;
the softmax arithmetic is :mod:`~flaxformer_lite.sparse.ops.online_softmax`.

Arrays follow the core: ``[batch, length, heads, head_dim]``. Segment ids
``[batch, length]``: a query attends only keys of the same segment, and id 0
marks padding (no query or key). Fully masked queries output zeros, like the
dense core.
"""

from __future__ import annotations

import dataclasses
import math

import jax
import jax.numpy as jnp
import numpy as np
from jax import Array, lax

from flaxformer_lite.sparse.grammar.patterns import Pattern
from flaxformer_lite.sparse.grammar.plans import Plans, num_blocks
from flaxformer_lite.sparse.ops.block_sparse.xla_blocks import (  # noqa: F401 - their home before
    block_diagonals,
    block_partial,
    block_table,
)
from flaxformer_lite.sparse.ops.block_sparse.xla_packed import packed_attention
from flaxformer_lite.sparse.ops.online_softmax import (
    Partial,
    merge,
    normalise,
    pad_to,
    partial_softmax,
    segment_mask,
)


@dataclasses.dataclass(frozen=True)
class Problem:
    """One head chunk's attention as every part of the cover reads it.

    ``q`` (already scaled), ``k``, ``v``: ``[b, h, n, d]`` in the compute dtype;
    ``plans``: the pattern's cover at this length and ``block``; ``is_column``:
    ``[n]`` bool, the key positions the column part holds (the later parts skip
    them); ``seg_q``, ``seg_k``: ``[b, n]`` segment ids or None.
    """

    q: Array
    k: Array
    v: Array
    pattern: Pattern
    plans: Plans
    block: int
    is_column: np.ndarray
    seg_q: Array | None = None
    seg_k: Array | None = None

    @property
    def n(self) -> int:
        return self.q.shape[2]


def sparse_attention(
    query: Array,
    key: Array,
    value: Array,
    pattern: Pattern,
    *,
    block_size: int = 64,
    q_segments: Array | None = None,
    kv_segments: Array | None = None,
    scale: float | None = None,
    heads_per_chunk: int | None = 2,
    scan_blocks: int | None = None,
    packed: bool = False,
) -> Array:
    """Blocked sparse self-attention; ``[b, n, h, d] x3 -> [b, n, h, dv]``.

    Args:
      query, key, value: self-attention inputs of one length ``n``.
      pattern: which pairs may attend (a :class:`Pattern`).
      block_size: kernel block ``B`` (any ``n`` works; it is padded to a multiple).
      q_segments, kv_segments: ``[b, n]`` int segment ids (0 = padding), or None.
      scale: logit scale; default ``1/sqrt(d)`` (the paper's scaled dot product).
      heads_per_chunk: heads computed together; the chunks are independent
        programs, which XLA:CPU runs concurrently (its ops otherwise run one
        core at a time): 4 chunks of 2 heads made fwd+bwd 1.3-1.5x faster on 2
        cores at 8k tokens. None = all heads at once. Values are identical.
      scan_blocks: trade time for memory: compute the block part this many
        query blocks at a time (``lax.map``) and recompute each group's scores
        in the backward pass, so the gathered keys, scores and probabilities
        of only one group are alive at once. None = all blocks together
        (fastest). Values are identical.
      packed: the rows hold several sequences (contiguous runs of one segment id);
        a pattern counted from a sequence's start (``pattern.offset_invariant``
        false) then gives each what it gives the sequence alone in a padded row
        (:mod:`~flaxformer_lite.sparse.ops.block_sparse.xla_packed`; ``scan_blocks``
        does not apply there). Without it, segment ids only mask.
    """
    b, n, h, d = query.shape
    if heads_per_chunk is not None and 0 < heads_per_chunk < h:
        kw = dict(
            block_size=block_size, q_segments=q_segments, kv_segments=kv_segments,
            scale=scale, heads_per_chunk=None, scan_blocks=scan_blocks, packed=packed,
        )  # fmt: skip
        return jnp.concatenate(
            [
                sparse_attention(
                    query[:, :, i : i + heads_per_chunk],
                    key[:, :, i : i + heads_per_chunk],
                    value[:, :, i : i + heads_per_chunk],
                    pattern,
                    **kw,
                )
                for i in range(0, h, heads_per_chunk)
            ],
            axis=2,
        )
    if key.shape[:3] != (b, n, h) or value.shape[:3] != (b, n, h):
        raise ValueError(
            f"sparse self-attention needs query/key/value of one length; got {query.shape}, "
            f"{key.shape}, {value.shape}"
        )
    if (q_segments is None) != (kv_segments is None):
        raise ValueError("give both q_segments and kv_segments, or neither")
    scale = 1.0 / math.sqrt(d) if scale is None else scale
    plans = pattern.plans(n, block_size)
    out_dtype = query.dtype
    compute = jnp.promote_types(query.dtype, jnp.float32)
    q = jnp.swapaxes(query, 1, 2).astype(compute) * scale  # [b, h, n, d]
    k = jnp.swapaxes(key, 1, 2).astype(compute)
    v = jnp.swapaxes(value, 1, 2).astype(compute)

    if packed and q_segments is not None and not pattern.offset_invariant:
        out = packed_attention(q, k, v, pattern, plans, block_size, q_segments)
        return jnp.swapaxes(out, 1, 2).astype(out_dtype)
    is_column = np.zeros(n, bool)
    is_column[plans.columns] = True
    problem = Problem(q, k, v, pattern, plans, block_size, is_column, q_segments, kv_segments)
    parts: list[Partial] = []
    if plans.columns.size:
        parts.append(_columns_part(problem))
    if plans.block_mask is not None:
        parts.append(_blocks_part(problem, scan_blocks))
    for index, stride in enumerate(plans.strides):
        parts.append(_stride_part(problem, stride, earlier=plans.strides[:index]))
    if not parts:
        out = jnp.zeros((b, h, n, value.shape[-1]), compute)
    else:
        out = merge(parts)
    if plans.rows.size:
        out = out.at[:, :, plans.rows].set(_rows_dense(problem))
    return jnp.swapaxes(out, 1, 2).astype(out_dtype)


def _columns_part(p: Problem) -> Partial:
    """Every query against the fixed key positions ``plans.columns``: ``n * g``."""
    n, seg_q, seg_k = p.n, p.seg_q, p.seg_k
    cols = jnp.asarray(p.plans.columns)
    kc, vc = p.k[:, :, cols], p.v[:, :, cols]  # [b, h, g, d]
    scores = jnp.einsum("bhnd,bhgd->bhng", p.q, kc)
    mask = p.pattern.allows(jnp.arange(n)[:, None], cols[None, :], n)[None, None]
    seg = segment_mask(
        None if seg_q is None else seg_q[:, :, None],
        None if seg_k is None else seg_k[:, cols][:, None, :],
    )
    if seg is not None:
        mask = mask & seg[:, None]
    return partial_softmax(scores, mask, lambda w: jnp.einsum("bhng,bhgv->bhnv", w, vc))


def _block_cover(plans: Plans, nb: int) -> tuple[list[int], np.ndarray, np.ndarray]:
    """The ``[nb, S]`` key-block table (and validity) of the block part.

    The first ``len(offsets)`` columns are the full diagonals (``a + o``), the
    rest the leftover blocks of :func:`block_diagonals`.
    """
    offsets, rest = block_diagonals(plans.block_mask)
    tables, valids = [], []
    if offsets:
        rows = np.arange(nb)[:, None]
        target = rows + np.asarray(offsets)[None, :]
        clipped = np.clip(target, 0, nb - 1)
        tables.append(clipped)
        valids.append((target == clipped) & plans.block_mask[rows, clipped])
    if rest.any():
        table, valid = block_table(rest)
        tables.append(table)
        valids.append(valid)
    return offsets, np.concatenate(tables, 1), np.concatenate(valids, 1)


def _blocks_part(p: Problem, scan_blocks: int | None = None) -> Partial:
    """Query blocks against the key blocks the block mask lists for them: ``n * S * B``."""
    q, k, v, pattern, plans, B, n = p.q, p.k, p.v, p.pattern, p.plans, p.block, p.n
    is_column, seg_q, seg_k = p.is_column, p.seg_q, p.seg_k
    b, h, _, d = q.shape
    dv = v.shape[-1]
    nb = num_blocks(n, B)
    npad = nb * B
    qb = pad_to(q, npad, 2).reshape(b, h, nb, B, d)
    kb = pad_to(k, npad, 2).reshape(b, h, nb, B, d)
    vb = pad_to(v, npad, 2).reshape(b, h, nb, B, dv)
    offsets, table, valid = _block_cover(plans, nb)
    S = table.shape[1]
    sq = sk = None
    if seg_q is not None:
        sq = pad_to(seg_q, npad, 1).reshape(b, nb, B)
        sk = pad_to(seg_k, npad, 1).reshape(b, nb, B)
    has_columns = bool(is_column.any())

    def pattern_mask(rows, tbl, ok_blocks):
        """``[g, B, S*B]`` bool: the pattern's pairs of query blocks ``rows`` and their
        table's key blocks. For numpy ``rows``/``tbl`` a constant made at trace time."""
        g = rows.shape[0]
        xp = np if isinstance(rows, np.ndarray) else jnp
        qi = (rows[:, None] * B + xp.arange(B))[:, :, None]
        kj = (tbl[:, :, None] * B + xp.arange(B)).reshape(g, 1, S * B)
        ok = xp.repeat(ok_blocks, B, axis=1)[:, None, :]
        mask = ok & (kj < n) & (qi < n) & pattern.allows(qi, kj, n)
        if has_columns:
            mask = mask & ~xp.asarray(is_column)[xp.clip(kj, 0, n - 1)]
        return mask

    def rows_of(qb_g, rows, tbl, ok_blocks, kg, vg, sq_g):
        """Partial softmax of query blocks ``rows`` against their table's key blocks."""
        g = rows.shape[0]
        kg = kg.reshape(b, h, g, S * B, d)
        vg = vg.reshape(b, h, g, S * B, dv)
        scores = jnp.einsum("bhxqd,bhxkd->bhxqk", qb_g, kg)  # [b, h, g, B, S*B]
        mask = jnp.asarray(pattern_mask(rows, tbl, ok_blocks))[None, None]
        if sq_g is not None:
            sk_g = sk[:, tbl].reshape(b, g, 1, S * B)
            mask = mask & segment_mask(sq_g[..., None], sk_g)[:, None]
        part = partial_softmax(scores, mask, lambda w: jnp.einsum("bhxqk,bhxkv->bhxqv", w, vg))
        return part.m, part.l, part.o

    if scan_blocks is None or scan_blocks >= nb:
        # A group of query blocks at a time, keys read in place (band slices, a
        # gather for the rest), with a recomputing backward: block_kernel.py.
        mask = pattern_mask(np.arange(nb), table, valid)
        seg = {}
        if seg_q is not None:
            seg = dict(seg_q=pad_to(seg_q, npad, 1), seg_k=pad_to(seg_k, npad, 1))
        m, l, o = block_partial(
            pad_to(q, npad, 2), pad_to(k, npad, 2), pad_to(v, npad, 2), B, offsets,
            table[:, len(offsets):], mask, **seg,
        )  # fmt: skip
    else:
        # Groups of `scan_blocks` query blocks, one after another (lax.map), each
        # recomputed in the backward pass (jax.checkpoint): only one group's
        # gathered keys, scores and probabilities are alive at a time.
        groups = -(-nb // scan_blocks)
        extra = groups * scan_blocks - nb

        def grouped(x, axis):  # [.., nb, ..] -> [groups, .., scan_blocks, ..]
            x = jnp.pad(x, [(0, extra if i == axis else 0) for i in range(x.ndim)])
            shape = x.shape[:axis] + (groups, scan_blocks) + x.shape[axis + 1 :]
            return jnp.moveaxis(x.reshape(shape), axis, 0)

        tbl = grouped(jnp.asarray(table), 0)
        ok_blocks = grouped(jnp.asarray(valid), 0)
        rows = grouped(jnp.arange(nb), 0)

        @jax.checkpoint
        def one_group(xs):
            qb_g, rows_g, tbl_g, ok_g, sq_g = xs
            kg, vg = kb[:, :, tbl_g], vb[:, :, tbl_g]
            return rows_of(qb_g, rows_g, tbl_g, ok_g, kg, vg, sq_g)

        xs = (grouped(qb, 2), rows, tbl, ok_blocks, None if sq is None else grouped(sq, 1))
        # [groups, b, h, scan_blocks, B, ...] -> [b, h, npad, ...]
        m, l, o = (
            jnp.moveaxis(x, 0, 2).reshape(b, h, groups * scan_blocks * B, *x.shape[5:])[:, :, :npad]
            for x in lax.map(one_group, xs)
        )
    return Partial(
        m.reshape(b, h, npad)[:, :, :n],
        l.reshape(b, h, npad)[:, :, :n],
        o.reshape(b, h, npad, -1)[:, :, :n],
    )


def _read_blocks(xb: Array, tbl: Array, offsets: list[int]) -> Array:
    """``xb[:, :, tbl]`` ([b, h, nb, S, B, e]); diagonal columns as shifted slices."""
    nb = xb.shape[2]
    parts = []
    if offsets:
        reach = max(abs(o) for o in offsets)
        widths = [(0, 0), (0, 0), (reach, reach), (0, 0), (0, 0)]
        xp = jnp.pad(xb, widths)
        parts.append(jnp.stack([xp[:, :, reach + o : reach + o + nb] for o in offsets], 3))
    if tbl.shape[1] > len(offsets):
        parts.append(xb[:, :, tbl[:, len(offsets) :]])  # gather only the listed blocks
    return jnp.concatenate(parts, 3) if len(parts) > 1 else parts[0]


def _stride_part(p: Problem, s: int, earlier: tuple[int, ...] = ()) -> Partial:
    """Every ``s``-th key, regrouped by residue ``i % s`` into dense ``n/s x n/s`` blocks;
    pairs the earlier parts (columns, blocks, the ``earlier`` strides) hold are masked."""
    q, k, v, pattern, plans, B, n = p.q, p.k, p.v, p.pattern, p.plans, p.block, p.n
    is_column, seg_q, seg_k = p.is_column, p.seg_q, p.seg_k
    b, h, _, d = q.shape
    T = -(-n // s)
    npad = T * s

    def regroup(x):  # [b, h, n, e] -> [b, h, s, T, e]: row r holds positions r, r+s, ...
        return jnp.swapaxes(pad_to(x, npad, 2).reshape(b, h, T, s, x.shape[-1]), 2, 3)

    qr, kr, vr = regroup(q), regroup(k), regroup(v)
    scores = jnp.einsum("bhrtd,bhrud->bhrtu", qr, kr)  # [b, h, s, T, T]
    pos = jnp.arange(T)[None, :] * s + jnp.arange(s)[:, None]  # [s, T]
    i, j = pos[:, :, None], pos[:, None, :]
    mask = (i < n) & (j < n) & pattern.allows(i, j, n)
    jc = jnp.clip(j, 0, n - 1)
    if is_column.any():
        mask = mask & ~jnp.asarray(is_column)[jc]
    if plans.block_mask is not None:
        member = jnp.asarray(plans.block_mask)[jnp.clip(i, 0, n - 1) // B, jc // B]
        mask = mask & ~member
    for t in earlier:
        mask = mask & ((i - j) % t != 0)
    mask = mask[None, None]
    if seg_q is not None:
        sr = jnp.swapaxes(pad_to(seg_q, npad, 1).reshape(b, T, s), 1, 2)  # [b, s, T]
        kr_seg = jnp.swapaxes(pad_to(seg_k, npad, 1).reshape(b, T, s), 1, 2)
        mask = mask & segment_mask(sr[..., None], kr_seg[:, :, None, :])[:, None]
    part = partial_softmax(scores, mask, lambda w: jnp.einsum("bhrtu,bhrue->bhrte", w, vr))

    def ungroup(x):  # [b, h, s, T, ...] -> [b, h, n, ...]
        x = jnp.swapaxes(x, 2, 3)
        return x.reshape(b, h, npad, *x.shape[4:])[:, :, :n]

    return Partial(ungroup(part.m), ungroup(part.l), ungroup(part.o))


def _rows_dense(p: Problem) -> Array:
    """Normalised outputs of the global queries ``plans.rows`` against all keys: ``g * n``."""
    q, k, v, pattern, n, seg_q, seg_k = p.q, p.k, p.v, p.pattern, p.n, p.seg_q, p.seg_k
    r = jnp.asarray(p.plans.rows)
    scores = jnp.einsum("bhgd,bhnd->bhgn", q[:, :, r], k)
    mask = pattern.allows(r[:, None], jnp.arange(n)[None, :], n)[None, None]
    if seg_q is not None:
        mask = mask & segment_mask(seg_q[:, r][:, :, None], seg_k[:, None, :])[:, None]
    part = partial_softmax(scores, mask, lambda w: jnp.einsum("bhgn,bhnv->bhgv", w, v))
    return normalise(part.o, part.l)
