"""Fused block-sparse attention for GPUs: any static pattern, its tiles from one plan.

  out_i = sum_{j allowed(i, j)} softmax_j(q_i . k_j * scale) v_j

One flash-attention forward and backward (three Pallas kernels, lowered by Triton on
a GPU and run by Pallas' interpreter elsewhere) whose loops run over the tiles of a
:class:`~flaxformer_lite.sparse.grammar.tiles.TilePlan`: the forward and dq kernels over each
query tile's list of key tiles, the dk/dv kernel over each key tile's list of query
tiles. A full tile is computed without a mask; a partial one under its mask, read from
the plan's few distinct masks. Nothing is gathered and no tile outside the lists is
read, so the work is the pattern's tiles, not ``n^2``; the online softmax runs across
all of them, whatever part of the pattern (window, global columns and rows, random
blocks) put them in the list.

Every pattern of the catalogue and their unions and intersections run here, causal or
not: the plan evaluates the pattern's exact rule (``allows``), so a random pattern has
the blocks the blocked kernel draws. A stride (``Strided``, ``Dilated``, ``Fixed``'s
summary columns, the Sparse Transformer's ``Local | Strided``) runs on positions
regrouped by residue (:mod:`~flaxformer_lite.sparse.ops.block_sparse.regroup`), where its pairs fill
contiguous tiles; a pattern in two parts (its window in the original order, its stride
regrouped) merges them by their log-sum-exps, and each part's backward pass uses the
whole softmax's. The band kernel (:mod:`~flaxformer_lite.sparse.
band_gpu`) computes its window bounds from the block index instead of a table, and
stays the path for a pure two-sided window.

Layout ``[b, n, h, d]``; ``n`` is padded to the tiles (padded pairs are masked by the
plan) and the head size to a power of two of at least 16; float32 accumulation,
inputs in their own dtype. Optional segment ids (packed rows; 0 = padding), as in the
blocked kernel.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.experimental import pallas as pl

from flaxformer_lite.sparse.grammar.tiles import TilePlan
from flaxformer_lite.sparse.ops import triton_lowering as lower
from flaxformer_lite.sparse.ops.block_sparse.regroup import Part, pattern_parts
from flaxformer_lite.sparse.ops.pallas_flash import (
    NEG,
    flash_backward,
    flash_forward,
    flash_inputs,
    score_grads,
    softmax_start,
    softmax_step,
    softmax_write,
    split_refs,
)

Array = jax.Array
NAME = "block_sparse_attention"  # its three kernels: NAME_forward, NAME_dkdv, NAME_dq


def _allowed(mask_ref, mid, qs, ks) -> Array:
    """[bq, bk] bool: the tile's mask (``masks[0]`` = full), and with segment ids the
    same example and not padding."""
    ok = mask_ref[mid] != 0
    if qs is not None:
        ok = ok & (qs[:, None] == ks[None, :]) & (ks[None, :] != 0)
    return ok


def _key_tile(q, t, *, row, tiles_ref, mids_ref, mask_ref, k_ref, v_ref, ks_ref, qs, scale, bk):
    """The t-th listed key tile of query tile ``row``: (k, v, float32 scores, allowed)."""
    start = pl.multiple_of(tiles_ref[row, t] * bk, bk)
    k = k_ref[pl.ds(start, bk), :]
    v = v_ref[pl.ds(start, bk), :]
    s = lower.dot(q, k.T) * scale
    ks = None if qs is None else ks_ref[pl.ds(start, bk)]
    return k, v, s, _allowed(mask_ref, mids_ref[row, t], qs, ks)


def _forward_kernel(*refs, scale, bk, segmented):
    ins, qs_ref, ks_ref, (o_ref, lse_ref) = split_refs(refs, segmented, 7)
    count_ref, tiles_ref, mids_ref, mask_ref, q_ref, k_ref, v_ref = ins
    i = pl.program_id(0)
    bq = q_ref.shape[0]
    q = q_ref[...]
    qs = None if qs_ref is None else qs_ref[...]
    tile = functools.partial(
        _key_tile, q, row=i, tiles_ref=tiles_ref, mids_ref=mids_ref, mask_ref=mask_ref,
        k_ref=k_ref, v_ref=v_ref, ks_ref=ks_ref, qs=qs, scale=scale, bk=bk,
    )  # fmt: skip

    def body(t, carry):
        _, v, s, ok = tile(t)
        return softmax_step(carry, s, ok, v)

    carry = lax.fori_loop(0, count_ref[i], body, softmax_start(bq, v_ref.shape[-1]))
    softmax_write(carry, o_ref, lse_ref)  # a query with no allowed key (padding) gives 0


def _dkdv_kernel(*refs, scale, bq, segmented):
    ins, qs_ref, ks_ref, (dk_ref, dv_ref) = split_refs(refs, segmented, 10)
    count_ref, tiles_ref, mids_ref, mask_ref, q_ref, k_ref, v_ref, do_ref, lse_ref, delta_ref = ins
    j = pl.program_id(0)
    k, v = k_ref[...], v_ref[...]
    ks = None if ks_ref is None else ks_ref[...]

    def body(t, carry):
        dk, dv = carry
        start = pl.multiple_of(tiles_ref[j, t] * bq, bq)
        q = q_ref[pl.ds(start, bq), :]
        do = do_ref[pl.ds(start, bq), :]
        lse = lse_ref[pl.ds(start, bq)]
        delta = delta_ref[pl.ds(start, bq)]
        s = lower.dot(q, k.T) * scale
        qs = None if ks is None else qs_ref[pl.ds(start, bq)]
        ok = _allowed(mask_ref, mids_ref[j, t], qs, ks)
        p, ds = score_grads(s, ok, lse, do, v, delta, scale, q.dtype)
        return dk + lower.dot(ds.T, q), dv + lower.dot(p.astype(do.dtype).T, do)

    init = (
        jnp.zeros((k_ref.shape[0], k_ref.shape[-1]), jnp.float32),
        jnp.zeros((v_ref.shape[0], v_ref.shape[-1]), jnp.float32),
    )
    dk, dv = lax.fori_loop(0, count_ref[j], body, init)
    dk_ref[...] = dk.astype(dk_ref.dtype)
    dv_ref[...] = dv.astype(dv_ref.dtype)


def _dq_kernel(*refs, scale, bk, segmented):
    ins, qs_ref, ks_ref, (dq_ref,) = split_refs(refs, segmented, 10)
    count_ref, tiles_ref, mids_ref, mask_ref, q_ref, k_ref, v_ref, do_ref, lse_ref, delta_ref = ins
    i = pl.program_id(0)
    q, do = q_ref[...], do_ref[...]
    lse, delta = lse_ref[...], delta_ref[...]
    qs = None if qs_ref is None else qs_ref[...]
    tile = functools.partial(
        _key_tile, q, row=i, tiles_ref=tiles_ref, mids_ref=mids_ref, mask_ref=mask_ref,
        k_ref=k_ref, v_ref=v_ref, ks_ref=ks_ref, qs=qs, scale=scale, bk=bk,
    )  # fmt: skip

    def body(t, dq):
        k, v, s, ok = tile(t)
        return dq + lower.dot(score_grads(s, ok, lse, do, v, delta, scale, k.dtype)[1], k)

    dq = lax.fori_loop(0, count_ref[i], body, jnp.zeros((q.shape[0], q.shape[-1]), jnp.float32))
    dq_ref[...] = dq.astype(dq_ref.dtype)


def _tables(plan: TilePlan, transpose: bool) -> tuple[Array, ...]:
    """(counts, tiles, mask ids, masks) of the query tiles' lists (or the key tiles')."""
    if transpose:
        lists = plan.q_count, plan.q_tiles, plan.q_masks
    else:
        lists = plan.kv_count, plan.kv_tiles, plan.kv_masks
    return (*(jnp.asarray(x) for x in lists), jnp.asarray(plan.masks))


def _forward(q, k, v, segs, plan: TilePlan, scale, interpret):
    """(out, lse) of one part, in its own order: ``segs`` = (query ids, key ids) or None."""
    kernel = functools.partial(_forward_kernel, scale=scale, bk=plan.bk, segmented=segs is not None)
    tables = _tables(plan, transpose=False)
    return flash_forward(kernel, NAME, q, k, v, segs, plan.bq, interpret, tables)


def _backward(q, k, v, segs, plan: TilePlan, scale, interpret, g, lse, delta):
    """(dq, dk, dv) of one part, in its own order, given the whole attention's
    log-sum-exp and ``delta = rowsum(out * g)`` (a part's probabilities are its share
    of the whole softmax)."""
    common = dict(scale=scale, segmented=segs is not None)
    kernels = (
        functools.partial(_dkdv_kernel, bq=plan.bq, **common),
        functools.partial(_dq_kernel, bk=plan.bk, **common),
    )
    tables = (_tables(plan, transpose=True), _tables(plan, transpose=False))
    return flash_backward(
        kernels, NAME, q, k, v, segs, g, lse, delta, (plan.bq, plan.bk), interpret, tables
    )


def _into(x, slots, axis: int = 1):
    """Rows of ``x`` (``[bh, m, ...]``, original order) at a part's slots; an empty slot
    (-1) reads zeros."""
    if slots is None:
        return x
    pad = [(0, 0)] * x.ndim
    pad[axis] = (0, 1)
    safe = np.where(slots >= 0, slots, x.shape[axis])
    return jnp.take(jnp.pad(x, pad), jnp.asarray(safe), axis=axis)


def _back(x, slots, m: int, fill=0.0, axis: int = 1):
    """A part's rows (``[bh, slots, ...]``) back in the original order of ``m`` rows;
    positions no slot holds (padding) get ``fill``."""
    if slots is None:
        return x
    where = np.full(m, len(slots))
    where[slots[slots >= 0]] = np.nonzero(slots >= 0)[0]
    pad = [(0, 0)] * x.ndim
    pad[axis] = (0, 1)
    return jnp.take(jnp.pad(x, pad, constant_values=fill), jnp.asarray(where), axis=axis)


def _segments_of(segs, slots):
    return None if segs is None else (_into(segs, slots),) * 2


@functools.partial(jax.custom_vjp, nondiff_argnums=(4, 5, 6))
def _attend(q, k, v, segs, parts, scale, interpret):
    return _attend_fwd(q, k, v, segs, parts, scale, interpret)[0]


def _attend_fwd(q, k, v, segs, parts, scale, interpret):
    """Each part's (out, lse) in its own order, brought back and merged by log-sum-exp."""
    m = q.shape[1]
    outs, lses = [], []
    for part in parts:
        s = part.slots
        out, lse = _forward(
            _into(q, s), _into(k, s), _into(v, s), _segments_of(segs, s), part.plan, scale,
            interpret,
        )  # fmt: skip
        outs.append(_back(out, s, m))
        lses.append(_back(lse, s, m, fill=NEG))
    if len(parts) == 1:
        out, lse = outs[0], lses[0]
    else:
        lse = functools.reduce(jnp.logaddexp, lses)
        out = sum(
            o.astype(jnp.float32) * jnp.exp(l - lse)[..., None]
            for o, l in zip(outs, lses, strict=True)
        )
        out = out.astype(q.dtype)
    return out, (q, k, v, segs, out, lse)


def _attend_bwd(parts, scale, interpret, res, g):
    q, k, v, segs, out, lse = res
    m = q.shape[1]
    delta = jnp.sum(out.astype(jnp.float32) * g.astype(jnp.float32), axis=-1)
    g = g.astype(q.dtype)
    grads = [jnp.zeros(x.shape, jnp.float32) for x in (q, k, v)]
    for part in parts:
        s = part.slots
        dq, dk, dv = _backward(
            _into(q, s), _into(k, s), _into(v, s), _segments_of(segs, s), part.plan, scale,
            interpret, _into(g, s), _into(lse, s), _into(delta, s),
        )  # fmt: skip
        grads = [
            a + _back(b, s, m).astype(jnp.float32) for a, b in zip(grads, (dq, dk, dv), strict=True)
        ]
    return (*(x.astype(y.dtype) for x, y in zip(grads, (q, k, v), strict=True)), None)


_attend.defvjp(_attend_fwd, _attend_bwd)


def block_sparse_attention(
    query: Array,
    key: Array,
    value: Array,
    pattern,
    *,
    scale: float | None = None,
    block_q: int = 64,
    block_k: int = 64,
    segments: Array | None = None,
    interpret: bool | None = None,
    regroup: bool | None = None,
    plan: TilePlan | None = None,
) -> Array:
    """``[b, n, h, d] x3 -> [b, n, h, dv]``: query i attends to the keys j that
    ``pattern`` allows (any static pattern of :mod:`~flaxformer_lite.sparse.grammar.patterns`).

    Args:
      pattern: the pattern (causal or not); its tiles come from
        :func:`~flaxformer_lite.sparse.grammar.tiles.tile_plan`, built once per length.
      scale: logit scale; default ``1/sqrt(d)``.
      block_q, block_k: tile sizes (powers of two, >= 16 for the tensor cores).
      segments: ``[b, n]`` int ids: a query sees keys of its own id only; id 0 is
        padding (sees and is seen by nothing; its output is 0). None: one sequence per row.
      interpret: run through Pallas' interpreter; default: everywhere but on a GPU.
      regroup: a stride's pairs on positions regrouped by residue
        (:func:`~flaxformer_lite.sparse.ops.block_sparse.regroup.pattern_parts`): None = where that
        visits fewer tiles, True = always, False = never.
      plan: a plan to use instead of the pattern's (tests of the kernel's use of it).

    A query that no key is allowed to (padding, or a pattern's empty row) gives 0.
    """
    q, k, v, segs, scale, interpret, unpad = flash_inputs(
        NAME, query, key, value, segments, block_q, block_k, scale, interpret
    )
    n = query.shape[1]
    if plan is None:
        parts = pattern_parts(pattern, n, block_q, block_k, regroup)
    elif (plan.n, plan.bq, plan.bk) != (n, block_q, block_k):
        raise ValueError(
            f"{NAME}: the plan is for n={plan.n}, tiles {plan.bq}x{plan.bk}; "
            f"the inputs have n={n}, tiles {block_q}x{block_k}"
        )
    else:
        parts = (Part(plan),)
    return unpad(_attend(q, k, v, segs, parts, scale, interpret))
