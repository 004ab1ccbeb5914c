"""Dynamic block-sparse attention for GPUs, key block by key block: each key block reads
the queries that chose it (gathered rows), so the work is exactly the routing's pairs.

Where each query chooses its own blocks (MoBA's per-query gate, NSA's selection), the
queries of one tile choose different blocks, and a kernel that walks query tiles
(:mod:`~flaxformer_lite.sparse.ops.chosen_blocks.pallas_triton_tiles`) visits the union of their
choices, up to
``tile * (k - 1) + 1`` blocks where each query needs ``k``. This one turns the loop
around, as MoBA's own implementation does with variable-length flash attention: the
routing becomes, per batch row and head, a list of *entries* (query, slot) sorted by
the key block they read (the ``k - 1`` chosen slots and the own block), and a program
per key block walks its entries ``block_q`` at a time, gathering those queries' rows
(Triton loads rows by index). Each entry gets its own partial softmax (row max, sum,
unnormalised output), scattered to its place; XLA merges a query's ``k`` partials by
their log-sum-exps. The backward pass is one kernel per key block too: it accumulates
the block's dK and dV over its entries, and writes each entry's share of dQ, summed
per query by XLA. Every entry is written by exactly one program, so there are no
atomics; memory is ``n * k`` partial rows (linear in ``n``), never ``n x n``.

Same rules as the tile kernel: causal inside the own block, keys past ``n`` and other
segments masked, empty slots (``valid`` False) read nothing, no gradient through the
choice. Layout ``[b*h, n, d]`` inside, head size padded to a power of two >= 16.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from flaxformer_lite.sparse.ops import triton_lowering as lower
from flaxformer_lite.sparse.ops.chosen_blocks.pallas_triton_tiles import chosen_blocks
from flaxformer_lite.sparse.ops.pallas_flash import NEG, flash_inputs, score_grads

Array = jax.Array
NAME = "routed_gather_attention"  # its kernels: NAME_forward, NAME_backward


KEY_LIMIT = 2**31 - 1  # the largest sort key entries() packs into one int32


def entries(blocks: Array, nb: int) -> tuple[Array, Array]:
    """``blocks [b*h, m, S]`` (the key block of each query's slot, -1 = empty) ->
    (entry ids ``i * S + slot`` sorted by block ``[b*h, m * S]``, offsets ``[b*h, nb +
    1]``: block j's entries are ``[offsets[j], offsets[j + 1])``; empty slots last)."""
    bh = blocks.shape[0]
    flat = jnp.where(blocks >= 0, blocks, nb).reshape(bh, -1)
    E = flat.shape[1]
    if (nb + 1) * E <= KEY_LIMIT:  # one int32 key, block * E + id: unique, so sorting it
        # is the stable argsort at a fraction of its cost (XLA:CPU sorts key-value
        # pairs through a comparator: 16k tokens, 8 heads, 4 slots: 0.16 s against 0.03)
        keyed = flat * E + jnp.arange(E, dtype=jnp.int32)
        order = (jnp.sort(keyed, axis=-1) % E).astype(jnp.int32)
    else:
        order = jnp.argsort(flat, axis=-1, stable=True).astype(jnp.int32)
    counts = jax.vmap(lambda f: jnp.bincount(f, length=nb + 1))(flat)
    offsets = jnp.concatenate(
        [jnp.zeros((bh, 1), jnp.int32), jnp.cumsum(counts[:, :nb], axis=-1, dtype=jnp.int32)],
        axis=-1,
    )
    return order, offsets


def _entry_tile(t, lo, hi, ent_ref, bq, slots):
    """The t-th ``bq`` entries of a key block: (where each lane writes, its query, live).
    A lane past the block's entries reads query 0 and writes (masked) to a spare row of
    its own past the entries, so no two lanes of a scatter share a row (Pallas'
    interpreter writes masked lanes back, and a shared row could lose a live write)."""
    lane = jnp.arange(bq, dtype=jnp.int32)
    idx = lo + t * bq + lane
    live = idx < hi
    e = ent_ref[jnp.where(live, idx, 0)]
    spare = ent_ref.shape[0] + lane
    return jnp.where(live, e, spare), jnp.where(live, e // slots, 0), live


def _rows(ref, idx):
    """``ref[idx, :]`` as integer indices on both axes (Pallas' interpreter takes a
    gather or scatter of rows only so)."""
    return ref.at[idx[:, None], jnp.arange(ref.shape[-1], dtype=jnp.int32)[None, :]]


def _store_rows(ref, idx, val, live):
    mask = jnp.broadcast_to(live[:, None], val.shape)
    lower.store(_rows(ref, idx), val.astype(ref.dtype), mask=mask)


def _allowed(live, qpos, kpos, n, causal, qs, ks) -> Array:
    ok = live[:, None] & (kpos < n)[None, :]
    if causal:
        ok = ok & (kpos[None, :] <= qpos[:, None])
    if qs is not None:
        ok = ok & (qs[:, None] == ks[None, :]) & (ks[None, :] != 0)
    return ok


def _refs(refs, segmented, n_in):
    ins, rest = refs[:n_in], refs[n_in:]
    if segmented:
        return ins, rest[0], rest[1], rest[2:]
    return ins, None, None, rest


class _KeyBlock:
    """What a program of either kernel holds: key block ``j``'s keys, values and
    positions, the range of its entries, and the scores of its t-th ``bq`` entries."""

    def __init__(self, ins, qs_ref, ks_ref, statics):
        off_ref, self.ent_ref, self.q_ref, k_ref, v_ref = ins[:5]
        self.scale, block, self.n, self.causal, self.bq, self.slots = statics
        j = pl.program_id(0)
        self.lo, self.hi = off_ref[j], off_ref[j + 1]
        self.k, self.v = k_ref[...], v_ref[...]
        self.kpos = j * block + jnp.arange(block, dtype=jnp.int32)
        self.qs_ref = qs_ref
        self.ks = None if ks_ref is None else ks_ref[...]

    def steps(self):
        return (self.hi - self.lo + self.bq - 1) // self.bq

    def tile(self, t):
        """(where each lane writes, its query, live, the gathered queries, their
        scores, the allowed pairs)."""
        e, qpos, live = _entry_tile(t, self.lo, self.hi, self.ent_ref, self.bq, self.slots)
        q = lower.load(_rows(self.q_ref, qpos))
        s = lower.dot(q, self.k.T) * self.scale
        qs = None if self.qs_ref is None else self.qs_ref[qpos]
        ok = _allowed(live, qpos, self.kpos, self.n, self.causal, qs, self.ks)
        return e, qpos, live, q, s, ok


def _forward_kernel(*refs, statics, segmented):
    ins, qs_ref, ks_ref, (o_ref, m_ref, l_ref) = _refs(refs, segmented, 5)
    kb = _KeyBlock(ins, qs_ref, ks_ref, statics)

    def body(t, carry):
        e, _, live, _, s, ok = kb.tile(t)
        s = jnp.where(ok, s, NEG)
        m = jnp.max(s, axis=1)
        p = jnp.where(ok, jnp.exp(s - m[:, None]), 0.0)
        _store_rows(o_ref, e, lower.dot(p.astype(kb.v.dtype), kb.v), live)
        lower.store(m_ref.at[e], m, mask=live)
        lower.store(l_ref.at[e], jnp.sum(p, axis=1), mask=live)
        return carry

    lax.fori_loop(0, kb.steps(), body, 0)


def _backward_kernel(*refs, statics, segmented):
    ins, qs_ref, ks_ref, (dk_ref, dv_ref, dq_ref) = _refs(refs, segmented, 8)
    do_ref, lse_ref, delta_ref = ins[5:]
    kb = _KeyBlock(ins, qs_ref, ks_ref, statics)

    def body(t, carry):
        dk, dv = carry
        e, qpos, live, q, s, ok = kb.tile(t)
        do = lower.load(_rows(do_ref, qpos))
        p, ds = score_grads(s, ok, lse_ref[qpos], do, kb.v, delta_ref[qpos], kb.scale, q.dtype)
        _store_rows(dq_ref, e, lower.dot(ds, kb.k), live)
        return dk + lower.dot(ds.T, q), dv + lower.dot(p.astype(do.dtype).T, do)

    init = (jnp.zeros(kb.k.shape, jnp.float32), jnp.zeros(kb.v.shape, jnp.float32))
    dk, dv = lax.fori_loop(0, kb.steps(), body, init)
    dk_ref[...] = dk.astype(dk_ref.dtype)
    dv_ref[...] = dv.astype(dv_ref.dtype)


def _specs(bh, m, block, segs):
    """(row-whole spec of ``[b*h, ...]``, key-block tile spec, segment specs)."""

    def whole(*shape):
        return pl.BlockSpec((None, *shape), lambda j, r: (r,) + (0,) * len(shape))

    def tile(d):
        return pl.BlockSpec((None, block, d), lambda j, r: (r, j, 0))

    seg = []
    if segs is not None:
        h = bh // segs[0].shape[0]
        seg = [pl.BlockSpec((None, m), lambda j, r: (r // h, 0)),
               pl.BlockSpec((None, block), lambda j, r: (r // h, j))]  # fmt: skip
    return whole, tile, seg


def _call(kernel, name, in_arrays, in_specs, out_shapes, out_specs, grid, interpret):
    return pl.pallas_call(
        kernel, grid=grid, in_specs=in_specs, out_specs=out_specs, out_shape=out_shapes,
        compiler_params=lower.compiler_params(4, 2, interpret), interpret=interpret,
        name=f"{NAME}_{name}",
    )(*in_arrays)  # fmt: skip


def _merge(o, m, l, valid):
    """A query's partials (``[bh, m, S, dv]``, ``[bh, m, S]``) merged: (out, lse)."""
    m = jnp.where(valid, m, NEG)
    top = jnp.max(m, axis=-1)
    w = jnp.where(valid, jnp.exp(m - top[..., None]), 0.0)
    total = jnp.sum(w * jnp.where(valid, l, 0.0), axis=-1)
    safe = jnp.where(total > 0, total, 1.0)
    out = jnp.sum(w[..., None] * jnp.where(valid[..., None], o, 0.0), axis=-2) / safe[..., None]
    return out, top + jnp.log(safe)


@functools.partial(jax.custom_vjp, nondiff_argnums=(5, 6))
def _attend(q, k, v, segs, tables, statics, interpret):
    return _attend_fwd(q, k, v, segs, tables, statics, interpret)[0]


def _attend_fwd(q, k, v, segs, tables, statics, interpret):
    offsets, order, valid = tables
    bh, m, d = q.shape
    dv, block, slots = v.shape[-1], statics[1], statics[5]
    whole, tile, seg = _specs(bh, m, block, segs)
    kernel = functools.partial(_forward_kernel, statics=statics, segmented=segs is not None)
    E, F = m * slots, m * slots + statics[4]  # entries, and a spare row per lane
    o, mx, l = _call(
        kernel, "forward", (offsets, order, q, k, v, *(segs or ())),
        [whole(m // block + 1), whole(E), whole(m, d), tile(d), tile(dv), *seg],
        [jax.ShapeDtypeStruct((bh, F, dv), jnp.float32),
         jax.ShapeDtypeStruct((bh, F), jnp.float32), jax.ShapeDtypeStruct((bh, F), jnp.float32)],
        [whole(F, dv), whole(F), whole(F)], (m // block, bh), interpret,
    )  # fmt: skip
    out, lse = _merge(o[:, :E].reshape(bh, m, slots, dv), mx[:, :E].reshape(bh, m, slots),
                      l[:, :E].reshape(bh, m, slots), valid)  # fmt: skip
    out = out.astype(q.dtype)
    return out, (q, k, v, segs, tables, out, lse)


def _attend_bwd(statics, interpret, res, g):
    q, k, v, segs, tables, out, lse = res
    offsets, order, valid = tables
    bh, m, d = q.shape
    dv, block, slots = v.shape[-1], statics[1], statics[5]
    delta = jnp.sum(out.astype(jnp.float32) * g.astype(jnp.float32), axis=-1)
    whole, tile, seg = _specs(bh, m, block, segs)
    kernel = functools.partial(_backward_kernel, statics=statics, segmented=segs is not None)
    E, F = m * slots, m * slots + statics[4]
    dk, dv_, dq = _call(
        kernel, "backward",
        (offsets, order, q, k, v, g.astype(q.dtype), lse, delta, *(segs or ())),
        [whole(m // block + 1), whole(E), whole(m, d), tile(d), tile(dv), whole(m, dv),
         whole(m), whole(m), *seg],
        [jax.ShapeDtypeStruct(k.shape, k.dtype), jax.ShapeDtypeStruct(v.shape, v.dtype),
         jax.ShapeDtypeStruct((bh, F, d), jnp.float32)],
        [tile(d), tile(dv), whole(F, d)], (m // block, bh), interpret,
    )  # fmt: skip
    dq = jnp.where(valid[..., None], dq[:, :E].reshape(bh, m, slots, d), 0.0).sum(axis=2)
    return dq.astype(q.dtype), dk, dv_, None, None


_attend.defvjp(_attend_fwd, _attend_bwd)


def routed_gather_attention(
    query: Array,
    key: Array,
    value: Array,
    table: Array,
    valid: Array,
    *,
    block: int,
    causal: bool,
    segments: Array | None = None,
    scale: float | None = None,
    block_q: int = 32,
    interpret: bool | None = None,
) -> Array:
    """``[b, n, h, d] x3 -> [b, n, h, dv]``, the same function as
    :func:`~flaxformer_lite.sparse.ops.chosen_blocks.pallas_triton_tiles.routed_block_attention`
    (own block plus the
    blocks ``table [b, h, N, R]`` names where ``valid``), computed key block by key
    block over gathered queries. ``block``: the routing's key blocks (a power of two >=
    16); ``block_q``: gathered queries per step (a power of two >= 16)."""
    if block_q < 16 or block_q & (block_q - 1):
        raise ValueError(f"{NAME}: block_q={block_q} must be a power of two >= 16")
    q, k, v, segs, scale, interpret, unpad = flash_inputs(
        NAME, query, key, value, segments, block, block, scale, interpret
    )  # rows padded to the blocks; the entries are gathered block_q at a time
    bh, m, _ = q.shape
    chosen = chosen_blocks(NAME, table, valid, query.shape, m, block)
    own = jnp.broadcast_to((jnp.arange(m, dtype=jnp.int32) // block)[None, :, None], (bh, m, 1))
    blocks = lax.stop_gradient(jnp.concatenate([chosen, own], axis=-1))
    order, offsets = entries(blocks, m // block)
    statics = (scale, block, query.shape[1], causal, block_q, blocks.shape[-1])
    segs = None if segs is None else (segs, segs)
    return unpad(_attend(q, k, v, segs, (offsets, order, blocks >= 0), statics, interpret))
