"""Dynamic block-sparse attention fused for GPUs: the key blocks a routing chose, read
through tile lists computed in jax per batch row and head.

  out_i = sum_{j in own block of i, or in a block query i chose} softmax_j(q_i . k_j * scale) v_j

The same three Pallas kernels as :mod:`~flaxformer_lite.sparse.ops.block_sparse.pallas_triton`
(forward, dk/dv, dq; lowered by Triton on a GPU, Pallas' interpreter elsewhere), but
their tile lists are data: a :class:`~flaxformer_lite.sparse.ops.moba.xla.Routing` (``MoBA``'s
gate, NSA's selection) gives each query its chosen key blocks, and
:func:`tile_lists` turns it into, per batch row and head, each query tile's list of key
blocks (the union of its queries' choices and its own block) and each key block's list
of the query tiles that visit it. Each program reads its own row's lists
(:func:`~flaxformer_lite.sparse.ops.pallas_flash.row_table`); inside a visited tile a query
keeps the keys of the blocks *it* chose (a ``[tile, R]`` slice of the choices compared
with the block's index) and of its own block, with the causal, length and segment rules.
So the result is exactly the routing's attention (the tests compare it with dense
attention under the routing's mask), and the work is the visited tiles.

Key tiles are the routing's blocks (``block``, a power of two of at least 16); query
tiles of ``block_q`` rows (a divisor of ``block``; default ``min(block, 32)``). A
routing chosen per query block (``moba:block_gate=1``) visits exactly ``k`` tiles per
query tile; chosen per query, a tile visits the union of its queries' choices, so
smaller query tiles visit fewer blocks (at most ``block_q * (k - 1) + 1``) at a lower
arithmetic intensity. Neither the lists nor the choices carry a gradient (top-k is not
differentiable); the scores inside the chosen blocks do.
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
    row_table,
    score_grads,
    softmax_start,
    softmax_step,
    softmax_write,
    split_refs,
)

Array = jax.Array
NAME = "routed_block_attention"  # its three kernels: NAME_forward, NAME_dkdv, NAME_dq


def _compact(visits: Array, width: int) -> tuple[Array, Array]:
    """(count ``[...]``, indices ``[..., width]``) of the True entries of ``visits
    [..., L]`` in ascending order (slots past the count hold 0)."""
    L = visits.shape[-1]
    pos = jnp.cumsum(visits, axis=-1, dtype=jnp.int32) - 1
    dest = jnp.where(visits, pos, width).reshape(-1, L)  # slot `width`: discarded
    idx = jnp.arange(L, dtype=jnp.int32)
    rows = jax.vmap(lambda d: jnp.zeros(width + 1, jnp.int32).at[d].set(idx))(dest)
    return pos[..., -1] + 1, rows[:, :width].reshape(*visits.shape[:-1], width)


def tile_lists(chosen: Array, block: int, block_q: int):
    """The tile lists of a routing ``chosen [b*h, m, R]`` (key block per query and slot,
    -1 = empty): ``(forward, backward)`` where forward = (count ``[b*h, m/block_q]``,
    key blocks ``[b*h, m/block_q, T]``) per query tile and backward = (count ``[b*h,
    m/block]``, query tiles ``[b*h, m/block, m/block_q]``) per key block."""
    bh, m, R = chosen.shape
    nq, nb = m // block_q, m // block
    tile = jnp.arange(m) // block_q
    target = jnp.where(chosen >= 0, chosen, nb)  # empty slots land in a discarded column
    visits = jnp.zeros((bh, nq, nb + 1), bool)
    visits = visits.at[jnp.arange(bh)[:, None, None], tile[None, :, None], target].set(True)
    own = (jnp.arange(nq) * block_q // block)[:, None] == jnp.arange(nb)[None, :]
    visits = visits[..., :nb] | own
    forward = _compact(visits, min(nb, block_q * R + 1))
    return forward, _compact(jnp.swapaxes(visits, 1, 2), nq)


def _allowed(chosen, kb, own, q_first, k_first, shape, n, causal, qs, ks) -> Array:
    """``[bq, bk]`` bool: in key block ``kb``, the keys each query of the tile reads —
    its own block (``own``) or one it chose (``chosen [bq, R]``), real (< n), not after
    it where causal, and with segment ids of its own example and not padding."""
    hit = jnp.sum(jnp.where(chosen == kb, 1, 0), axis=1) > 0
    qpos = q_first + jnp.arange(shape[0], dtype=jnp.int32)[:, None]
    kpos = k_first + jnp.arange(shape[1], dtype=jnp.int32)[None, :]
    ok = (hit[:, None] | own) & (kpos < n)
    if causal:
        ok = ok & (kpos <= qpos)
    if qs is not None:
        ok = ok & (qs[:, None] == ks[None, :]) & (ks[None, :] != 0)
    return ok


def _key_tile(q, t, *, row, tiles_ref, chosen, k_ref, v_ref, ks_ref, qs, statics):
    """The t-th listed key block of query tile ``row``: (k, v, float32 scores, allowed)."""
    scale, block, n, causal = statics
    bq = q.shape[0]
    kb = tiles_ref[row, t]
    start = pl.multiple_of(kb * block, block)
    k = k_ref[pl.ds(start, block), :]
    v = v_ref[pl.ds(start, block), :]
    s = lower.dot(q, k.T) * scale
    ks = None if qs is None else ks_ref[pl.ds(start, block)]
    own = (row * bq) // block == kb
    return k, v, s, _allowed(chosen, kb, own, row * bq, start, s.shape, n, causal, qs, ks)


def _query_side(refs, segmented, n_in, statics):
    """What the forward and dq kernels share: their inputs and a partial of _key_tile."""
    ins, qs_ref, ks_ref, outs = split_refs(refs, segmented, n_in)
    count_ref, tiles_ref, chosen_ref, q_ref, k_ref, v_ref = ins[:6]
    i = pl.program_id(0)
    q = q_ref[...]
    bq = q.shape[0]
    chosen = chosen_ref[pl.ds(pl.multiple_of(i * bq, bq), bq), :]
    qs = None if qs_ref is None else qs_ref[...]
    tile = functools.partial(
        _key_tile, q, row=i, tiles_ref=tiles_ref, chosen=chosen, k_ref=k_ref, v_ref=v_ref,
        ks_ref=ks_ref, qs=qs, statics=statics,
    )  # fmt: skip
    return ins, outs, count_ref[i], q, tile


def _forward_kernel(*refs, statics, segmented):
    ins, (o_ref, lse_ref), count, q, tile = _query_side(refs, segmented, 6, statics)

    def body(t, carry):
        _, v, s, ok = tile(t)
        return softmax_step(carry, s, ok, v)

    carry = lax.fori_loop(0, count, body, softmax_start(q.shape[0], ins[5].shape[-1]))
    softmax_write(carry, o_ref, lse_ref)  # a query no key reaches (padding) gives 0


def _dq_kernel(*refs, statics, segmented):
    ins, (dq_ref,), count, q, tile = _query_side(refs, segmented, 9, statics)
    do, lse, delta = ins[6][...], ins[7][...], ins[8][...]
    scale = statics[0]

    def body(t, dq):
        k, v, s, ok = tile(t)
        return dq + lower.dot(score_grads(s, ok, lse, do, v, delta, scale, k.dtype)[1], k)

    dq = lax.fori_loop(0, count, body, jnp.zeros(q.shape, jnp.float32))
    dq_ref[...] = dq.astype(dq_ref.dtype)


def _dkdv_kernel(*refs, statics, bq, segmented):
    ins, qs_ref, ks_ref, (dk_ref, dv_ref) = split_refs(refs, segmented, 9)
    count_ref, tiles_ref, chosen_ref, q_ref, k_ref, v_ref, do_ref, lse_ref, delta_ref = ins
    scale, block, n, causal = statics
    j = pl.program_id(0)
    k, v = k_ref[...], v_ref[...]
    ks = None if ks_ref is None else ks_ref[...]

    def body(t, carry):
        dk, dv = carry
        qt = tiles_ref[j, t]
        start = pl.multiple_of(qt * bq, bq)
        q = q_ref[pl.ds(start, bq), :]
        do = do_ref[pl.ds(start, bq), :]
        s = lower.dot(q, k.T) * scale
        qs = None if ks is None else qs_ref[pl.ds(start, bq)]
        chosen = chosen_ref[pl.ds(start, bq), :]
        own = start // block == j
        ok = _allowed(chosen, j, own, start, j * block, s.shape, n, causal, qs, ks)
        lse, delta = lse_ref[pl.ds(start, bq)], delta_ref[pl.ds(start, bq)]
        p, ds = score_grads(s, ok, lse, do, v, delta, scale, q.dtype)
        return dk + lower.dot(ds.T, q), dv + lower.dot(p.astype(do.dtype).T, do)

    init = (jnp.zeros(k.shape, jnp.float32), jnp.zeros(v.shape, jnp.float32))
    dk, dv = lax.fori_loop(0, count_ref[j], body, init)
    dk_ref[...] = dk.astype(dk_ref.dtype)
    dv_ref[...] = dv.astype(dv_ref.dtype)


@functools.partial(jax.custom_vjp, nondiff_argnums=(5, 6, 7))
def _attend(q, k, v, segs, tables, statics, bq, interpret):
    return _attend_fwd(q, k, v, segs, tables, statics, bq, interpret)[0]


def _attend_fwd(q, k, v, segs, tables, statics, bq, interpret):
    (fwd_count, fwd_tiles), _, chosen = tables
    kernel = functools.partial(_forward_kernel, statics=statics, segmented=segs is not None)
    out, lse = flash_forward(kernel, NAME, q, k, v, segs, bq, interpret,
                             (fwd_count, fwd_tiles, chosen), row_table)  # fmt: skip
    return out, (q, k, v, segs, tables, out, lse)


def _attend_bwd(statics, bq, interpret, res, g):
    q, k, v, segs, tables, out, lse = res
    (fwd_count, fwd_tiles), (bwd_count, bwd_tiles), chosen = tables
    delta = jnp.sum(out.astype(jnp.float32) * g.astype(jnp.float32), axis=-1)
    common = dict(statics=statics, segmented=segs is not None)
    kernels = (
        functools.partial(_dkdv_kernel, bq=bq, **common),
        functools.partial(_dq_kernel, **common),
    )
    lists = ((bwd_count, bwd_tiles, chosen), (fwd_count, fwd_tiles, chosen))
    dq, dk, dv = flash_backward(kernels, NAME, q, k, v, segs, g.astype(q.dtype), lse, delta,
                                (bq, statics[1]), interpret, lists, row_table)  # fmt: skip
    return dq, dk, dv, None, None


_attend.defvjp(_attend_fwd, _attend_bwd)


def chosen_blocks(name: str, table: Array, valid: Array, shape, m: int, block: int) -> Array:
    """A routing's ``table``/``valid [b, h, m, R]`` as ``[b*h, m, R]`` blocks, -1 where a
    slot is empty; a table of another shape than queries ``shape [b, n, h, d]`` padded
    to ``m`` rows is refused, naming ``name``."""
    if table.shape[2] != m or table.shape[:2] != (shape[0], shape[2]):
        raise ValueError(
            f"{name}: the routing's table {table.shape} is not [b, h, {m}, R] for queries "
            f"{shape} in blocks of {block}"
        )
    return jnp.where(valid, table, -1).astype(jnp.int32).reshape(shape[0] * shape[2], m, -1)


def routed_block_attention(
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
    block_q: int | None = None,
    interpret: bool | None = None,
) -> Array:
    """``[b, n, h, d] x3 -> [b, n, h, dv]``: each query attends to its own key block and
    the blocks ``table [b, h, N, R]`` names where ``valid`` (a
    :class:`~flaxformer_lite.sparse.ops.moba.xla.Routing`; ``N`` = n rounded up to ``block``).

    Args:
      block: the routing's key blocks, also the kernel's key tiles (a power of two >= 16).
      causal: keys after their query are masked (in the own block; a causal routing
        chooses no later block).
      segments: ``[b, n]`` ids of packed rows (0 = padding), or None.
      scale: logit scale; default ``1/sqrt(d)``.
      block_q: query tile rows, a power of two >= 16 dividing ``block`` (default
        ``min(block, 32)``).
      interpret: Pallas' interpreter; default everywhere but on a GPU.
    """
    bq = min(block, 32) if block_q is None else block_q
    if block % bq:
        raise ValueError(f"{NAME}: block_q={bq} must divide block={block}")
    q, k, v, segs, scale, interpret, unpad = flash_inputs(
        NAME, query, key, value, segments, bq, block, scale, interpret
    )
    chosen = chosen_blocks(NAME, table, valid, query.shape, q.shape[1], block)
    r = max(1, chosen.shape[-1])
    width = 1 << (r - 1).bit_length()  # Triton loads power-of-two shapes
    chosen = jnp.pad(chosen, ((0, 0), (0, 0), (0, width - chosen.shape[-1])), constant_values=-1)
    forward, backward = tile_lists(lax.stop_gradient(chosen), block, bq)
    statics = (scale, block, query.shape[1], causal)
    segs = None if segs is None else (segs, segs)  # (query ids, key ids)
    return unpad(_attend(q, k, v, segs, (forward, backward, chosen), statics, bq, interpret))
