"""The blocked kernel on packed rows, for patterns counted from a sequence's start.

A pattern whose pairs depend on more than ``i - j`` (``Pattern.offset_invariant`` false:
blocks, chunks, global tokens, random blocks) gives a sequence in a packed row what it
gives the same sequence alone in a padded row of the row's length ``n``: the rule at
positions from the sequence's start, ``pattern.allows(pos_i, pos_j, n)``, between tokens
of one sequence (:mod:`~flaxformer_lite.sparse.ops.packing`). Random blocks are drawn per
sequence from its own block index, global tokens are each sequence's own.

How, at the cost of the pattern's cover: the row's sequences are moved apart
(:func:`~flaxformer_lite.sparse.ops.packing.in_sequences`: 1.5x the row's blocks where
its sequences fit, else twice, plus one) so that each one longer than the block ``B``
starts on a multiple of ``B``; its blocks are then the cover's blocks of a sequence at
position 0, shifted by where it starts:

* block part: aligned query block ``a`` of a sequence starting at block ``s`` reads key
  blocks ``s + T[a - s]`` (``T``: the cover's ``[nb, S]`` table), a gather per row;
* column part: the query blocks of a sequence read its own column keys ``s B + c``;
* stride part: on the aligned row, ``i - j`` within a sequence is the difference of
  its positions, so the regrouping by residue works as on an unpacked row;
* row part: each key block gives the partial softmax of its sequence's global queries,
  combined per sequence (segment max and sums over the key blocks of one sequence).

Each part masks the pairs an earlier one holds, as in
:mod:`~flaxformer_lite.sparse.ops.block_sparse.xla`, by the same local tables. A
sequence of at most ``B`` tokens lies inside one aligned block (perhaps beside others):
its queries read that block under the rule (``B x B`` a block), and no other part.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from jax import Array, lax

from flaxformer_lite.sparse.grammar.patterns import Pattern
from flaxformer_lite.sparse.grammar.plans import Plans
from flaxformer_lite.sparse.ops.block_sparse.xla_blocks import block_diagonals, block_table
from flaxformer_lite.sparse.ops.online_softmax import (
    FLOOR,
    NEG,
    Partial,
    merge,
    normalise,
    partial_softmax,
)
from flaxformer_lite.sparse.ops.packing import Aligned, in_sequences


def _take(x: Array, idx: Array, axis: int) -> Array:
    """Per batch row: ``x[b]`` indexed by ``idx[b]`` on ``axis`` (of ``x[b]``)."""
    return jax.vmap(lambda xb, ib: jnp.take(xb, ib, axis=axis))(x, idx)


def packed_attention(
    q: Array, k: Array, v: Array, pattern: Pattern, plans: Plans, block: int, segments: Array
) -> Array:
    """``[b, h, n, d]`` (``q`` scaled, compute dtype) -> ``[b, h, n, dv]``, each sequence of
    the packed ``segments`` ``[b, n]`` under ``pattern`` from its own start."""
    n = q.shape[2]

    def attend(layout, qa, ka, va):
        return _aligned_parts(qa, ka, va, pattern, plans, layout, n)

    return in_sequences(attend, (q, k, v), segments, block, axis=2)


def _aligned_parts(qa, ka, va, pattern: Pattern, plans: Plans, layout: Aligned, n: int) -> Array:
    b, h, slots, d = qa.shape
    B, nba = layout.block, layout.blocks
    run = layout.run.reshape(b, nba, B)
    pos = layout.pos.reshape(b, nba, B)
    # Blocks of a sequence longer than B (its own); the others hold whole short ones.
    blk_long = layout.long.reshape(b, nba, B)[:, :, 0]
    is_column = np.zeros(n, bool)
    is_column[plans.columns] = True
    has_columns = bool(plans.columns.size)
    local_blocks = plans.block_mask

    def rule(pi, pj):
        return pattern.allows(pi, pj, n)

    parts: list[Partial] = []
    if has_columns:
        cols = np.asarray(plans.columns, np.int32)
        cidx = layout.start[..., None] * B + cols  # [b, nba, G]: the sequence's column keys
        ok = (cidx < slots) & blk_long[..., None]
        cidx = jnp.clip(cidx, 0, slots - 1)
        kc, vc = _take(ka, cidx, 1), _take(va, cidx, 1)  # [b, h, nba, G, d]
        rc = _take(layout.run, cidx, 0)  # [b, nba, G]
        scores = jnp.einsum("bhaqd,bhagd->bhaqg", qa.reshape(b, h, nba, B, d), kc)
        mask = (ok & (rc > 0))[:, :, None, :] & (run[..., None] == rc[:, :, None, :])
        mask = mask & rule(pos[..., None], jnp.asarray(cols))
        part = partial_softmax(
            scores, mask[:, None], lambda w: jnp.einsum("bhaqg,bhagv->bhaqv", w, vc)
        )
        parts.append(_flat(part, b, h, slots))
    if local_blocks is not None:
        # A sequence's blocks are consecutive in the moved row: its key block c of query
        # block a (both from its start) is the moved row's block a + (c - a). Full
        # enough diagonals are read as shifted slices (their gradient a pad), the rest
        # (random blocks) gathered per row, as the unpacked kernel does.
        offsets, rest = block_diagonals(local_blocks)
        nb = local_blocks.shape[0]
        local = pos[:, :, 0] // B  # each moved block's index in its sequence
        at = np.arange(nb)[:, None] + np.asarray(offsets, np.int64)[None, :]
        diag_ok = local_blocks[np.arange(nb)[:, None], np.clip(at, 0, nb - 1)] & (at >= 0)
        diag_ok &= at < nb
        oks = [jnp.asarray(diag_ok)[local]] if offsets else []  # [b, nba, len(offsets)]
        tbl = None
        if rest.any():
            table, valid = block_table(rest)
            tbl = layout.start[..., None] + jnp.asarray(table)[local]  # [b, nba, R]
            oks.append(jnp.asarray(valid)[local] & (tbl < nba))
            tbl = jnp.clip(tbl, 0, nba - 1)
        ok = jnp.concatenate(oks, axis=2) & blk_long[..., None]
        S = ok.shape[2]
        kb, vb = ka.reshape(b, h, nba, B, d), va.reshape(b, h, nba, B, -1)
        kg, vg = _blocks_at(kb, 2, offsets, tbl), _blocks_at(vb, 2, offsets, tbl)
        scores = jnp.einsum("bhaqd,bhaskd->bhaqsk", qa.reshape(b, h, nba, B, d), kg)
        scores = scores.reshape(b, h, nba, B, S * B)
        pk = _blocks_at(pos, 1, offsets, tbl).reshape(b, nba, S * B)
        rk = _blocks_at(run, 1, offsets, tbl).reshape(b, nba, S * B)
        okk = jnp.repeat(ok, B, axis=2) & (rk > 0)
        mask = okk[:, :, None, :] & (run[..., None] == rk[:, :, None, :])
        mask = mask & rule(pos[..., None], pk[:, :, None, :])
        if has_columns:
            mask = mask & ~jnp.asarray(is_column)[pk][:, :, None, :]
        vg = vg.reshape(b, h, nba, S * B, -1)
        part = partial_softmax(
            scores, mask[:, None], lambda w: jnp.einsum("bhaqk,bhakv->bhaqv", w, vg)
        )
        parts.append(_flat(part, b, h, slots))
    for index, stride in enumerate(plans.strides):
        parts.append(
            _stride_part(
                qa, ka, va, layout, stride, plans.strides[:index], rule, is_column, local_blocks
            )  # fmt: skip
        )
    short = (run > 0) & ~layout.long.reshape(b, nba, B)
    # Sequences of at most B tokens: their own block, under the rule.
    kb, vb = ka.reshape(b, h, nba, B, d), va.reshape(b, h, nba, B, -1)
    scores = jnp.einsum("bhaqd,bhakd->bhaqk", qa.reshape(b, h, nba, B, d), kb)
    mask = short[..., None] & (run[..., None] == run[:, :, None, :])
    mask = mask & rule(pos[..., None], pos[:, :, None, :])
    part = partial_softmax(scores, mask[:, None], lambda w: jnp.einsum("bhaqk,bhakv->bhaqv", w, vb))
    parts.append(_flat(part, b, h, slots))
    if parts:
        out = merge(parts)
    else:
        out = jnp.zeros((b, h, slots, va.shape[-1]), qa.dtype)
    if plans.rows.size:
        out = _rows(qa, ka, va, layout, np.asarray(plans.rows, np.int32), rule, out, n)
    return out


def _blocks_at(x: Array, axis: int, offsets: list[int], tbl: Array | None) -> Array:
    """``x``'s blocks (on ``axis``, per batch row) ``a + o`` for each offset ``o`` (shifted
    slices, zeros outside the row), then ``x[b][tbl[b]]``, stacked on a new axis after
    ``axis``: ``[.., nba, len(offsets) + R, ..]``."""
    nba = x.shape[axis]
    parts = []
    if offsets:
        reach = max(abs(o) for o in offsets)
        widths = [(0, 0)] * x.ndim
        widths[axis] = (reach, reach)
        padded = jnp.pad(x, widths)
        shifted = [lax.slice_in_dim(padded, reach + o, reach + o + nba, axis=axis) for o in offsets]
        parts.append(jnp.stack(shifted, axis + 1))
    if tbl is not None:
        parts.append(_take(x, tbl, axis - 1))
    return jnp.concatenate(parts, axis + 1) if len(parts) > 1 else parts[0]


def _flat(part: Partial, b: int, h: int, slots: int) -> Partial:
    return Partial(
        part.m.reshape(b, h, slots), part.l.reshape(b, h, slots), part.o.reshape(b, h, slots, -1)
    )


def _stride_part(qa, ka, va, layout: Aligned, s: int, earlier, rule, is_column, local_blocks):
    """Every ``s``-th key of a query's own sequence, regrouped by residue of the aligned
    slot (within a sequence the slots' difference is the positions')."""
    b, h, slots, d = qa.shape
    B = layout.block
    T = -(-slots // s)
    npad = T * s

    def regroup(x, axis):  # tokens on `axis` -> [.., s, T, ..]: row r holds r, r+s, ...
        widths = [(0, 0)] * x.ndim
        widths[axis] = (0, npad - slots)
        x = jnp.pad(x, widths)
        x = x.reshape(*x.shape[:axis], T, s, *x.shape[axis + 1 :])
        return jnp.swapaxes(x, axis, axis + 1)

    qr, kr, vr = regroup(qa, 2), regroup(ka, 2), regroup(va, 2)
    run, pos = regroup(layout.run, 1), regroup(layout.pos, 1)  # [b, s, T]
    scores = jnp.einsum("bhrtd,bhrud->bhrtu", qr, kr)
    ri, rj = run[..., :, None], run[..., None, :]
    pi, pj = pos[..., :, None], pos[..., None, :]
    mask = (ri == rj) & regroup(layout.long, 1)[..., :, None] & rule(pi, pj)
    if is_column.any():
        mask = mask & ~jnp.asarray(is_column)[pj]
    if local_blocks is not None:
        mask = mask & ~jnp.asarray(local_blocks)[pi // B, pj // B]
    for t in earlier:
        mask = mask & ((pi - pj) % t != 0)
    part = partial_softmax(scores, mask[:, None], lambda w: jnp.einsum("bhrtu,bhrue->bhrte", w, vr))

    def ungroup(x):  # [b, h, s, T, ...] -> [b, h, slots, ...]
        x = jnp.swapaxes(x, 2, 3)
        return x.reshape(b, h, npad, *x.shape[4:])[:, :, :slots]

    return Partial(ungroup(part.m), ungroup(part.l), ungroup(part.o))


def _rows(qa, ka, va, layout: Aligned, rows: np.ndarray, rule, out: Array, n: int) -> Array:
    """Each long sequence's global queries (``rows``, from its start) against all its
    keys, overwriting their outputs: per key block, then combined over the key blocks of
    one sequence (a segment max and sums, the sequence named by its first block), ``g``
    queries per key block."""
    b, h, slots, d = qa.shape
    B, nba = layout.block, layout.blocks
    run = layout.run.reshape(b, nba, B)
    pos = layout.pos.reshape(b, nba, B)
    long = layout.long.reshape(b, nba, B)[:, :, 0]
    seq = jnp.where(long, layout.start, nba)  # [b, nba]: the sequence's first block
    ridx = layout.start[..., None] * B + rows  # [b, nba, g]: the key block's sequence's rows
    ok = (ridx < slots) & long[..., None]
    ridx = jnp.clip(ridx, 0, slots - 1)
    ok = ok & (_take(layout.run, ridx, 0) == run[:, :, :1])
    qg = _take(qa, ridx, 1)  # [b, h, nba, g, d]
    kb, vb = ka.reshape(b, h, nba, B, d), va.reshape(b, h, nba, B, -1)
    scores = jnp.einsum("bhagd,bhakd->bhagk", qg, kb)
    mask = ok[..., None] & (run == run[:, :, :1])[:, :, None, :] & (run > 0)[:, :, None, :]
    mask = mask & rule(jnp.asarray(rows)[:, None], pos[:, :, None, :])
    scores = jnp.where(mask[:, None], scores, NEG)
    segs = nba + 1  # a sequence by its first block; nba: the blocks of short ones

    def per_sequence(x, op):  # [b, h, nba, ...] -> [b, h, segs, ...] over the key blocks
        return jax.vmap(
            lambda xb, sb: jnp.moveaxis(op(jnp.moveaxis(xb, 1, 0), sb, num_segments=segs), 0, 1)
        )(x, seq)

    m_seq = per_sequence(jnp.max(scores, axis=-1), jax.ops.segment_max)  # [b, h, segs, g]
    m_seq = lax.stop_gradient(jnp.maximum(m_seq, FLOOR))
    m = _take(jnp.moveaxis(m_seq, 2, 1), seq, 0)  # [b, nba, h, g]
    p = jnp.exp(scores - jnp.moveaxis(m, 1, 2)[..., None])
    l_seq = per_sequence(p.sum(-1), jax.ops.segment_sum)
    o_seq = per_sequence(jnp.einsum("bhagk,bhakv->bhagv", p, vb), jax.ops.segment_sum)
    rows_out = normalise(o_seq, l_seq)  # [b, h, segs, g, dv]
    # Back to the slots: position rows[g] of the sequence from block s takes [s, g].
    which = np.full(n, -1, np.int32)
    which[rows] = np.arange(rows.size)
    g_of = jnp.asarray(which)[jnp.clip(layout.pos, 0, n - 1)]  # [b, slots]
    is_row = (g_of >= 0) & layout.long
    first = jnp.repeat(jnp.minimum(seq, nba - 1), B, axis=1)  # [b, slots]
    flat = rows_out.reshape(b, h, segs * rows.size, -1)
    got = _take(flat, first * rows.size + jnp.maximum(g_of, 0), 1)  # [b, h, slots, dv]
    return jnp.where(is_row[:, None, :, None], got, out)
