"""The partial softmax of each query against its own key block and the key blocks it
chose (a traced table per batch row, head and query), with a recomputing backward pass:
the kernel of dynamic block-sparse attention (:mod:`~flaxformer_lite.sparse.ops.moba.xla`).

Query ``t`` of row ``r`` and head ``h`` reads its own block (``t // B``, as a band: the
query block's keys in place) and the blocks ``table[r, h, t]`` (slots with ``valid``
False are read and masked). :func:`routed_partial` walks ``group`` query blocks at a
time (``lax.fori_loop``) and gathers only that group's chosen key and value blocks, so
memory is one group's ``g B x K B`` scores and keys, never ``n x n``. Inside every read
block the exact rule masks the entries: positions past ``n``, keys after the query
where causal, other segments and padding (segment id 0). The backward pass recomputes
``p = exp(s - m)`` from the saved row maxima, as
:mod:`~flaxformer_lite.sparse.ops.block_sparse.xla_blocks` does for a static table:

    dp = dl + dO V^T,   dS = p * dp,   dQ = dS K,   dK = dS^T Q,   dV = p^T dO

adding the own block's ``dK``/``dV`` into its slice and the chosen blocks' back where
they were gathered (a scatter-add: a block chosen by many queries gets each one's
share). The table carries no gradient: which blocks were chosen is not differentiable,
the scores inside them are.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import Array, lax

from flaxformer_lite.sparse.ops.online_softmax import FLOOR, NEG, segment_mask


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
    group: int = 2,
) -> tuple[Array, Array, Array]:
    """``(m, l [b, h, N], o [b, h, N, dv])`` of scaled queries against their blocks.

    Args:
      q, k, v: ``[b, h, N, d]``, ``N`` a multiple of ``block`` (padded), ``n <= N`` real.
      table, valid: ``[b, h, N, R]`` int32: the key blocks each query reads besides its
        own (R may be 0), and which slots hold one.
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


def _gather(xb: Array, tbl: Array) -> Array:
    """``xb [b, h, nb, B, e]`` at ``tbl [b, h, G, R]`` -> ``[b, h, G, R * B, e]``."""
    b, h, G, R = tbl.shape
    picked = jnp.take_along_axis(xb, tbl.reshape(b, h, G * R)[..., None, None], axis=2)
    return picked.reshape(b, h, G, R * xb.shape[3], xb.shape[4])


class _Group:
    """What step ``i`` reads: the group's queries, their own blocks' and their chosen
    blocks' keys/values, and the scores of the kept pairs (own block first)."""

    def __init__(self, q, k, v, aux, statics, i):
        B, n, causal, g = statics
        b, h, N, d = q.shape
        G, start = g * B, i * g * B
        self.q = lax.dynamic_slice_in_dim(q, start, G, 2)  # [b, h, G, d]
        self.k_own = lax.dynamic_slice_in_dim(k, start, G, 2).reshape(b, h, g, B, d)
        self.v_own = lax.dynamic_slice_in_dim(v, start, G, 2).reshape(b, h, g, B, -1)
        self.tbl = lax.dynamic_slice_in_dim(aux["table"], start, G, 2)  # [b, h, G, R]
        ok = lax.dynamic_slice_in_dim(aux["valid"], start, G, 2)
        R = self.tbl.shape[-1]
        self.k = _gather(k.reshape(b, h, N // B, B, d), self.tbl) if R else None
        self.v = _gather(v.reshape(b, h, N // B, B, -1), self.tbl) if R else None
        qi = start + jnp.arange(G)  # [G]
        kj_own = (qi // B * B)[:, None] + jnp.arange(B)  # [G, B]
        keep_own = (kj_own < n) & (qi[:, None] < n)
        if causal:
            keep_own = keep_own & (kj_own <= qi[:, None])
        keep_own = jnp.broadcast_to(keep_own, (b, h, G, B))
        kj = (self.tbl[..., None] * B + jnp.arange(B)).reshape(b, h, G, R * B)
        keep = jnp.repeat(ok, B, axis=-1) & (kj < n) & (qi[:, None] < n)
        if causal:
            keep = keep & (kj <= qi[:, None])
        if "seg" in aux:
            sq = lax.dynamic_slice_in_dim(aux["seg"], start, G, 1)[:, None, :, None]
            own = aux["seg"][:, kj_own][:, None]  # [b, 1, G, B]
            keep_own = keep_own & segment_mask(sq, own)
            keep = keep & segment_mask(sq, aux["seg"][jnp.arange(b)[:, None, None, None], kj])
        qb = self.q.reshape(b, h, g, B, d)
        s_own = jnp.einsum("bhxqd,bhxkd->bhxqk", qb, self.k_own).reshape(b, h, G, B)
        self.scores = jnp.where(keep_own, s_own, NEG)
        if R:
            s = jnp.einsum("bhqd,bhqkd->bhqk", self.q, self.k)
            self.scores = jnp.concatenate([self.scores, jnp.where(keep, s, NEG)], -1)

    def values(self, p: Array) -> Array:
        """``p [b, h, G, B + R B]`` (own block first) contracted with the values."""
        b, h, G, _ = p.shape
        g, B = self.v_own.shape[2:4]
        own = jnp.einsum("bhxqk,bhxkv->bhxqv", p[..., :B].reshape(b, h, g, B, B), self.v_own)
        out = own.reshape(b, h, G, -1)
        if self.v is not None:
            out = out + jnp.einsum("bhqk,bhqkv->bhqv", p[..., B:], self.v)
        return out


def _forward(q, k, v, aux, statics):
    B, _, _, g = statics
    G = g * B

    def body(i, carry):
        m_all, l_all, o_all = carry
        grp = _Group(q, k, v, aux, statics, i)
        m = jnp.maximum(jnp.max(grp.scores, axis=-1), FLOOR)
        p = jnp.exp(grp.scores - m[..., None])
        m_all = lax.dynamic_update_slice_in_dim(m_all, m, i * G, 2)
        l_all = lax.dynamic_update_slice_in_dim(l_all, p.sum(-1), i * G, 2)
        o_all = lax.dynamic_update_slice_in_dim(o_all, grp.values(p), i * G, 2)
        return m_all, l_all, o_all

    init = (
        jnp.zeros(q.shape[:3], q.dtype),
        jnp.zeros(q.shape[:3], q.dtype),
        jnp.zeros((*q.shape[:3], v.shape[-1]), v.dtype),
    )
    return lax.fori_loop(0, q.shape[2] // G, body, init)


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
    b, h, N, d = q.shape
    G = g * B
    rows = jnp.arange(b)[:, None, None, None]
    heads = jnp.arange(h)[None, :, None, None]

    def body(i, carry):
        dq, dk, dv, dkb, dvb = carry
        grp = _Group(q, k, v, aux, statics, i)
        start = i * G
        m_g = lax.dynamic_slice_in_dim(m, start, G, 2)
        dl_g = lax.dynamic_slice_in_dim(dl, start, G, 2)
        do_g = lax.dynamic_slice_in_dim(do, start, G, 2)  # [b, h, G, dv]
        p = jnp.exp(grp.scores - m_g[..., None])
        dp_own = jnp.einsum(
            "bhxqv,bhxkv->bhxqk", do_g.reshape(b, h, g, B, -1), grp.v_own
        ).reshape(b, h, G, B)  # fmt: skip
        dp = dp_own
        if grp.v is not None:
            dp = jnp.concatenate([dp_own, jnp.einsum("bhqv,bhqkv->bhqk", do_g, grp.v)], -1)
        ds = p * (dl_g[..., None] + dp)
        ds_own = ds[..., :B].reshape(b, h, g, B, B)
        p_own = p[..., :B].reshape(b, h, g, B, B)
        dq_g = jnp.einsum("bhxqk,bhxkd->bhxqd", ds_own, grp.k_own).reshape(b, h, G, d)
        dk_own = jnp.einsum("bhxqk,bhxqd->bhxkd", ds_own, grp.q.reshape(b, h, g, B, d))
        dv_own = jnp.einsum("bhxqk,bhxqv->bhxkv", p_own, do_g.reshape(b, h, g, B, -1))
        dk = lax.dynamic_update_slice_in_dim(dk, dk_own.reshape(b, h, G, d), start, 2)
        dv = lax.dynamic_update_slice_in_dim(dv, dv_own.reshape(b, h, G, -1), start, 2)
        if grp.k is not None:
            R = grp.tbl.shape[-1]
            dq_g = dq_g + jnp.einsum("bhqk,bhqkd->bhqd", ds[..., B:], grp.k)
            dk_r = jnp.einsum("bhqk,bhqd->bhqkd", ds[..., B:], grp.q)
            dv_r = jnp.einsum("bhqk,bhqv->bhqkv", p[..., B:], do_g)
            dkb = dkb.at[rows, heads, grp.tbl].add(dk_r.reshape(b, h, G, R, B, d))
            dvb = dvb.at[rows, heads, grp.tbl].add(dv_r.reshape(b, h, G, R, B, -1))
        dq = lax.dynamic_update_slice_in_dim(dq, dq_g, start, 2)
        return dq, dk, dv, dkb, dvb

    blocks = lambda x: jnp.zeros((b, h, N // B, B, x.shape[-1]), x.dtype)
    init = (jnp.zeros_like(q), jnp.zeros_like(k), jnp.zeros_like(v), blocks(k), blocks(v))
    dq, dk, dv, dkb, dvb = lax.fori_loop(0, N // G, body, init)
    return dq, dk + dkb.reshape(k.shape), dv + dvb.reshape(v.shape), None


_partial.defvjp(_fwd, _bwd)
