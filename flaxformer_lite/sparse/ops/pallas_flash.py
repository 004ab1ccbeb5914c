"""What the project's flash-attention kernels for GPUs share (Pallas, lowered by Triton on a
GPU, run by Pallas' interpreter elsewhere): the layout ``[b*h, m, d]`` with ``m`` padded
to the tiles and the head size to a power of two, the BlockSpecs of a tile and of a
whole row over the grid (tiles, b*h), and the three ``pallas_call`` s of a forward and
backward pass (:func:`flash_forward`, :func:`flash_backward`). The kernels themselves
(which keys a query tile visits, and how it masks them) are
:mod:`~flaxformer_lite.sparse.ops.band.pallas_triton`'s and
:mod:`~flaxformer_lite.sparse.ops.block_sparse.pallas_triton`'s.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from flaxformer_lite.sparse.ops import triton_lowering as lower

Array = jax.Array

NEG = -1e30  # a masked logit: finite, so a row whose first block is all masked stays finite


# The online softmax and its gradients, one key tile at a time (float32 accumulators).


def softmax_start(rows: int, width: int):
    """(acc, running max, running sum) before the first key tile."""
    return (
        jnp.zeros((rows, width), jnp.float32),
        jnp.full((rows,), NEG, jnp.float32),
        jnp.zeros((rows,), jnp.float32),
    )


def softmax_step(carry, s, ok, v):
    """The carry after a key tile's scores ``s`` (allowed where ``ok``) and values."""
    acc, m, l = carry
    s = jnp.where(ok, s, NEG)
    m_new = jnp.maximum(m, jnp.max(s, axis=1))
    p = jnp.where(ok, jnp.exp(s - m_new[:, None]), 0.0)
    alpha = jnp.exp(m - m_new)
    acc = acc * alpha[:, None] + lower.dot(p.astype(v.dtype), v)
    return acc, m_new, l * alpha + jnp.sum(p, axis=1)


def softmax_write(carry, o_ref, lse_ref) -> None:
    """The output tile and its log-sum-exps; a query no key reached gives 0."""
    acc, m, l = carry
    l_safe = jnp.where(l > 0, l, 1.0)
    o_ref[...] = (acc / l_safe[:, None]).astype(o_ref.dtype)
    lse_ref[...] = m + jnp.log(l_safe)


def score_grads(s, ok, lse, do, v, delta, scale, dtype):
    """(probabilities, score gradients in ``dtype``) of a tile, given the whole
    softmax's log-sum-exp and ``delta = rowsum(out * dout)``."""
    p = jnp.where(ok, jnp.exp(s - lse[:, None]), 0.0)
    dp = lower.dot(do, v.T)
    return p, (p * (dp - delta[:, None]) * scale).astype(dtype)


def rows(x: Array, block: int) -> tuple[Array, int]:
    """[b, n, h, d] -> [b*h, m, d] with m the next multiple of block (zeros appended)."""
    b, n, h, d = x.shape
    m = -(-n // block) * block
    x = jnp.swapaxes(x, 1, 2).reshape(b * h, n, d)
    return jnp.pad(x, ((0, 0), (0, m - n), (0, 0))), m


def specs(m: int):
    """BlockSpecs of one tile of ``rows`` rows and of a whole row, for grid (tiles, b*h)."""

    def tile(rows, d):
        return pl.BlockSpec((None, rows, d), lambda t, r: (r, t, 0))

    def whole(d):
        return pl.BlockSpec((None, m, d), lambda t, r: (r, 0, 0))

    return tile, whole


def segment_specs(segs, bh: int, m: int):
    """Specs of the ``[b, m]`` segment ids for grid (tiles, b*h): a tile of a row, and
    the whole row, of the batch row r // h."""
    h = bh // segs.shape[0]

    def tile(rows):
        return pl.BlockSpec((None, rows), lambda t, r: (r // h, t))

    return tile, pl.BlockSpec((None, m), lambda t, r: (r // h, 0))


def whole_table(x) -> pl.BlockSpec:
    """Every program reads the whole (small) table ``x``."""
    return pl.BlockSpec(x.shape, lambda t, r: (0,) * x.ndim)


def row_table(x) -> pl.BlockSpec:
    """Program (t, r) reads row ``r`` of ``x [b*h, ...]`` (a table per batch row and head,
    such as the routed kernel's data-dependent tile lists)."""
    return pl.BlockSpec((None, *x.shape[1:]), lambda t, r: (r,) + (0,) * (x.ndim - 1))


def flash_forward(kernel, name: str, q, k, v, segs, bq: int, interpret: bool, tables=(),
                  table_spec=whole_table):  # fmt: skip
    """(out, lse) of a flash-attention forward ``kernel`` over the grid (query tiles,
    b*h). Its refs: ``tables`` (read by ``table_spec``: whole, or :func:`row_table`), the
    query tile, every key and value, then with ``segs`` = (query ids, key ids) the
    tile's query ids and every key id; then the output tile and its log-sum-exps. (The
    band, block-sparse and routed kernels.)"""
    bh, m, d = q.shape
    tile, whole = specs(m)
    in_specs = [*map(table_spec, tables), tile(bq, d), whole(d), whole(v.shape[-1])]
    extra = ()
    if segs is not None:
        seg_tile, seg_whole = segment_specs(segs[0], bh, m)
        in_specs, extra = [*in_specs, seg_tile(bq), seg_whole], segs
    return pl.pallas_call(
        kernel,
        grid=(m // bq, bh),
        in_specs=in_specs,
        out_specs=[tile(bq, v.shape[-1]), pl.BlockSpec((None, bq), lambda t, r: (r, t))],
        out_shape=[
            jax.ShapeDtypeStruct((bh, m, v.shape[-1]), q.dtype),
            jax.ShapeDtypeStruct((bh, m), jnp.float32),
        ],
        compiler_params=lower.compiler_params(4, 2, interpret),
        interpret=interpret,
        name=f"{name}_forward",
    )(*tables, q, k, v, *extra)


def flash_backward(kernels, name: str, q, k, v, segs, g, lse, delta, tiles, interpret,
                   tables=((), ()), table_spec=whole_table):  # fmt: skip
    """(dq, dk, dv) of a flash-attention backward: ``kernels`` = (dk/dv kernel over the
    grid (key tiles, b*h), dq kernel over (query tiles, b*h)); ``tiles`` = (bq, bk);
    ``tables`` = (the dk/dv kernel's, the dq kernel's), read whole. Each kernel's refs:
    its tables, q, k, v, the output's gradient, lse and delta (a whole row or the
    kernel's tile of each), with ``segs`` the segment ids, then its outputs."""
    bh, m, d = q.shape
    (bq, bk), dv_dim = tiles, v.shape[-1]
    tile, whole = specs(m)
    whole_vec = pl.BlockSpec((None, m), lambda t, r: (r, 0))
    tile_vec = pl.BlockSpec((None, bq), lambda t, r: (r, t))
    dkdv_specs = [*map(table_spec, tables[0]), whole(d), tile(bk, d), tile(bk, dv_dim),
                  whole(dv_dim), whole_vec, whole_vec]  # fmt: skip
    dq_specs = [*map(table_spec, tables[1]), tile(bq, d), whole(d), whole(dv_dim),
                tile(bq, dv_dim), tile_vec, tile_vec]  # fmt: skip
    extra = ()
    if segs is not None:
        seg_tile, seg_whole = segment_specs(segs[0], bh, m)
        dkdv_specs += [seg_whole, seg_tile(bk)]  # query ids whole, key ids of the tile
        dq_specs += [seg_tile(bq), seg_whole]
        extra = segs
    dk, dv = pl.pallas_call(
        kernels[0],
        grid=(m // bk, bh),
        in_specs=dkdv_specs,
        out_specs=[tile(bk, d), tile(bk, dv_dim)],
        out_shape=[jax.ShapeDtypeStruct(k.shape, k.dtype), jax.ShapeDtypeStruct(v.shape, v.dtype)],
        compiler_params=lower.compiler_params(4, 2, interpret),
        interpret=interpret,
        name=f"{name}_dkdv",
    )(*tables[0], q, k, v, g, lse, delta, *extra)
    dq = pl.pallas_call(
        kernels[1],
        grid=(m // bq, bh),
        in_specs=dq_specs,
        out_specs=tile(bq, d),
        out_shape=jax.ShapeDtypeStruct(q.shape, q.dtype),
        compiler_params=lower.compiler_params(4, 2, interpret),
        interpret=interpret,
        name=f"{name}_dq",
    )(*tables[1], q, k, v, g, lse, delta, *extra)
    return dq, dk, dv


def tile_width(d: int) -> int:
    return max(16, 1 << (d - 1).bit_length())


def pad_heads(x: Array, width: int) -> Array:
    d = x.shape[-1]
    return x if d == width else jnp.pad(x, ((0, 0), (0, 0), (0, 0), (0, width - d)))


def flash_inputs(name, query, key, value, segments, block_q, block_k, scale, interpret):
    """The checks and layout a flash kernel's public function shares: ``[b, n, h, d]``
    inputs of one b, n, h, power-of-two tiles of at least 16, ``[b, n]`` segment ids.
    Returns (q, k, v ``[b*h, m, d]`` padded to the tiles and heads, segment ids padded
    to ``m`` or None, the logit scale, interpret, ``unpad``: the kernel's ``[b*h, m,
    dv]`` output back to ``[b, n, h, dv]``); errors name ``name``."""
    b, n, h, d = query.shape
    if key.shape[:3] != (b, n, h) or value.shape[:3] != (b, n, h):
        raise ValueError(
            f"{name} is self-attention over one length: query {query.shape}, key "
            f"{key.shape}, value {value.shape}; pass [b, n, h, d] arrays of one b, n, h"
        )
    for which, blk in (("block_q", block_q), ("block_k", block_k)):
        if blk < 16 or blk & (blk - 1):
            raise ValueError(f"{name}: {which}={blk} must be a power of two >= 16")
    if segments is not None and segments.shape != (b, n):
        raise ValueError(f"{name}: segments {segments.shape}, expected {(b, n)}")
    scale = 1.0 / math.sqrt(d) if scale is None else float(scale)
    dv = value.shape[-1]
    padded = (
        pad_heads(query, tile_width(d)),
        pad_heads(key, tile_width(d)),
        pad_heads(value, tile_width(dv)),
    )
    (q, m), (k, _), (v, _) = (rows(x, max(block_q, block_k)) for x in padded)
    segs = None
    if segments is not None:
        segs = jnp.pad(segments.astype(jnp.int32), ((0, 0), (0, m - n)))
    if interpret is None:
        interpret = jax.default_backend() != "gpu"

    def unpad(out):
        return jnp.swapaxes(out[:, :n, :dv].reshape(b, h, n, dv), 1, 2)

    return q, k, v, segs, scale, bool(interpret), unpad


def split_refs(refs, segmented: bool, n_in: int):
    """(inputs, query ids, key ids, outputs) of a kernel's refs: the segment ids sit
    after the ``n_in`` other inputs when present."""
    if segmented:
        return refs[:n_in], refs[n_in], refs[n_in + 1], refs[n_in + 2 :]
    return refs[:n_in], None, None, refs[n_in:]
