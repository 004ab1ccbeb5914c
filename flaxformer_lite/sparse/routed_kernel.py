"""The partial softmax of query blocks against key blocks chosen per batch row and head
(a traced table), with a recomputing backward pass: the kernel of dynamic block-sparse
attention (:mod:`~flaxformer_lite.sparse.routed`).

Query block ``a`` of row ``r`` and head ``h`` reads the key blocks ``table[r, h, a]``
(slots with ``valid`` False are read and masked). :func:`routed_partial` walks
``group`` query blocks at a time (``lax.fori_loop``) and gathers only that group's key
and value blocks, so memory is one group's ``g * K * B`` scores and keys, never
``n * K * B``, let alone ``n x n``. Inside a read block the exact rule masks the
entries: positions past ``n``, keys after the query where causal, other segments and
padding (segment id 0). The backward pass recomputes ``p = exp(s - m)`` from the saved
row maxima, as :mod:`~flaxformer_lite.sparse.block_kernel` does for a static table:

    dp = dl + dO V^T,   dS = p * dp,   dQ = dS K,   dK = dS^T Q,   dV = p^T dO

and adds each group's ``dK``/``dV`` back into the blocks it gathered (a scatter-add;
a block chosen by several query blocks gets each one's share). The table carries no
gradient: which blocks were chosen is not differentiable, the scores inside them are.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import Array, lax

from flaxformer_lite.sparse.online_softmax import FLOOR, NEG, segment_mask


def routed_partial(
    q: Array,
    k: Array,
    v: Array,
    table: Array,
    valid: Array,
    block: int,
    n: int,
    causal: bool,
    segments: Array | None = None,
    group: int = 8,
) -> tuple[Array, Array, Array]:
    """``(m, l [b, h, N], o [b, h, N, dv])`` of scaled queries against their chosen blocks.

    Args:
      q, k, v: ``[b, h, N, d]``, ``N`` a multiple of ``block`` (padded), ``n <= N`` real.
      table, valid: ``[b, h, nb, K]`` int32 key blocks of each query block, and which
        slots hold one.
      causal: mask keys after their query inside the read blocks.
      segments: ``[b, N]`` segment ids (0 = padding), or None.
      group: query blocks per step (the largest divisor of ``nb`` not above it).
    """
    nb = q.shape[2] // block
    g = max(x for x in range(1, min(group, nb) + 1) if nb % x == 0)
    aux = {"table": table.astype(jnp.int32), "valid": valid}
    if segments is not None:
        aux["seg"] = segments
    return _partial(q, k, v, aux, (block, n, causal, g))


def _blocks(x: Array, block: int) -> Array:
    b, h, N, e = x.shape
    return x.reshape(b, h, N // block, block, e)


def _gather(xb: Array, tbl: Array) -> Array:
    """``xb [b, h, nb, B, e]`` at ``tbl [b, h, g, K]`` -> ``[b, h, g, K * B, e]``."""
    b, h, g, K = tbl.shape
    picked = jnp.take_along_axis(xb, tbl.reshape(b, h, g * K)[..., None, None], axis=2)
    return picked.reshape(b, h, g, K * xb.shape[3], xb.shape[4])


class _Group:
    """What step ``i`` reads: the group's queries, chosen keys/values and kept pairs."""

    def __init__(self, q, kb, vb, aux, statics, i):
        B, n, causal, g = statics
        b, h, _, d = q.shape
        self.q = lax.dynamic_slice_in_dim(q, i * g * B, g * B, 2).reshape(b, h, g, B, d)
        self.tbl = lax.dynamic_slice_in_dim(aux["table"], i * g, g, 2)  # [b, h, g, K]
        ok = lax.dynamic_slice_in_dim(aux["valid"], i * g, g, 2)
        self.k, self.v = _gather(kb, self.tbl), _gather(vb, self.tbl)
        K = self.tbl.shape[-1]
        qi = ((i * g + jnp.arange(g))[:, None] * B + jnp.arange(B))[:, :, None]  # [g, B, 1]
        kj = (self.tbl[..., None] * B + jnp.arange(B)).reshape(b, h, g, 1, K * B)
        keep = jnp.repeat(ok, B, axis=-1)[:, :, :, None, :] & (kj < n) & (qi < n)
        if causal:
            keep = keep & (kj <= qi)
        if "seg" in aux:
            sq = lax.dynamic_slice_in_dim(aux["seg"], i * g * B, g * B, 1).reshape(b, g, B)
            sk = aux["seg"][jnp.arange(b)[:, None, None, None], kj[..., 0, :]]  # [b, h, g, KB]
            keep = keep & segment_mask(sq[:, None, :, :, None], sk[:, :, :, None, :])
        s = jnp.einsum("bhxqd,bhxkd->bhxqk", self.q, self.k)
        self.scores = jnp.where(keep, s, NEG)


def _forward(q, k, v, aux, statics):
    B, _, _, g = statics
    kb, vb = _blocks(k, B), _blocks(v, B)

    def body(i, carry):
        m_all, l_all, o_all = carry
        b, h = q.shape[:2]
        grp = _Group(q, kb, vb, aux, statics, i)
        m = jnp.maximum(jnp.max(grp.scores, axis=-1), FLOOR)
        p = jnp.exp(grp.scores - m[..., None])
        o = jnp.einsum("bhxqk,bhxkv->bhxqv", p, grp.v)
        start = i * g * B
        m_all = lax.dynamic_update_slice_in_dim(m_all, m.reshape(b, h, g * B), start, 2)
        l_all = lax.dynamic_update_slice_in_dim(l_all, p.sum(-1).reshape(b, h, g * B), start, 2)
        o_all = lax.dynamic_update_slice_in_dim(o_all, o.reshape(b, h, g * B, -1), start, 2)
        return m_all, l_all, o_all

    init = (
        jnp.zeros(q.shape[:3], q.dtype),
        jnp.zeros(q.shape[:3], q.dtype),
        jnp.zeros((*q.shape[:3], v.shape[-1]), v.dtype),
    )
    return lax.fori_loop(0, q.shape[2] // (g * B), body, init)


@functools.partial(jax.custom_vjp, nondiff_argnums=(4,))
def _partial(q, k, v, aux, statics):
    return _forward(q, k, v, aux, statics)


def _fwd(q, k, v, aux, statics):
    m, l, o = _forward(q, k, v, aux, statics)
    return (m, l, o), (q, k, v, aux, m)


def _bwd(statics, residuals, cotangents):
    q, k, v, aux, m = residuals
    _, dl, do = cotangents  # m's cotangent is dropped: o / l does not depend on m
    B, _, _, g = statics
    kb, vb = _blocks(k, B), _blocks(v, B)
    b, h, N, d = q.shape
    rows = jnp.arange(b)[:, None, None, None]
    heads = jnp.arange(h)[None, :, None, None]

    def body(i, carry):
        dq, dkb, dvb = carry
        grp = _Group(q, kb, vb, aux, statics, i)
        start = i * g * B
        m_g = lax.dynamic_slice_in_dim(m, start, g * B, 2).reshape(b, h, g, B)
        dl_g = lax.dynamic_slice_in_dim(dl, start, g * B, 2).reshape(b, h, g, B)
        do_g = lax.dynamic_slice_in_dim(do, start, g * B, 2).reshape(b, h, g, B, -1)
        p = jnp.exp(grp.scores - m_g[..., None])
        ds = p * (dl_g[..., None] + jnp.einsum("bhxqv,bhxkv->bhxqk", do_g, grp.v))
        dq_g = jnp.einsum("bhxqk,bhxkd->bhxqd", ds, grp.k).reshape(b, h, g * B, d)
        dq = lax.dynamic_update_slice_in_dim(dq, dq_g, start, 2)
        K = grp.tbl.shape[-1]
        dk_g = jnp.einsum("bhxqk,bhxqd->bhxkd", ds, grp.q).reshape(b, h, g, K, B, d)
        dv_g = jnp.einsum("bhxqk,bhxqv->bhxkv", p, do_g).reshape(b, h, g, K, B, -1)
        dkb = dkb.at[rows, heads, grp.tbl].add(dk_g)
        dvb = dvb.at[rows, heads, grp.tbl].add(dv_g)
        return dq, dkb, dvb

    init = (jnp.zeros_like(q), jnp.zeros_like(kb), jnp.zeros_like(vb))
    dq, dkb, dvb = lax.fori_loop(0, N // (g * B), body, init)
    return dq, dkb.reshape(k.shape), dvb.reshape(v.shape), None


_partial.defvjp(_fwd, _bwd)
