"""Band attention for GPUs that visits only the key blocks a window reaches.

  out_i = sum_{j : -right <= i - j <= left} softmax_j(q_i . k_j * scale) v_j

``left = right = w`` is :class:`~flaxformer_lite.sparse.grammar.patterns.Local` ``(w)`` (an
encoder's window), ``left = w, right = 0`` its causal form, ``left = right = n`` dense
and ``left = n, right = 0`` causal dense. Three Pallas kernels (lowered by Triton on a
GPU, run by Pallas' interpreter elsewhere) make a flash-attention forward and backward
whose key loop (forward, dq) and query loop (dk, dv) run over the blocks that hold an
allowed pair and no others, so a window of w costs O(n w), not O(n^2), in both passes.

Why a kernel of our own: the blocked kernel (:mod:`flaxformer_lite.sparse.ops.block_sparse.xla`)
gathers key blocks in XLA and is 7x slower than cuDNN's causal window on an H200;
cuDNN computes no two-sided window; tokamax's Mosaic-GPU kernel bounds the forward's
key loop but its backward visits every block (experiments/performance/gpu). Here the
bounds of each query block's key range are two integers computed from the block index,
so the loop is short and nothing is gathered.

Layout ``[b, n, h, d]`` like the rest of the package; ``n`` is padded to a multiple of
the block (padded keys are masked) and the head size to a power of two; float32
accumulation in both passes, inputs in their own dtype (bfloat16 for the tensor cores).
Optional segment ids (packed rows, padding = 0) as in the blocked kernel. The model
runs it for a two-sided ``local:window=w`` head group under ``attention_impl=cudnn``
(cuDNN's own window is left-only); the benchmark calls it directly.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from flaxformer_lite.sparse.ops import triton_lowering as lower
from flaxformer_lite.sparse.ops.pallas_flash import (
    flash_backward,
    flash_forward,
    flash_inputs,
    score_grads,
    softmax_start,
    softmax_step,
    softmax_write,
)

Array = jax.Array


def _allowed(q_first, k_first, shape, left: int, right: int, n: int, segs=None) -> Array:
    """[bq, bk] bool: the pairs of a (query block, key block) tile the band allows, and,
    with ``segs`` = (query ids [bq], key ids [bk]), the same example and not padding."""
    qpos = q_first + jnp.arange(shape[0], dtype=jnp.int32)[:, None]
    kpos = k_first + jnp.arange(shape[1], dtype=jnp.int32)[None, :]
    d = qpos - kpos
    ok = (d <= left) & (d >= -right) & (kpos < n)
    if segs is not None:
        qs, ks = segs
        ok = ok & (qs[:, None] == ks[None, :]) & (ks[None, :] != 0)
    return ok


def _key_tile(q, q_first, j, k_ref, v_ref, ks_ref, qs, *, scale, left, right, n, bk):
    """Key block j against a query tile: (k, v, float32 scores, allowed pairs)."""
    start = pl.multiple_of(j * bk, bk)
    k = k_ref[pl.ds(start, bk), :]
    v = v_ref[pl.ds(start, bk), :]
    s = lower.dot(q, k.T) * scale
    segs = None if qs is None else (qs, ks_ref[pl.ds(start, bk)])
    return k, v, s, _allowed(q_first, start, s.shape, left, right, n, segs)


def _key_blocks(i, bq: int, bk: int, left: int, right: int, n: int):
    """[lo, hi): the key blocks query block i reaches."""
    first = i * bq
    lo = jnp.maximum(first - left, 0) // bk
    hi = jnp.minimum(first + bq - 1 + right, n - 1) // bk + 1
    return lo, hi


def _query_blocks(j, bq: int, bk: int, left: int, right: int, n: int):
    """[lo, hi): the query blocks that reach key block j."""
    first = j * bk
    lo = jnp.maximum(first - right, 0) // bq
    hi = jnp.minimum(first + bk - 1 + left, n - 1) // bq + 1
    return lo, hi


def _forward_kernel(*refs, scale, left, right, n, bk, segmented):
    if segmented:
        q_ref, k_ref, v_ref, qs_ref, ks_ref, o_ref, lse_ref = refs
    else:
        (q_ref, k_ref, v_ref, o_ref, lse_ref), qs_ref, ks_ref = refs, None, None
    i = pl.program_id(0)
    bq = q_ref.shape[0]
    q = q_ref[...]
    qs = None if qs_ref is None else qs_ref[...]

    tile = functools.partial(_key_tile, q, i * bq, k_ref=k_ref, v_ref=v_ref, ks_ref=ks_ref,
                             qs=qs, scale=scale, left=left, right=right, n=n, bk=bk)  # fmt: skip

    def body(j, carry):
        _, v, s, ok = tile(j)
        return softmax_step(carry, s, ok, v)

    lo, hi = _key_blocks(i, bq, bk, left, right, n)
    carry = lax.fori_loop(lo, hi, body, softmax_start(bq, v_ref.shape[-1]))
    softmax_write(carry, o_ref, lse_ref)  # padded query rows see no key: 0


def _dkdv_kernel(*refs, scale, left, right, n, bq, segmented):
    if segmented:
        q_ref, k_ref, v_ref, do_ref, lse_ref, delta_ref, qs_ref, ks_ref, dk_ref, dv_ref = refs
    else:
        (q_ref, k_ref, v_ref, do_ref, lse_ref, delta_ref, dk_ref, dv_ref), qs_ref = refs, None
    j = pl.program_id(0)
    bk = k_ref.shape[0]
    k, v = k_ref[...], v_ref[...]
    ks = None if qs_ref is None else ks_ref[...]

    def body(i, carry):
        dk, dv = carry
        start = pl.multiple_of(i * bq, bq)
        q = q_ref[pl.ds(start, bq), :]
        do = do_ref[pl.ds(start, bq), :]
        lse = lse_ref[pl.ds(start, bq)]
        delta = delta_ref[pl.ds(start, bq)]
        s = lower.dot(q, k.T) * scale
        segs = None if ks is None else (qs_ref[pl.ds(start, bq)], ks)
        ok = _allowed(start, j * bk, s.shape, left, right, n, segs)
        p, ds = score_grads(s, ok, lse, do, v, delta, scale, q.dtype)
        return dk + lower.dot(ds.T, q), dv + lower.dot(p.astype(do.dtype).T, do)

    lo, hi = _query_blocks(j, bq, bk, left, right, n)
    init = (
        jnp.zeros((bk, k_ref.shape[-1]), jnp.float32),
        jnp.zeros((bk, v_ref.shape[-1]), jnp.float32),
    )
    dk, dv = lax.fori_loop(lo, hi, body, init)
    dk_ref[...] = dk.astype(dk_ref.dtype)
    dv_ref[...] = dv.astype(dv_ref.dtype)


def _dq_kernel(*refs, scale, left, right, n, bk, segmented):
    if segmented:
        q_ref, k_ref, v_ref, do_ref, lse_ref, delta_ref, qs_ref, ks_ref, dq_ref = refs
    else:
        (q_ref, k_ref, v_ref, do_ref, lse_ref, delta_ref, dq_ref), qs_ref, ks_ref = (
            refs,
            None,
            None,
        )
    i = pl.program_id(0)
    bq = q_ref.shape[0]
    q, do = q_ref[...], do_ref[...]
    lse, delta = lse_ref[...], delta_ref[...]
    qs = None if qs_ref is None else qs_ref[...]

    tile = functools.partial(_key_tile, q, i * bq, k_ref=k_ref, v_ref=v_ref, ks_ref=ks_ref,
                             qs=qs, scale=scale, left=left, right=right, n=n, bk=bk)  # fmt: skip

    def body(j, dq):
        k, v, s, ok = tile(j)
        return dq + lower.dot(score_grads(s, ok, lse, do, v, delta, scale, k.dtype)[1], k)

    lo, hi = _key_blocks(i, bq, bk, left, right, n)
    dq = lax.fori_loop(lo, hi, body, jnp.zeros((bq, q_ref.shape[-1]), jnp.float32))
    dq_ref[...] = dq.astype(dq_ref.dtype)


@functools.partial(jax.custom_vjp, nondiff_argnums=(4, 5, 6, 7, 8, 9, 10))
def _band(q, k, v, segs, left, right, scale, n, bq, bk, interpret):
    return _band_fwd(q, k, v, segs, left, right, scale, n, bq, bk, interpret)[0]


def _band_fwd(q, k, v, segs, left, right, scale, n, bq, bk, interpret):
    kernel = functools.partial(
        _forward_kernel, scale=scale, left=left, right=right, n=n, bk=bk,
        segmented=segs is not None,
    )  # fmt: skip
    pair = None if segs is None else (segs, segs)
    out, lse = flash_forward(kernel, "band_attention", q, k, v, pair, bq, interpret)
    return out, (q, k, v, segs, out, lse)


def _band_bwd(left, right, scale, n, bq, bk, interpret, res, g):
    q, k, v, segs, out, lse = res
    delta = jnp.sum(out.astype(jnp.float32) * g.astype(jnp.float32), axis=-1)
    common = dict(scale=scale, left=left, right=right, n=n, segmented=segs is not None)
    kernels = (
        functools.partial(_dkdv_kernel, bq=bq, **common),
        functools.partial(_dq_kernel, bk=bk, **common),
    )
    pair = None if segs is None else (segs, segs)
    dq, dk, dv = flash_backward(
        kernels, "band_attention", q, k, v, pair, g.astype(q.dtype), lse, delta, (bq, bk),
        interpret,
    )  # fmt: skip
    return dq, dk, dv, None


_band.defvjp(_band_fwd, _band_bwd)


def band_attention(
    query: Array,
    key: Array,
    value: Array,
    *,
    left: int,
    right: int,
    scale: float | None = None,
    block_q: int = 64,
    block_k: int = 64,
    segments: Array | None = None,
    interpret: bool | None = None,
) -> Array:
    """``[b, n, h, d] x3 -> [b, n, h, dv]``: query i attends to keys j with
    ``-right <= i - j <= left`` (see the module docstring for the patterns this covers).

    Args:
      left, right: how far back and ahead a query sees (>= 0; ``n`` or more = no bound).
      scale: logit scale; default ``1/sqrt(d)``.
      block_q, block_k: tile sizes (powers of two, >= 16 for the tensor cores); the key
        blocks visited per query block are ``(left + right + block_q) / block_k + 1`` at most.
      segments: ``[b, n]`` int ids: a query sees keys of its own id only, and id 0 is
        padding (sees and is seen by nothing; its output is 0), as in the blocked
        kernel. None: one sequence per row.
      interpret: run through Pallas' interpreter; default: everywhere but on a GPU.

    A head size that is not a power of two of at least 16 (Triton's tiles) is padded
    with zeros, which changes no score; the output drops the padding.
    """
    if left < 0 or right < 0:
        raise ValueError(f"band_attention: left={left}, right={right} must be >= 0")
    q, k, v, segs, scale, interpret, unpad = flash_inputs(
        "band_attention", query, key, value, segments, block_q, block_k, scale, interpret
    )
    n = query.shape[1]
    left, right = min(left, n), min(right, n)
    return unpad(_band(q, k, v, segs, left, right, scale, n, block_q, block_k, interpret))


def band_of(pattern) -> tuple[int, int]:
    """(left, right) of a Local pattern (causal or not) or of Full (causal or not), for
    :func:`band_attention`; a ValueError naming the pattern for anything else."""
    name = type(pattern).__name__
    big = 1 << 30
    if name == "Local":
        return pattern.window, 0 if pattern.is_causal else pattern.window
    if name == "Full":
        return big, 0 if pattern.is_causal else big
    raise ValueError(
        f"band_attention computes bands (local windows and dense), not {pattern!r}; "
        "use the blocked kernel (flaxformer_lite.sparse.ops.block_sparse.xla) for other patterns"
    )
