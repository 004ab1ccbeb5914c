"""NSA's compressed branch fused for GPUs: every query's attention over the compressed
blocks, forward and backward, without the ``n x n / B`` scores in memory (Pallas,
lowered by Triton on a GPU, run by Pallas' interpreter elsewhere).

    out_i = sum_{j visible to i} softmax_j(q_i . kc_j * scale) vc_j

``kc``/``vc`` hold one token per block of ``B`` keys (:mod:`~flaxformer_lite.sparse.ops.nsa.xla`:
the block's mean through a learned projection). Compressed block ``j`` is visible to
query ``i`` when it holds a present key, (causal) ends at or before ``i``:
``(j + 1) B - 1 <= i``, and (packed rows) all its present keys are of ``i``'s segment;
a query with no visible block outputs zeros (the first block's, causally).

XLA computes the branch a query block at a time (:func:`~flaxformer_lite.sparse.ops.nsa.xla.
_compressed`): the scores of every query against every compressed block go through
memory, forward and again backward. At 64k tokens, 8 heads and blocks of 64 that is
512 Mi scores a pass, and it kept NSA level with cuDNN's dense attention on an H200
while its two other branches ran fused. Here it is a flash attention whose key
loop walks the compressed blocks a chunk at a time, causally only up to the last block
the tile's last query sees (half of them on average), with the online softmax of
:mod:`~flaxformer_lite.sparse.ops.pallas_flash`; the backward recomputes the probabilities
from the saved log-sum-exps (a dq pass over query tiles, a dk/dv pass over chunks of
compressed blocks, each visiting only the tiles that see its blocks). The selection
the same scores make is :mod:`~flaxformer_lite.sparse.ops.moba.routing_triton`'s fused routing over
the compressed keys.

Float32 accumulation in both passes, inputs in their own dtype; the head size is
padded to a power of two (zeros change no score).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from flaxformer_lite.sparse.ops import triton_lowering as lower
from flaxformer_lite.sparse.ops.moba.routing_triton import block_spans
from flaxformer_lite.sparse.ops.pallas_flash import (
    score_grads,
    softmax_start,
    softmax_step,
    softmax_write,
    tile_width,
)

Array = jax.Array
NAME = "nsa_compressed"


def _visible(i, j, has, lo, hi, qseg, *, block, causal, segmented):
    """``[len(i), len(j)]``: compressed block ``j`` is visible to query ``i``."""
    ok = (has != 0)[None, :] & jnp.ones((i.shape[0], 1), bool)
    if causal:
        ok = ok & ((j[None, :] + 1) * block - 1 <= i[:, None])
    if segmented:
        ok = ok & (lo == hi)[None, :] & (lo[None, :] == qseg[:, None])
    return ok


def _chunks_seen(t, tq: int, bk: int, block: int, causal: bool, chunks: int):
    """How many chunks of ``bk`` compressed blocks query tile ``t`` reads: causally up
    to the last block its last query sees, else all."""
    if not causal:
        return chunks
    seen = (t * tq + tq) // block  # blocks ending at or before the tile's last query
    return jnp.minimum((seen + bk - 1) // bk, chunks)


def _first_tile(c, tq: int, bk: int, block: int, causal: bool):
    """The first query tile that sees a block of chunk ``c``."""
    if not causal:
        return 0
    return ((c * bk + 1) * block - 1) // tq


def _key_chunk(q, first, qseg, spans, k_ref, v_ref, c, *, scale, block, bk, causal,
               segmented):  # fmt: skip
    """Chunk ``c`` of compressed blocks against the query tile starting at ``first``:
    (keys, values, scaled scores, visible)."""
    part = pl.ds(pl.multiple_of(c * bk, bk), bk)
    k, v = k_ref[part, :], v_ref[part, :]
    i = first + jnp.arange(q.shape[0], dtype=jnp.int32)
    j = c * bk + jnp.arange(bk, dtype=jnp.int32)
    has, lo, hi = (ref[part] for ref in spans)
    ok = _visible(i, j, has, lo, hi, qseg, block=block, causal=causal, segmented=segmented)
    return k, v, lower.dot(q, k.T).astype(jnp.float32) * scale, ok


def _forward_kernel(has_ref, lo_ref, hi_ref, q_ref, k_ref, v_ref, qs_ref, o_ref, lse_ref,
                    *, scale, block, bk, causal, segmented, chunks):  # fmt: skip
    t = pl.program_id(0)
    tq = q_ref.shape[0]
    q = q_ref[...]
    chunk = functools.partial(_key_chunk, q, t * tq, qs_ref[...], (has_ref, lo_ref, hi_ref),
                              k_ref, v_ref, scale=scale, block=block, bk=bk, causal=causal,
                              segmented=segmented)  # fmt: skip

    def body(c, carry):
        _, v, s, ok = chunk(c)
        return softmax_step(carry, s, ok, v)

    upper = _chunks_seen(t, tq, bk, block, causal, chunks)
    carry = lax.fori_loop(0, upper, body, softmax_start(tq, v_ref.shape[-1]))
    softmax_write(carry, o_ref, lse_ref)


def _dq_kernel(has_ref, lo_ref, hi_ref, q_ref, k_ref, v_ref, do_ref, lse_ref, delta_ref,
               qs_ref, dq_ref, *, scale, block, bk, causal, segmented, chunks):  # fmt: skip
    t = pl.program_id(0)
    tq = q_ref.shape[0]
    q, do, lse, delta = q_ref[...], do_ref[...], lse_ref[...], delta_ref[...]
    chunk = functools.partial(_key_chunk, q, t * tq, qs_ref[...], (has_ref, lo_ref, hi_ref),
                              k_ref, v_ref, scale=scale, block=block, bk=bk, causal=causal,
                              segmented=segmented)  # fmt: skip

    def body(c, dq):
        k, v, s, ok = chunk(c)
        return dq + lower.dot(score_grads(s, ok, lse, do, v, delta, scale, k.dtype)[1], k)

    upper = _chunks_seen(t, tq, bk, block, causal, chunks)
    dq = lax.fori_loop(0, upper, body, jnp.zeros((tq, q_ref.shape[-1]), jnp.float32))
    dq_ref[...] = dq.astype(dq_ref.dtype)


def _dkdv_kernel(has_ref, lo_ref, hi_ref, q_ref, k_ref, v_ref, do_ref, lse_ref, delta_ref,
                 qs_ref, dk_ref, dv_ref, *, scale, block, tq, causal, segmented,
                 tiles):  # fmt: skip
    c = pl.program_id(0)
    bk = k_ref.shape[0]
    k, v = k_ref[...], v_ref[...]
    has, lo, hi = has_ref[...], lo_ref[...], hi_ref[...]
    j = c * bk + jnp.arange(bk, dtype=jnp.int32)

    def body(t, carry):
        dk, dv = carry
        rows = pl.ds(pl.multiple_of(t * tq, tq), tq)
        q, do = q_ref[rows, :], do_ref[rows, :]
        i = t * tq + jnp.arange(tq, dtype=jnp.int32)
        ok = _visible(i, j, has, lo, hi, qs_ref[rows], block=block, causal=causal,
                      segmented=segmented)  # fmt: skip
        s = lower.dot(q, k.T).astype(jnp.float32) * scale
        p, ds = score_grads(s, ok, lse_ref[rows], do, v, delta_ref[rows], scale, q.dtype)
        return dk + lower.dot(ds.T, q), dv + lower.dot(p.astype(do.dtype).T, do)

    init = (
        jnp.zeros((bk, k_ref.shape[-1]), jnp.float32),
        jnp.zeros((bk, v_ref.shape[-1]), jnp.float32),
    )
    first = jnp.minimum(_first_tile(c, tq, bk, block, causal), tiles)
    dk, dv = lax.fori_loop(first, tiles, body, init)
    dk_ref[...] = dk.astype(dk_ref.dtype)
    dv_ref[...] = dv.astype(dv_ref.dtype)


def _specs(h: int, m: int, width: int):
    """BlockSpecs over a grid (tiles, b*h): a tile of a ``[b*h, ...]`` array, a whole
    row of one, and the batch row's per-block table / per-query ids."""

    def tile(rows, d=None):
        if d is None:
            return pl.BlockSpec((None, rows), lambda t, r: (r, t))
        return pl.BlockSpec((None, rows, d), lambda t, r: (r, t, 0))

    def whole(rows, d=None):
        if d is None:
            return pl.BlockSpec((None, rows), lambda t, r: (r, 0))
        return pl.BlockSpec((None, rows, d), lambda t, r: (r, 0, 0))

    def batch_tile(rows):
        return pl.BlockSpec((None, rows), lambda t, r: (r // h, t))

    table = pl.BlockSpec((None, width), lambda t, r: (r // h, 0))
    ids_whole = pl.BlockSpec((None, m), lambda t, r: (r // h, 0))
    return tile, whole, table, batch_tile, ids_whole


def _forward(q, kc, vc, tables, statics):
    has, lo, hi, qseg = tables
    block, causal, segmented, scale, tq, bk, h, interpret = statics
    bh, m, d = q.shape
    width, dv = kc.shape[1], vc.shape[-1]
    tile, whole, table, batch_tile, _ = _specs(h, m, width)
    kernel = functools.partial(_forward_kernel, scale=scale, block=block, bk=bk, causal=causal,
                               segmented=segmented, chunks=width // bk)  # fmt: skip
    return pl.pallas_call(
        kernel,
        grid=(m // tq, bh),
        in_specs=[*[table] * 3, tile(tq, d), whole(width, d), whole(width, dv), batch_tile(tq)],
        out_specs=[tile(tq, dv), tile(tq)],
        out_shape=[
            jax.ShapeDtypeStruct((bh, m, dv), q.dtype),
            jax.ShapeDtypeStruct((bh, m), jnp.float32),
        ],
        compiler_params=lower.compiler_params(4, 2, interpret),
        interpret=interpret,
        name=f"{NAME}_forward",
    )(has, lo, hi, q, kc, vc, qseg)


@functools.partial(jax.custom_vjp, nondiff_argnums=(4,))
def _attend(q, kc, vc, tables, statics):
    return _forward(q, kc, vc, tables, statics)[0]


def _attend_fwd(q, kc, vc, tables, statics):
    out, lse = _forward(q, kc, vc, tables, statics)
    return out, (q, kc, vc, tables, out, lse)


def _attend_bwd(statics, residuals, g):
    q, kc, vc, tables, out, lse = residuals
    has, lo, hi, qseg = tables
    block, causal, segmented, scale, tq, bk, h, interpret = statics
    bh, m, d = q.shape
    width, dv = kc.shape[1], vc.shape[-1]
    g = g.astype(q.dtype)
    delta = jnp.sum(out.astype(jnp.float32) * g.astype(jnp.float32), axis=-1)
    tile, whole, table, batch_tile, ids_whole = _specs(h, m, width)
    common = dict(scale=scale, block=block, causal=causal, segmented=segmented)
    dq = pl.pallas_call(
        functools.partial(_dq_kernel, bk=bk, chunks=width // bk, **common),
        grid=(m // tq, bh),
        in_specs=[
            *[table] * 3,
            tile(tq, d),
            whole(width, d),
            whole(width, dv),
            tile(tq, dv),
            tile(tq),
            tile(tq),
            batch_tile(tq),
        ],
        out_specs=tile(tq, d),
        out_shape=jax.ShapeDtypeStruct(q.shape, q.dtype),
        compiler_params=lower.compiler_params(4, 2, interpret),
        interpret=interpret,
        name=f"{NAME}_dq",
    )(has, lo, hi, q, kc, vc, g, lse, delta, qseg)
    dk, dv_ = pl.pallas_call(
        functools.partial(_dkdv_kernel, tq=tq, tiles=m // tq, **common),
        grid=(width // bk, bh),
        in_specs=[
            *[batch_tile(bk)] * 3,
            whole(m, d),
            tile(bk, d),
            tile(bk, dv),
            whole(m, dv),
            whole(m),
            whole(m),
            ids_whole,
        ],
        out_specs=[tile(bk, d), tile(bk, dv)],
        out_shape=[
            jax.ShapeDtypeStruct(kc.shape, kc.dtype),
            jax.ShapeDtypeStruct(vc.shape, vc.dtype),
        ],  # fmt: skip
        compiler_params=lower.compiler_params(4, 2, interpret),
        interpret=interpret,
        name=f"{NAME}_dkdv",
    )(has, lo, hi, q, kc, vc, g, lse, delta, qseg)
    return dq, dk, dv_, None


_attend.defvjp(_attend_fwd, _attend_bwd)


def compressed_attention(
    q: Array,
    kc: Array,
    vc: Array,
    present: Array,
    segments: Array | None,
    block: int,
    causal: bool,
    *,
    scale: float = 1.0,
    block_q: int = 64,
    block_k: int = 64,
    interpret: bool | None = None,
) -> Array:
    """NSA's compressed branch ``[b, h, N, dv]``: queries ``q [b, h, N, d]`` (``N`` a
    multiple of ``block``) against the compressed keys and values ``kc, vc [b, h, N /
    block, d | dv]``; ``present [b, N]`` (a real token), ``segments [b, N]`` or None;
    visibility as in the module doc. ``block_q``, ``block_k``: the query tile and the
    chunk of compressed blocks (powers of two, >= 16). Differentiable in ``q``, ``kc``
    and ``vc``."""
    b, h, N, d = q.shape
    nb, dv = kc.shape[2], vc.shape[-1]
    if N != nb * block or kc.shape[:2] != (b, h) or vc.shape[:3] != kc.shape[:3]:
        raise ValueError(f"{NAME}: queries {q.shape} against compressed keys {kc.shape} "
                         f"and values {vc.shape} at block={block}: expected [b, h, N, d] "
                         "and [b, h, N / block, d]")  # fmt: skip
    for which, size in (("block_q", block_q), ("block_k", block_k)):
        if size < 16 or size & (size - 1):
            raise ValueError(f"{NAME}: {which}={size} must be a power of two >= 16")
    m = -(-N // block_q) * block_q
    width = -(-nb // block_k) * block_k
    dp, dvp = tile_width(d), tile_width(dv)

    def rows(x, length, e):
        x = jnp.pad(x, ((0, 0), (0, 0), (0, length - x.shape[2]), (0, e - x.shape[3])))
        return x.reshape(b * h, length, e)

    has, lo, hi = block_spans(present, segments, block, width)
    qseg = jnp.zeros((b, m), jnp.int32)
    if segments is not None:
        qseg = jnp.pad(segments.astype(jnp.int32), ((0, 0), (0, m - N)))
    if interpret is None:
        interpret = jax.default_backend() != "gpu"
    statics = (block, causal, segments is not None, float(scale), block_q, block_k, h,
               bool(interpret))  # fmt: skip
    out = _attend(rows(q, m, dp), rows(kc.astype(q.dtype), width, dp),
                  rows(vc.astype(q.dtype), width, dvp), (has, lo, hi, qseg), statics)  # fmt: skip
    return out[:, :N, :dv].reshape(b, h, N, dv)
