"""The routed partial softmax key block by key block, for XLA (CPU): each key block
meets the queries that chose it in dense chunks, so the work is matrix products of the
routing's pairs, not a gather of every query's blocks.

:mod:`~flaxformer_lite.sparse.routed_kernel` gathers, for each query, the ``k - 1``
blocks it chose: ``n * (k - 1) * B`` key rows copied and contracted one query at a
time (matrix-vector products, bound by memory). This kernel turns the loop around, as
:mod:`~flaxformer_lite.sparse.routed_gather_gpu` does on a GPU: the routing becomes a
list of *entries* (query, slot; the own block is the last slot) sorted by the key block
they read (:func:`~flaxformer_lite.sparse.routed_gather_gpu.entries`), cut into chunks
of ``chunk`` entries that each belong to one block (a block's last chunk is partly
empty; ``n * k / chunk + n / B`` chunks at most), and each chunk is one ``[chunk, d] x
[d, B]`` product against its block, ``group`` chunks a step. Each entry gets its own
partial softmax; a query's are merged by their maxima into the same ``(m, l, o)`` as
:func:`~flaxformer_lite.sparse.routed_kernel.routed_partial` (same arguments), and the
backward pass recomputes each chunk's probabilities from the merged maxima:

    dS = p * (dl + dO V^T),   dQ += dS K,   dK += dS^T Q,   dV += p^T dO

with dQ scatter-added to the chunk's queries and dK/dV to its block. Memory is the
entries' partials (``n * k`` rows, linear in ``n``), never ``n x n``.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import Array, lax

from flaxformer_lite.sparse.online_softmax import FLOOR, NEG
from flaxformer_lite.sparse.routed_gather_gpu import entries


def _chunks(blocks: Array, nb: int, chunk: int, group: int):
    """The chunk table of ``blocks [bh, N, S]`` (key block per query slot, -1 empty):
    per chunk its block ``[bh, T]``, and per lane its entry id, query and liveness
    ``[bh, T, chunk]``; ``T`` (a multiple of ``group``) bounds every row's chunks."""
    bh, N, S = blocks.shape
    E = N * S
    order, offsets = entries(blocks, nb)
    counts = offsets[:, 1:] - offsets[:, :-1]  # [bh, nb]
    per = -(-counts // chunk)
    first = jnp.cumsum(per, axis=-1) - per  # each block's first chunk
    T = -(-(E // chunk + nb) // group) * group
    t = jnp.arange(T, dtype=jnp.int32)
    j = jax.vmap(lambda f: jnp.searchsorted(f, t, side="right") - 1)(first).astype(jnp.int32)
    u = t[None] - jnp.take_along_axis(first, j, axis=1)  # the chunk's index in its block
    within = u[..., None] * chunk + jnp.arange(chunk, dtype=jnp.int32)  # [bh, T, C]
    live = within < jnp.take_along_axis(counts, j, axis=1)[..., None]
    pos = jnp.take_along_axis(offsets, j, axis=1)[..., None] + within
    e = jnp.take_along_axis(order, jnp.minimum(pos, E - 1).reshape(bh, -1), axis=1)
    e = e.reshape(bh, T, chunk)
    return j, jnp.where(live, e, E), jnp.where(live, e // S, 0), live


class _Step:
    """Step ``i``'s ``group`` chunks: their queries, key block, scores and the kept pairs."""

    def __init__(self, q, kb, vb, tables, statics, i):
        j, e, qi, live, seg, _ = tables
        B, n, causal, g = statics
        rows = jnp.arange(q.shape[0])[:, None, None]
        self.j = lax.dynamic_slice_in_dim(j, i * g, g, 1)  # [bh, G]
        self.qi = lax.dynamic_slice_in_dim(qi, i * g, g, 1)  # [bh, G, C]
        self.e = lax.dynamic_slice_in_dim(e, i * g, g, 1)
        live = lax.dynamic_slice_in_dim(live, i * g, g, 1)
        self.q = q[rows, self.qi]  # [bh, G, C, d]
        self.k = kb[rows[..., 0], self.j]  # [bh, G, B, d]
        self.v = vb[rows[..., 0], self.j]
        kpos = self.j[..., None] * B + jnp.arange(B)  # [bh, G, B]
        ok = live[..., None] & (kpos[:, :, None, :] < n)
        if causal:
            ok = ok & (kpos[:, :, None, :] <= self.qi[..., None])
        if seg is not None:
            sq = seg[rows, self.qi][..., None]
            sk = seg[rows, kpos][:, :, None, :]
            ok = ok & (sq == sk) & (sk != 0)
        self.ok = ok
        self.scores = jnp.einsum("rgcd,rgkd->rgck", self.q, self.k)


def _forward(q, kb, vb, tables, statics, slots):
    bh, N, _ = q.shape
    g, E = statics[3], N * slots
    dv = vb.shape[-1]
    rows = jnp.arange(bh)[:, None, None]

    def body(i, carry):
        pm, pl, po = carry
        st = _Step(q, kb, vb, tables, statics, i)
        s = jnp.where(st.ok, st.scores, NEG)
        m = jnp.maximum(jnp.max(s, axis=-1), FLOOR)
        p = jnp.where(st.ok, jnp.exp(s - m[..., None]), 0.0)
        pm = pm.at[rows, st.e].set(m)  # lanes past a block's entries write slot E
        pl = pl.at[rows, st.e].set(p.sum(-1))
        po = po.at[rows, st.e].set(jnp.einsum("rgck,rgkv->rgcv", p, st.v))
        return pm, pl, po

    init = (
        jnp.full((bh, E + 1), FLOOR, q.dtype),
        jnp.zeros((bh, E + 1), q.dtype),
        jnp.zeros((bh, E + 1, dv), q.dtype),
    )
    pm, pl, po = lax.fori_loop(0, tables[0].shape[1] // g, body, init)
    valid = tables[5]
    pm = jnp.where(valid, pm[:, :E].reshape(bh, N, slots), FLOOR)
    m = jnp.max(pm, axis=-1)
    w = jnp.where(valid, jnp.exp(pm - m[..., None]), 0.0)
    l = jnp.sum(w * pl[:, :E].reshape(bh, N, slots), axis=-1)
    o = jnp.einsum("rns,rnsv->rnv", w, po[:, :E].reshape(bh, N, slots, dv))
    return m, l, o


@functools.partial(jax.custom_vjp, nondiff_argnums=(4, 5))
def _partial(q, kb, vb, tables, statics, slots):
    return _forward(q, kb, vb, tables, statics, slots)


def _fwd(q, kb, vb, tables, statics, slots):
    m, l, o = _forward(q, kb, vb, tables, statics, slots)
    return (m, l, o), (q, kb, vb, tables, m)


def _bwd(statics, slots, residuals, cotangents):
    q, kb, vb, tables, m = residuals
    _, dl, do = cotangents  # o / l does not depend on m
    rows = jnp.arange(q.shape[0])[:, None, None]

    def body(i, carry):
        dq, dkb, dvb = carry
        st = _Step(q, kb, vb, tables, statics, i)
        p = jnp.where(st.ok, jnp.exp(st.scores - m[rows, st.qi][..., None]), 0.0)
        do_c = do[rows, st.qi]  # [bh, G, C, dv]
        dp = jnp.einsum("rgcv,rgkv->rgck", do_c, st.v)
        ds = p * (dl[rows, st.qi][..., None] + dp)
        dq = dq.at[rows, st.qi].add(jnp.einsum("rgck,rgkd->rgcd", ds, st.k))
        dkb = dkb.at[rows[..., 0], st.j].add(jnp.einsum("rgck,rgcd->rgkd", ds, st.q))
        dvb = dvb.at[rows[..., 0], st.j].add(jnp.einsum("rgck,rgcv->rgkv", p, do_c))
        return dq, dkb, dvb

    init = (jnp.zeros_like(q), jnp.zeros_like(kb), jnp.zeros_like(vb))
    dq, dkb, dvb = lax.fori_loop(0, tables[0].shape[1] // statics[3], body, init)
    return dq, dkb, dvb, None


_partial.defvjp(_fwd, _bwd)


def routed_chunks_partial(
    q: Array,
    k: Array,
    v: Array,
    table: Array,
    valid: Array,
    block: int,
    n: int,
    causal: bool,
    segments: Array | None = None,
    chunk: int = 64,
    group: int = 8,
) -> tuple[Array, Array, Array]:
    """``(m, l [b, h, N], o [b, h, N, dv])``: the same partial softmax as
    :func:`~flaxformer_lite.sparse.routed_kernel.routed_partial` (scaled queries, own
    block plus ``table [b, h, N, R]`` where ``valid``), key block by key block over
    chunks of ``chunk`` entries, ``group`` chunks a step."""
    b, h, N, d = q.shape
    nb, bh = N // block, b * h
    own = jnp.broadcast_to((jnp.arange(N, dtype=jnp.int32) // block)[:, None], (bh, N, 1))
    chosen = jnp.where(valid, table, -1).astype(jnp.int32).reshape(bh, N, -1)
    blocks = lax.stop_gradient(jnp.concatenate([chosen, own], axis=-1))
    j, e, qi, live = _chunks(blocks, nb, chunk, group)
    seg = None if segments is None else jnp.repeat(segments, h, axis=0)
    tables = (j, e, qi, live, seg, blocks >= 0)
    kb = k.reshape(bh, nb, block, d)
    vb = v.reshape(bh, nb, block, -1)
    m, l, o = _partial(q.reshape(bh, N, d), kb, vb, tables, (block, n, causal, group),
                       blocks.shape[-1])  # fmt: skip
    return m.reshape(b, h, N), l.reshape(b, h, N), o.reshape(b, h, N, -1)
