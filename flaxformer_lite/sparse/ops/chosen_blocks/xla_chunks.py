"""The routed partial softmax key block by key block, for XLA (CPU): each key block
meets the queries that chose it in dense chunks, so the work is matrix products of the
routing's pairs, not a gather of every query's blocks.

:mod:`~flaxformer_lite.sparse.ops.chosen_blocks.xla_gather` gathers, for each query, the ``k - 1``
blocks it chose: ``n * (k - 1) * B`` key rows copied and contracted one query at a
time (matrix-vector products, bound by memory). This kernel turns the loop around, as
:mod:`~flaxformer_lite.sparse.ops.chosen_blocks.pallas_triton_gather` does on a GPU: the routing
becomes a
list of *entries* (query, slot; the own block is the last slot) sorted by the key block
they read (:func:`~flaxformer_lite.sparse.ops.chosen_blocks.pallas_triton_gather.entries`), cut
into chunks
of ``chunk`` entries that each belong to one block (a block's last chunk is partly
empty; ``n * k / chunk + n / B`` chunks at most), and each chunk is one ``[chunk, d] x
[d, B]`` product against its block, ``group`` chunks a step, the rows (batch x head)
in two independent chains that XLA:CPU runs on both cores. Each entry gets its own
partial softmax, stacked step by step in chunk order and read back by each entry's
lane; a query's are merged by their maxima into the same ``(m, l, o)`` as
:func:`~flaxformer_lite.sparse.ops.chosen_blocks.xla_gather.routed_partial` (same arguments), and
the
backward pass recomputes each chunk's probabilities from the merged maxima:

    dS = p * (dl + dO V^T),   dQ += dS K,   dK += dS^T Q,   dV += p^T dO

with dQ scatter-added to the chunk's queries and dK/dV to its block. Memory is the
entries' partials (``n * k`` rows, linear in ``n``), never ``n x n``.
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax import Array, lax

from flaxformer_lite.sparse.ops.chosen_blocks.pallas_triton_gather import entries
from flaxformer_lite.sparse.ops.online_softmax import FLOOR, NEG


class _Tables(NamedTuple):
    """The chunk table: per chunk its key block ``j [bh, T]``; per lane its query ``qi``
    and liveness ``live [bh, T, C]``; the packed rows' ``segments`` (or None); per
    query slot ``valid [bh, N, S]``; per entry its ``lane [bh, N * S]`` in chunk
    order (``chunk * t + c``)."""

    j: Array
    qi: Array
    live: Array
    segments: Array | None
    valid: Array
    lane: Array


def _chunks(blocks: Array, nb: int, chunk: int, group: int, segments: Array | None) -> _Tables:
    """The :class:`_Tables` of ``blocks [bh, N, S]`` (key block per query slot, -1
    empty); ``T`` (a multiple of ``group``) bounds every row's chunks."""
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
    qi = jnp.where(live, e.reshape(bh, T, chunk) // S, 0)
    # Each entry's lane: its block's first chunk, then its rank among the block's
    # entries. An empty slot (sorted last, in no chunk) reads lane 0, masked by valid.
    p = jnp.arange(E, dtype=jnp.int32)[None]
    flat = jnp.where(blocks >= 0, blocks, nb).reshape(bh, E)
    jp = jnp.minimum(jnp.take_along_axis(flat, order, axis=1), nb - 1)  # block at p
    rank = p - jnp.take_along_axis(offsets, jp, axis=1)
    lane = jnp.where(p < offsets[:, nb:], jnp.take_along_axis(first, jp, axis=1) * chunk + rank, 0)
    lane = jnp.zeros((bh, E), jnp.int32).at[jnp.arange(bh)[:, None], order].set(lane)
    return _Tables(j, qi, live, segments, blocks >= 0, lane)


class _Step:
    """Step ``i``'s ``group`` chunks of rows ``r0 .. r0 + w`` (batch x head): their
    queries, key block, scores and the kept pairs."""

    def __init__(self, q, kb, vb, tables: _Tables, statics, i, r0: int, w: int):
        B, n, causal, g = statics[:4]
        C = tables.qi.shape[2]
        self.rows = rows = (r0 + jnp.arange(w))[:, None, None]
        self.j = lax.dynamic_slice(tables.j, (r0, i * g), (w, g))  # [w, G]
        self.qi = lax.dynamic_slice(tables.qi, (r0, i * g, 0), (w, g, C))  # [w, G, C]
        live = lax.dynamic_slice(tables.live, (r0, i * g, 0), (w, g, C))
        self.q = q[rows, self.qi]  # [w, G, C, d]
        self.k = kb[rows[..., 0], self.j]  # [w, G, B, d]
        self.v = vb[rows[..., 0], self.j]
        kpos = self.j[..., None] * B + jnp.arange(B)  # [w, G, B]
        ok = live[..., None] & (kpos[:, :, None, :] < n)
        if causal:
            ok = ok & (kpos[:, :, None, :] <= self.qi[..., None])
        seg = tables.segments
        if seg is not None:
            sq = seg[rows, self.qi][..., None]
            sk = seg[rows, kpos][:, :, None, :]
            ok = ok & (sq == sk) & (sk != 0)
        self.ok = ok
        self.scores = jnp.einsum("rgcd,rgkd->rgck", self.q, self.k)


def _chains(bh: int, split: int) -> list[tuple[int, int]]:
    """The rows (batch x head) in ``split`` groups ``(first row, rows)``: independent
    chains inside one loop body, which XLA:CPU runs on different cores at once (one
    chain of small matmuls keeps one core busy, as in
    :mod:`~flaxformer_lite.sparse.ops.block_sparse.xla_blocks`). Each reads its rows of the inputs
    where it gathers them, so nothing is sliced."""
    w = bh // split
    return [(c * w, w) for c in range(split)]


def _forward(q, kb, vb, tables, statics, slots):
    g, split = statics[3], statics[4]
    N = q.shape[1]
    chains = _chains(q.shape[0], split)

    def one(i, r0, w):
        st = _Step(q, kb, vb, tables, statics, i, r0, w)
        s = jnp.where(st.ok, st.scores, NEG)
        m = jnp.maximum(jnp.max(s, axis=-1), FLOOR)
        p = jnp.where(st.ok, jnp.exp(s - m[..., None]), 0.0)
        return m, p.sum(-1), jnp.einsum("rgck,rgkv->rgcv", p, st.v)

    # Each step's partials come out stacked, in chunk order ([steps, w, g, C]), and
    # each entry reads its own back by its lane (one gather): no buffer of the entries
    # to fill first and scatter into every step.
    _, stacked = lax.scan(
        lambda _, i: (None, tuple(one(i, *chain) for chain in chains)),
        None,
        jnp.arange(tables.j.shape[1] // g),
    )
    out = []
    for (r0, w), (cm, cl, co) in zip(chains, stacked, strict=True):
        lanes = _at_lanes(tables.lane[r0 : r0 + w], g * tables.qi.shape[2])
        valid = tables.valid[r0 : r0 + w]
        pm = jnp.where(valid, lanes(cm).reshape(w, N, slots), FLOOR)
        m = jnp.max(pm, axis=-1)
        e = jnp.where(valid, jnp.exp(pm - m[..., None]), 0.0)
        l = jnp.sum(e * lanes(cl).reshape(w, N, slots), axis=-1)
        o = jnp.einsum("rns,rnsv->rnv", e, lanes(co).reshape(w, N, slots, -1))
        out.append((m, l, o))
    return tuple(jnp.concatenate(parts, axis=0) for parts in zip(*out, strict=True))


def _at_lanes(lane: Array, width: int):
    """A reader of stacked per-step chunk values ``[steps, bh, g, C, ...]`` at each
    entry's lane (``lane [bh, E]``, ``width = g * C`` lanes a step): ``[bh, E, ...]``."""
    rows = jnp.arange(lane.shape[0])[:, None]
    step, within = lane // width, lane % width

    def read(x):
        return x.reshape(x.shape[0], x.shape[1], width, *x.shape[4:])[step, rows, within]

    return read


@functools.partial(jax.custom_vjp, nondiff_argnums=(4, 5))
def _partial(q, kb, vb, tables, statics, slots):
    return _forward(q, kb, vb, tables, statics, slots)


def _fwd(q, kb, vb, tables, statics, slots):
    m, l, o = _forward(q, kb, vb, tables, statics, slots)
    return (m, l, o), (q, kb, vb, tables, m)


def _bwd(statics, slots, residuals, cotangents):
    q, kb, vb, tables, m = residuals
    _, dl, do = cotangents  # o / l does not depend on m
    chains = _chains(q.shape[0], statics[4])

    def one(i, r0, w, carry):
        dq, dkb, dvb = carry  # the chain's own rows
        st = _Step(q, kb, vb, tables, statics, i, r0, w)
        rows, local = st.rows, jnp.arange(w)[:, None, None]
        p = jnp.where(st.ok, jnp.exp(st.scores - m[rows, st.qi][..., None]), 0.0)
        do_c = do[rows, st.qi]  # [w, G, C, dv]
        dp = jnp.einsum("rgcv,rgkv->rgck", do_c, st.v)
        ds = p * (dl[rows, st.qi][..., None] + dp)
        dq = dq.at[local, st.qi].add(jnp.einsum("rgck,rgkd->rgcd", ds, st.k))
        dkb = dkb.at[local[..., 0], st.j].add(jnp.einsum("rgck,rgcd->rgkd", ds, st.q))
        dvb = dvb.at[local[..., 0], st.j].add(jnp.einsum("rgck,rgcv->rgkv", p, do_c))
        return dq, dkb, dvb

    init = tuple(
        (jnp.zeros((w, *q.shape[1:]), q.dtype), jnp.zeros((w, *kb.shape[1:]), kb.dtype),
         jnp.zeros((w, *vb.shape[1:]), vb.dtype))
        for _, w in chains
    )  # fmt: skip
    out = lax.fori_loop(
        0,
        tables.j.shape[1] // statics[3],
        lambda i, carries: tuple(one(i, *c, x) for c, x in zip(chains, carries, strict=True)),
        init,
    )
    dq, dkb, dvb = (jnp.concatenate(parts, axis=0) for parts in zip(*out, strict=True))
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
    split: int = 2,
) -> tuple[Array, Array, Array]:
    """``(m, l [b, h, N], o [b, h, N, dv])``: the same partial softmax as
    :func:`~flaxformer_lite.sparse.ops.chosen_blocks.xla_gather.routed_partial` (scaled queries, own
    block plus ``table [b, h, N, R]`` where ``valid``), key block by key block over
    chunks of ``chunk`` entries, ``group`` chunks a step, the rows (batch x head) in
    ``split`` independent chains (the most up to ``split`` that divide them evenly)."""
    b, h, N, d = q.shape
    nb, bh = N // block, b * h
    own = jnp.broadcast_to((jnp.arange(N, dtype=jnp.int32) // block)[:, None], (bh, N, 1))
    chosen = jnp.where(valid, table, -1).astype(jnp.int32).reshape(bh, N, -1)
    blocks = lax.stop_gradient(jnp.concatenate([chosen, own], axis=-1))
    seg = None if segments is None else jnp.repeat(segments, h, axis=0)
    tables = _chunks(blocks, nb, chunk, group, seg)
    kb = k.reshape(bh, nb, block, d)
    vb = v.reshape(bh, nb, block, -1)
    split = max(x for x in range(1, min(split, bh) + 1) if bh % x == 0)
    statics = (block, n, causal, group, split)
    m, l, o = _partial(q.reshape(bh, N, d), kb, vb, tables, statics, blocks.shape[-1])
    return m.reshape(b, h, N), l.reshape(b, h, N), o.reshape(b, h, N, -1)
