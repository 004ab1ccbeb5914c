"""The block part's partial softmax, a group of query blocks at a time, with a
recomputing backward pass (FlashAttention's, for a block-sparse table).

Query block ``a`` attends the key blocks ``a + o`` for the band offsets ``o`` (the
full diagonals of the block mask: local windows, BigBird's window) and the blocks
its row of ``rest`` lists (random blocks). :func:`block_partial` walks ``group``
query blocks at a time (``lax.fori_loop``) and reads each group's keys straight
from ``k``/``v`` (``[b, h, n, d]``): the band as one contiguous slice, the rest
with a small gather. Nothing of size ``n * S * B`` is built, and only one group's
scores and probabilities are alive, in cache. The backward pass recomputes
``p = exp(s - m)`` from the saved row maxima:

    dp = dl + dO V^T,   dS = p * dp,   dQ = dS K,   dK = dS^T Q,   dV = p^T dO

adding each group's ``dK``/``dV`` into the slice it read. ``m`` carries no
gradient (as in ``partial_softmax``): the merged output ``o / l`` does not depend
on it. Autodiff of the plain formulation materialized the read key blocks (3x
``k`` for a 3-block window), moved them between layouts, and kept the
``[b, h, nb, B, S*B]`` scores alive between the passes; on CPU those memory-bound
copies, not the matmuls, were most of a blocked kernel's time.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax import Array, lax

from flaxformer_lite.sparse.ops.online_softmax import FLOOR, NEG, segment_mask


def block_partial(
    q: Array,
    k: Array,
    v: Array,
    block: int,
    offsets: list[int],
    rest: np.ndarray,
    mask: np.ndarray,
    seg_q: Array | None = None,
    seg_k: Array | None = None,
    group: int = 8,
    split: int = 2,
) -> tuple[Array, Array, Array]:
    """``(m, l [b, h, n], o [b, h, n, dv])`` of scaled queries against their key blocks.

    Args:
      q, k, v: ``[b, h, n, d]`` with ``n`` a multiple of ``block``.
      offsets: band offsets (query block ``a`` reads key block ``a + o``).
      rest: ``[nb, R]`` int key blocks read by gather (R may be 0).
      mask: ``[nb, block, K]`` bool, ``K = (len(offsets) + R) * block``: the pattern's
        pairs in the order the keys are read (bands by offset, then ``rest``).
      seg_q, seg_k: ``[b, n]`` segment ids, or None.
      group: query blocks per step (the largest divisor of ``nb`` not above it).
    """
    nb = q.shape[2] // block
    g = max(x for x in range(1, min(group, nb) + 1) if nb % x == 0)
    split = max(x for x in range(1, min(split, q.shape[1]) + 1) if q.shape[1] % x == 0)
    statics = (block, tuple(offsets), g, split)
    aux = {"mask": jnp.asarray(mask), "rest": jnp.asarray(rest, jnp.int32)}
    if seg_q is not None:
        aux["seg_q"], aux["seg_k"] = seg_q, seg_k
    return _partial(q, k, v, aux, statics)


def _reach(offsets) -> tuple[int, int]:
    """(lo <= 0, hi >= 0): the band reads blocks ``a + lo .. a + hi`` around block ``a``."""
    return (min(*offsets, 0), max(*offsets, 0)) if offsets else (0, 0)


def _pad(x: Array, statics, axis: int = 2) -> Array:
    """``x`` with ``-lo`` blocks of zeros before and ``hi`` after (band reads at the edges)."""
    B, offsets = statics[:2]
    lo, hi = _reach(offsets)
    if not (lo or hi):
        return x
    widths = [(0, 0)] * x.ndim
    widths[axis] = (-lo * B, hi * B)
    return jnp.pad(x, widths)


def _read(x: Array, x_padded: Array, aux, statics, i) -> Array:
    """Keys (or values) of query-block group ``i``: ``[b, h, g, K, e]``; ``x_padded`` is
    ``_pad(x)`` (made once, outside the loop)."""
    B, offsets, g = statics[:3]
    b, h, n, e = x.shape
    lo, hi = _reach(offsets)
    parts = []
    if offsets:
        # Blocks i*g + lo .. i*g + g - 1 + hi, those outside the sequence zero (masked).
        span = lax.dynamic_slice_in_dim(x_padded, i * g * B, (g + hi - lo) * B, 2)
        band = [
            span[:, :, (o - lo) * B : (o - lo + g) * B].reshape(b, h, g, 1, B, e) for o in offsets
        ]
        parts.append(jnp.concatenate(band, 3) if len(band) > 1 else band[0])
    if aux["rest"].shape[1]:
        tbl = lax.dynamic_slice_in_dim(aux["rest"], i * g, g, 0)  # [g, R]
        parts.append(x.reshape(b, h, n // B, B, e)[:, :, tbl])  # [b, h, g, R, B, e]
    blocks = jnp.concatenate(parts, 3) if len(parts) > 1 else parts[0]
    return blocks.reshape(b, h, g, -1, e)


class _Group:
    """What one step reads: the group's queries, keys, values and kept pairs."""

    def __init__(self, q, k, v, kp, vp, aux, statics, i):
        B, _, g = statics[:3]
        b, h, _, d = q.shape
        self.q = lax.dynamic_slice_in_dim(q, i * g * B, g * B, 2).reshape(b, h, g, B, d)
        self.k = _read(k, kp, aux, statics, i)
        self.v = _read(v, vp, aux, statics, i)
        keep = lax.dynamic_slice_in_dim(aux["mask"], i * g, g, 0)[None, None]
        if "seg_q" in aux:
            sq = lax.dynamic_slice_in_dim(aux["seg_q"], i * g * B, g * B, 1)
            sq = sq.reshape(b, g, B)
            seg_k = aux["seg_k"][:, None, :, None]
            sk = _read(seg_k, aux["seg_k_padded"], aux, statics, i)[:, 0, :, :, 0]  # [b, g, K]
            keep = keep & segment_mask(sq[..., None], sk[:, :, None, :])[:, None]
        s = jnp.einsum("bhxqd,bhxkd->bhxqk", self.q, self.k)
        self.scores = jnp.where(keep, s, NEG)


def _padded(k, v, aux, statics):
    if "seg_k" in aux:
        aux = dict(aux, seg_k_padded=_pad(aux["seg_k"][:, None, :, None], statics))
    return _pad(k, statics), _pad(v, statics), aux


def _heads(statics, *arrays):
    """Each array cut into ``split`` head groups: independent chains inside one loop
    body, which XLA:CPU runs on different cores at once (one chain of small matmuls
    would keep one core busy)."""
    split = statics[3]
    h = arrays[0].shape[1]
    w = h // split
    return [tuple(x[:, c * w : (c + 1) * w] for x in arrays) for c in range(split)]


def _forward(q, k, v, aux, statics):
    B, _, g = statics[:3]
    kp, vp, aux = _padded(k, v, aux, statics)
    chunks = _heads(statics, q, k, v, kp, vp)

    def step(i, chunk, carry):
        q, k, v, kp, vp = chunk
        m_all, l_all, o_all = carry
        b, h = q.shape[:2]
        grp = _Group(q, k, v, kp, vp, aux, statics, i)
        m = jnp.maximum(jnp.max(grp.scores, axis=-1), FLOOR)
        p = jnp.exp(grp.scores - m[..., None])
        o = jnp.einsum("bhxqk,bhxkv->bhxqv", p, grp.v)
        start = i * g * B
        m_all = lax.dynamic_update_slice_in_dim(m_all, m.reshape(b, h, g * B), start, 2)
        l_all = lax.dynamic_update_slice_in_dim(l_all, p.sum(-1).reshape(b, h, g * B), start, 2)
        o_all = lax.dynamic_update_slice_in_dim(o_all, o.reshape(b, h, g * B, -1), start, 2)
        return m_all, l_all, o_all

    def body(i, carries):
        return tuple(step(i, c, carry) for c, carry in zip(chunks, carries, strict=True))

    init = tuple(
        (
            jnp.zeros(q.shape[:3], q.dtype),
            jnp.zeros(q.shape[:3], q.dtype),
            jnp.zeros((*q.shape[:3], v.shape[-1]), v.dtype),
        )
        for q, _, v, _, _ in chunks
    )
    out = lax.fori_loop(0, q.shape[2] // (g * B), body, init)
    return tuple(jnp.concatenate(parts, axis=1) for parts in zip(*out, strict=True))


@functools.partial(jax.custom_vjp, nondiff_argnums=(4,))
def _partial(q, k, v, aux, statics):
    return _forward(q, k, v, aux, statics)


def _fwd(q, k, v, aux, statics):
    m, l, o = _forward(q, k, v, aux, statics)
    return (m, l, o), (q, k, v, aux, m)


def _scatter(d_blocks: Array, band: Array, rest: Array | None, aux, statics, i):
    """Adds group ``i``'s ``[b, h, g, K, e]`` gradient where :func:`_read` read it: the
    band part into ``band`` (padded coordinates), the gathered part into ``rest``
    (``[b, h, nb, B, e]``)."""
    B, offsets, g = statics[:3]
    b, h = band.shape[:2]
    e = d_blocks.shape[-1]
    lo, hi = _reach(offsets)
    d_blocks = d_blocks.reshape(b, h, g, -1, B, e)
    if offsets:
        span = lax.dynamic_slice_in_dim(band, i * g * B, (g + hi - lo) * B, 2)
        for slot, o in enumerate(offsets):
            piece = d_blocks[:, :, :, slot].reshape(b, h, g * B, e)
            span = span.at[:, :, (o - lo) * B : (o - lo + g) * B].add(piece)
        band = lax.dynamic_update_slice_in_dim(band, span, i * g * B, 2)
    if rest is not None:
        tbl = lax.dynamic_slice_in_dim(aux["rest"], i * g, g, 0)
        rest = rest.at[:, :, tbl].add(d_blocks[:, :, :, len(offsets) :])
    return band, rest


def _bwd(statics, residuals, cotangents):
    q, k, v, aux, m = residuals
    _, dl, do = cotangents  # m's cotangent is dropped: o / l does not depend on m
    B, offsets, g = statics[:3]
    n = q.shape[2]
    lo, _ = _reach(offsets)
    kp, vp, aux = _padded(k, v, aux, statics)
    has_rest = aux["rest"].shape[1] > 0
    chunks = _heads(statics, q, k, v, kp, vp, m, dl, do)

    def step(i, chunk, carry):
        q, k, v, kp, vp, m, dl, do = chunk
        dq, dk_band, dv_band, dk_rest, dv_rest = carry
        b, h, _, d = q.shape
        grp = _Group(q, k, v, kp, vp, aux, statics, i)
        start = i * g * B
        m_g = lax.dynamic_slice_in_dim(m, start, g * B, 2).reshape(b, h, g, B)
        dl_g = lax.dynamic_slice_in_dim(dl, start, g * B, 2).reshape(b, h, g, B)
        do_g = lax.dynamic_slice_in_dim(do, start, g * B, 2).reshape(b, h, g, B, -1)
        p = jnp.exp(grp.scores - m_g[..., None])
        ds = p * (dl_g[..., None] + jnp.einsum("bhxqv,bhxkv->bhxqk", do_g, grp.v))
        dq_g = jnp.einsum("bhxqk,bhxkd->bhxqd", ds, grp.k).reshape(b, h, g * B, d)
        dq = lax.dynamic_update_slice_in_dim(dq, dq_g, start, 2)
        dk_g = jnp.einsum("bhxqk,bhxqd->bhxkd", ds, grp.q)
        dv_g = jnp.einsum("bhxqk,bhxqv->bhxkv", p, do_g)
        dk_band, dk_rest = _scatter(dk_g, dk_band, dk_rest, aux, statics, i)
        dv_band, dv_rest = _scatter(dv_g, dv_band, dv_rest, aux, statics, i)
        return dq, dk_band, dv_band, dk_rest, dv_rest

    def body(i, carries):
        return tuple(step(i, c, carry) for c, carry in zip(chunks, carries, strict=True))

    def blocks_like(x):
        b, h = x.shape[:2]
        return jnp.zeros((b, h, n // B, B, x.shape[-1]), x.dtype) if has_rest else None

    init = tuple(
        (jnp.zeros_like(q), jnp.zeros_like(kp), jnp.zeros_like(vp), blocks_like(k), blocks_like(v))
        for q, k, v, kp, vp, *_ in chunks
    )
    out = lax.fori_loop(0, n // (g * B), body, init)
    dq, dk_band, dv_band, dk_rest, dv_rest = (
        None if parts[0] is None else jnp.concatenate(parts, axis=1)
        for parts in zip(*out, strict=True)
    )
    dk, dv = dk_band[:, :, -lo * B : -lo * B + n], dv_band[:, :, -lo * B : -lo * B + n]
    if has_rest:
        dk = dk + dk_rest.reshape(dk.shape)
        dv = dv + dv_rest.reshape(dv.shape)
    return dq, dk, dv, None


_partial.defvjp(_fwd, _bwd)


def block_table(block_mask: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """``[nb, nb]`` bool -> (key-block indices ``[nb, S]``, valid ``[nb, S]``), S = max row sum."""
    counts = block_mask.sum(axis=1)
    slots = max(int(counts.max()) if counts.size else 0, 1)
    table = np.zeros((block_mask.shape[0], slots), np.int32)
    valid = np.zeros((block_mask.shape[0], slots), bool)
    for a, row in enumerate(block_mask):
        idx = np.flatnonzero(row)
        table[a, : len(idx)] = idx
        valid[a, : len(idx)] = True
    return table, valid


def block_diagonals(block_mask: np.ndarray, min_fill: float = 0.75) -> tuple[list[int], np.ndarray]:
    """Split a block mask into full-enough diagonals and the rest.

    Returns the offsets ``o`` whose diagonal (query block ``a`` -> key block
    ``a + o``) holds at least ``min_fill * nb`` blocks, and the mask
    of the blocks those diagonals leave. A band (local/sliding window, BigBird's
    window) becomes a few diagonals, which the kernel reads as shifted slices of
    the key blocks; only the rest (random blocks) needs a gather. Slices matter
    on CPU: a gather's gradient is a scatter-add, which XLA:CPU runs serially.
    """
    nb = block_mask.shape[0]
    offsets = []
    for o in range(-(nb - 1), nb):
        # A diagonal read as a slice costs nb blocks: worth it when most are used.
        if np.diagonal(block_mask, offset=o).sum() >= min_fill * nb:
            offsets.append(o)
    rest = block_mask.copy()
    rows = np.arange(nb)
    for o in offsets:
        inside = (rows + o >= 0) & (rows + o < nb)
        rest[rows[inside], rows[inside] + o] = False
    return offsets, rest
