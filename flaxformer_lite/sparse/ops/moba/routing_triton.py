"""MoBA's routing fused for GPUs: each query's best key blocks in one pass, without the
``n x n / B`` scores in memory (Pallas, lowered by Triton on a GPU, run by Pallas'
interpreter elsewhere).

The XLA routing (:func:`~flaxformer_lite.sparse.ops.moba.xla.moba_routing`) writes every
query's score against every block summary (at 64k tokens, 8 heads and blocks of 64: 2
GiB in float32), masks it and takes the top blocks by passes over it; on an H200 that
was 8 ms of MoBA's 16 ms forward+backward, for ~0.1 ms of arithmetic. Here a program
holds a tile of queries (all in one query block) and walks the block summaries a
chunk at a time: it scores the chunk (one ``[tile, d] x [d, chunk]`` product), masks
what the query may not choose (its own block; later blocks where causal; blocks with
no present key or outside the query's segment ids; padding queries route nowhere) and
merges the chunk's best into a running set of ``slots`` candidates per query, in
registers. Causal tiles stop at their own block, so they read half the summaries on
average. Only the table is written: ``n * (k - 1)`` indices.

The table is :func:`~flaxformer_lite.sparse.ops.moba.xla.top_blocks`': the best allowed
blocks by score, ties to the lower index, an empty slot (``valid`` False, index 0)
where fewer are allowed. Scores are the products of the inputs as given (float32 in
MoBA; Triton's default float32 dot on a GPU uses tf32, so a near-tie may rank otherwise
than XLA's product there; exact through the interpreter). No gradient: the choice is
not differentiable (its inputs are stopped).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from flaxformer_lite.sparse.ops import triton_lowering as lower

Array = jax.Array
NAME = "moba_routing"
FAR = 1 << 28  # an index past every block: the initial candidates'
TAKEN = 1 << 29  # a candidate already written out
DEMOTED = -1e30  # the score of a candidate ranked after every scored one (finite: chosen)


def tile_size(block: int) -> int | None:
    """The query tile: the largest power of two <= 64 dividing ``block``, at least 16
    (Triton's smallest product), or None (the block does not allow the fused kernel)."""
    for tq in (64, 32, 16):
        if block % tq == 0:
            return tq
    return None


def _kernel(has_ref, lo_ref, hi_ref, q_ref, means_ref, qok_ref, qseg_ref, table_ref,
            valid_ref, *, block, tq, chunk, slots, others, causal, chunks,
            whole_first):  # fmt: skip
    t = pl.program_id(0)
    a = (t * tq) // block  # the tiles' query block
    q = q_ref[...]
    qok, qseg = qok_ref[...] != 0, qseg_ref[...]
    col = jnp.arange(chunk, dtype=jnp.int32)
    slot = jnp.arange(slots, dtype=jnp.int32)

    def step(c, carry):
        best_v, best_i = carry
        j = c * chunk + col
        part = pl.ds(c * chunk, chunk)
        s = lower.dot(q, means_ref[part, :].T).astype(jnp.float32)
        ok = (j != a) & (has_ref[part] != 0)
        if causal:
            ok = ok & (j < a)
        ok = ok[None, :] & qok[:, None]
        inside = (lo_ref[part][None, :] <= qseg[:, None]) & (qseg[:, None] <= hi_ref[part][None, :])
        ok = ok & inside
        if whole_first:  # a block partly of another segment after the others (NSA)
            s = jnp.where(lo_ref[part][None, :] == hi_ref[part][None, :], s, DEMOTED)
        s = jnp.where(ok, s, -jnp.inf)
        for _ in range(others):  # the chunk's best, one at a time, into the set
            m = jnp.max(s, axis=1)
            idx = jnp.min(jnp.where(s == m[:, None], j[None, :], FAR), axis=1)
            s = jnp.where(j[None, :] == idx[:, None], -jnp.inf, s)
            worst = jnp.min(best_v, axis=1)  # the set's last: least score, highest index
            wi = jnp.max(jnp.where(best_v == worst[:, None], best_i, -1), axis=1)
            enter = (m > -jnp.inf) & ((m > worst) | ((m == worst) & (idx < wi)))
            hit = enter[:, None] & (best_v == worst[:, None]) & (best_i == wi[:, None])
            best_v = jnp.where(hit, m[:, None], best_v)
            best_i = jnp.where(hit, idx[:, None], best_i)
        return best_v, best_i

    start = (
        jnp.full((tq, slots), -jnp.inf, jnp.float32),
        jnp.broadcast_to(FAR + slot[None, :], (tq, slots)),
    )
    upper = (a + chunk - 1) // chunk if causal else chunks
    best_v, best_i = lax.fori_loop(0, upper, step, start)
    table = jnp.zeros((tq, slots), jnp.int32)
    valid = jnp.zeros((tq, slots), jnp.int32)
    for r in range(others):  # the set in order: best first, ties to the lower index
        m = jnp.max(best_v, axis=1)
        idx = jnp.min(jnp.where(best_v == m[:, None], best_i, TAKEN + FAR), axis=1)
        live = m > -jnp.inf
        table = jnp.where(slot[None, :] == r, jnp.where(live, idx, 0)[:, None], table)
        valid = jnp.where(slot[None, :] == r, live.astype(jnp.int32)[:, None], valid)
        gone = (best_v == m[:, None]) & (best_i == idx[:, None])
        best_v = jnp.where(gone, -jnp.inf, best_v)
        best_i = jnp.where(gone, TAKEN + best_i, best_i)
    table_ref[...] = table
    valid_ref[...] = valid


def block_spans(present: Array, segments: Array | None, block: int, width: int):
    """Per block of ``present [b, N]`` (``N = nb * block``), as int32 ``[b, width]``:
    holds a present key (0 past ``nb``); the least and the largest segment id of its
    present keys (all 0 without segments; an empty span, lo > hi, where it holds
    none)."""
    b, N = present.shape
    nb = N // block
    here = present.reshape(b, nb, block)
    seg = jnp.zeros((b, N), jnp.int32) if segments is None else segments.astype(jnp.int32)
    blocks = seg.reshape(b, nb, block)
    lo = jnp.where(here, blocks, jnp.iinfo(jnp.int32).max).min(-1)
    hi = jnp.where(here, blocks, -1).max(-1)

    def pad(x, fill):
        return jnp.pad(x.astype(jnp.int32), ((0, 0), (0, width - nb)), constant_values=fill)

    return pad(here.any(-1), 0), pad(lo, 1), pad(hi, 0)


def fused_routing(q: Array, means: Array, present: Array, segments: Array | None,
                  block: int, others: int, causal: bool, *, chunk: int = 64,
                  whole_first: bool = False,
                  interpret: bool | None = None) -> tuple[Array, Array]:  # fmt: skip
    """``(table, valid)`` ``[b, h, N, others]`` of MoBA's per-query gate: ``q [b, h, N,
    d]`` (``N`` a multiple of ``block``) against the block summaries ``means [b, h,
    N / block, d]``; ``present [b, N]`` (a real token), ``segments [b, N]`` or None.
    Same table as ``top_blocks`` over ``routed.token_candidates`` (module doc).
    ``whole_first``: a candidate block partly of another segment ranks after all
    others, by index (NSA's selection over its compressed keys, which such a block
    is not among: :mod:`~flaxformer_lite.sparse.ops.nsa.xla`)."""
    b, h, N, d = q.shape
    nb = means.shape[2]
    tq = tile_size(block)
    if tq is None or N != nb * block or others < 1:
        raise ValueError(f"{NAME}: block={block} must be a multiple of 16 (N={N}, "
                         f"{nb} blocks, {others} to choose); use the XLA routing")  # fmt: skip
    chunk = max(16, min(chunk, 1 << (nb - 1).bit_length()))
    nbp = -(-nb // chunk) * chunk
    dp = max(16, 1 << (d - 1).bit_length())
    slots = max(2, 1 << (others - 1).bit_length())
    q = lax.stop_gradient(q)
    means = lax.stop_gradient(means).astype(q.dtype)
    q = jnp.pad(q, ((0, 0), (0, 0), (0, 0), (0, dp - d))).reshape(b * h, N, dp)
    means = jnp.pad(means, ((0, 0), (0, 0), (0, nbp - nb), (0, dp - d))).reshape(b * h, nbp, dp)
    seg = jnp.zeros((b, N), jnp.int32) if segments is None else segments.astype(jnp.int32)
    has, lo, hi = block_spans(present, segments, block, nbp)
    if interpret is None:
        interpret = jax.default_backend() != "gpu"
    kernel = functools.partial(_kernel, block=block, tq=tq, chunk=chunk, slots=slots,
                               others=others, causal=causal, chunks=nbp // chunk,
                               whole_first=whole_first)  # fmt: skip
    row = pl.BlockSpec((None, nbp), lambda t, r: (r // h, 0))
    tile = pl.BlockSpec((None, tq), lambda t, r: (r // h, t))
    out = pl.BlockSpec((None, tq, slots), lambda t, r: (r, t, 0))
    table, valid = pl.pallas_call(
        kernel,
        grid=(N // tq, b * h),
        in_specs=[row, row, row, pl.BlockSpec((None, tq, dp), lambda t, r: (r, t, 0)),
                  pl.BlockSpec((None, nbp, dp), lambda t, r: (r, 0, 0)), tile, tile],
        out_specs=[out, out],
        out_shape=[jax.ShapeDtypeStruct((b * h, N, slots), jnp.int32)] * 2,
        compiler_params=lower.compiler_params(4, 1, bool(interpret)),
        interpret=bool(interpret),
        name=NAME,
    )(has, lo, hi, q, means, present.astype(jnp.int32), seg)  # fmt: skip
    table = table[..., :others].reshape(b, h, N, others)
    return table, valid[..., :others].reshape(b, h, N, others) != 0
