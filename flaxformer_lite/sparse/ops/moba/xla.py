"""Dynamic sparse attention at sparse cost: key blocks chosen from the content (MoBA).

``moba:block=B,k=K`` (Mixture of Block Attention, Lu et al., Moonshot 2025): the keys
are cut into blocks of ``B``; each block's mean key is its summary; a query scores
every summary and reads its own block and the ``K - 1`` best-scoring others (``K``
counts the own block: ``k=1`` is block-local attention, ``K`` at least the number of
blocks is dense attention). Causal: only earlier blocks compete, and the own block is
masked causally inside, so no query reads a future key. The routing is ``n * n / B``
dot products of pooled vectors (many query blocks a step); the attention reads ``K``
blocks per query (``n * K * B`` scores) through
:mod:`~flaxformer_lite.sparse.ops.chosen_blocks.xla_chunks` (XLA: key block by key block over chunks
of the queries that chose it) or a fused GPU kernel; nothing is ``n x n``.

Design choices the paper leaves open, and why:

- **A choice per query** (the paper's gate), not per query block. A block of queries
  sharing one choice would be cheaper to read, but its gate (the mean query) holds the
  block's later queries: under causality an earlier query's keys would depend on later
  tokens, and cached decoding could not reproduce it. ``block_gate=1`` takes the
  shared choice where there is no causality (an encoder), refused in causal layers.
- **Per head.** Each head routes on its own queries and keys (multi-head attention).
- **Packed rows** (``packed=True``): each sequence blocked from its own start, as
  alone (:func:`packed_moba`). Within one call a key block is a candidate only if its
  segment ids span the query's; padding is left out of the means and routes nowhere.
- **Gradients** flow through the scores inside the chosen blocks; the routing has none
  (top-k is not differentiable), as in the paper's parameter-free gate.

:func:`routed_mask` returns the ``[b, h, n, n]`` mask a routing chose (tests compare
the kernel with dense attention under it; the model's sown weights use it).
"""

from __future__ import annotations

import dataclasses
import math

import jax
import jax.numpy as jnp
from jax import Array, lax

from flaxformer_lite.sparse.grammar.plans import num_blocks
from flaxformer_lite.sparse.ops.chosen_blocks.pallas_triton_gather import routed_gather_attention
from flaxformer_lite.sparse.ops.chosen_blocks.pallas_triton_tiles import routed_block_attention
from flaxformer_lite.sparse.ops.chosen_blocks.xla_chunks import routed_chunks_partial
from flaxformer_lite.sparse.ops.chosen_blocks.xla_gather import routed_partial
from flaxformer_lite.sparse.ops.moba.routing_triton import fused_routing, tile_size
from flaxformer_lite.sparse.ops.online_softmax import normalise, pad_to, segment_mask
from flaxformer_lite.sparse.ops.packing import in_sequences

NO_SCORE = -jnp.inf
# The partial softmax over the chosen blocks, by XLA: key block by key block over
# chunks of entries (the default), or each query's blocks gathered (the first kernel).
XLA_KERNELS = {"xla": routed_chunks_partial, "xla_rows": routed_partial}


@dataclasses.dataclass(frozen=True)
class Routing:
    """The key blocks each query reads besides its own: ``table [b, h, N, R]`` and
    ``valid [b, h, N, R]`` (False: an empty slot, fewer candidates than ``R``)."""

    table: Array
    valid: Array


def _layout(x: Array, npad: int) -> Array:
    """``[b, n, h, e] -> [b, h, npad, e]``, zero-padded."""
    return pad_to(jnp.swapaxes(x, 1, 2), npad, 2)


def _present(n: int, npad: int, segments: Array | None, b: int) -> Array:
    """``[b, npad]`` bool: a real token (inside ``n``, not padding)."""
    inside = jnp.broadcast_to(jnp.arange(npad) < n, (b, npad))
    if segments is None:
        return inside
    return inside & (pad_to(segments, npad, 1) != 0)


def pooled(x: Array, present: Array, block: int) -> Array:
    """``x [b, h, N, e]`` averaged over each block's present positions: ``[b, h, nb, e]``
    (zeros for a block with none)."""
    b, h, N, e = x.shape
    # The absent positions selected away, not multiplied by a 0/1 weight: XLA:CPU
    # materialised that weight at x's size and its YNNPACK reduction ran slowly beside
    # the other branches (NSA's forward+backward at 16k tokens 1.36 -> 1.18 s).
    kept = jnp.where(present[:, None, :, None], x, 0.0).reshape(b, h, N // block, block, e)
    count = present.astype(x.dtype).reshape(b, 1, N // block, block).sum(-1)
    return kept.sum(3) / jnp.maximum(count, 1.0)[..., None]


def _spans(present: Array, segments: Array | None, block: int):
    """Per block: (holds a present token ``[b, nb]``, least and largest segment id of
    its present tokens, or None without segments)."""
    b, N = present.shape
    here = present.reshape(b, N // block, block)
    if segments is None:
        return here.any(-1), None, None
    seg = segments.reshape(b, N // block, block)
    lo = jnp.where(here, seg, jnp.iinfo(jnp.int32).max).min(-1)
    hi = jnp.where(here, seg, -1).max(-1)
    return here.any(-1), lo, hi


def token_candidates(present, segments, block: int, causal: bool, a) -> Array:
    """``[b, 1, B, nb]`` bool for query block ``a``'s queries: key block ``j`` may be
    chosen: another block (the own one is always read), earlier where causal, holding a
    present key whose segment ids span the query's; a padding query routes nowhere."""
    b, N = present.shape
    nb = N // block
    j = jnp.arange(nb)
    ok = (j != a) & (j < a) if causal else (j != a)
    has, lo, hi = _spans(present, segments, block)
    mine = lax.dynamic_slice_in_dim(present, a * block, block, 1)  # [b, B]
    ok = ok[None, None] & has[:, None, :] & mine[:, :, None]
    if segments is not None:
        seg = lax.dynamic_slice_in_dim(segments, a * block, block, 1)[:, :, None]
        ok = ok & (lo[:, None, :] <= seg) & (seg <= hi[:, None, :])
    return ok[:, None]


def block_candidates(present, segments, block: int) -> Array:
    """``[b, 1, nb, nb]``: block ``j`` may be chosen for query block ``a`` (no causality):
    another block holding present keys, sharing a segment id range with ``a``."""
    has, lo, hi = _spans(present, segments, block)
    nb = has.shape[1]
    ok = (jnp.arange(nb)[:, None] != jnp.arange(nb)[None]) & has[:, None, :] & has[:, :, None]
    if segments is not None:
        ok = ok & (lo[:, :, None] <= hi[:, None, :]) & (lo[:, None, :] <= hi[:, :, None])
    return ok[:, None]


def top_blocks(scores: Array, allowed: Array, others: int, by: str | None = None):
    """The ``others`` best allowed blocks per row of ``scores [..., nb]`` (ties: the lower
    index): ``(table, valid)``, an empty slot where fewer are allowed. ``by``: ``top_k``
    (XLA's sort-based top-k) or ``argmax`` (``others`` passes of an argmax, the chosen
    one masked after each: the same table; 2.5x faster routing at 64k tokens on an
    H200, slower on a CPU); default argmax on a GPU for up to 16 blocks, else top_k."""
    masked = jnp.where(allowed, lax.stop_gradient(scores), NO_SCORE)
    if by is None:
        by = "argmax" if others <= 16 and jax.default_backend() == "gpu" else "top_k"
    if by == "top_k":
        best, index = lax.top_k(masked, others)
        return index.astype(jnp.int32), best > NO_SCORE
    iota = lax.broadcasted_iota(jnp.int32, masked.shape, masked.ndim - 1)
    picks, bests = [], []
    for _ in range(others):  # argmax takes the lowest index of a tie, as top_k does
        index = jnp.argmax(masked, axis=-1).astype(jnp.int32)
        bests.append(jnp.max(masked, axis=-1))
        picks.append(index)
        masked = jnp.where(iota == index[..., None], NO_SCORE, masked)
    return jnp.stack(picks, -1), jnp.stack(bests, -1) > NO_SCORE


ROUTE_ELEMENTS = 1 << 22  # routing scores per step (16 MiB in float32): the steps' size


def per_block(fn, q: Array, block: int, width: int | None = None, first: int = 0):
    """``fn(a, q_a)`` for every query block ``a`` of ``q [b, h, N, d]``, outputs joined
    along the query axis (2). Blocks go ``G`` at a time (``jax.vmap`` inside a
    ``lax.map`` step, recomputed in the backward pass), ``G`` the most whose ``[b, h, B,
    width]`` scores (``width``: keys or blocks a query scores; default the block count)
    stay within :data:`ROUTE_ELEMENTS`: a sequential loop over single blocks leaves an
    accelerator idle (64k tokens: 1,024 steps), one over all of them is ``n x n / B``.
    ``first``: the index of ``q``'s first block (``q`` a slice of the queries)."""
    b, h, N, d = q.shape
    nb = N // block
    per = b * h * block * (width or nb)
    g = max(x for x in range(1, nb + 1) if nb % x == 0 and x * per <= max(ROUTE_ELEMENTS, per))
    qs = jnp.moveaxis(q.reshape(b, h, nb // g, g, block, d), (2, 3), (0, 1))
    step = jax.checkpoint(lambda xs: jax.vmap(fn)(*xs))
    outs = lax.map(step, (first + jnp.arange(nb).reshape(nb // g, g), qs))
    return jax.tree.map(
        lambda x: jnp.moveaxis(x.reshape(nb, *x.shape[2:]), 0, 2).reshape(b, h, N, *x.shape[5:]),
        outs,
    )


def moba_routing(q, k, present, segments, block: int, top_k: int, causal: bool,
                 block_gate: bool = False, fused: bool = False,
                 interpret: bool | None = None) -> Routing:  # fmt: skip
    """MoBA's gate on ``[b, h, N, d]`` queries and keys: query . mean key per block (with
    ``block_gate``: mean query . mean key, one choice per query block). ``fused``: the
    per-query gate by :mod:`~flaxformer_lite.sparse.ops.moba.routing_triton` (one pass, no scores in
    memory; the same table)."""
    b, h, N, _ = q.shape
    nb = N // block
    others = min(top_k - 1, nb - 1)
    if others <= 0:
        empty = jnp.zeros((b, h, N, 0), jnp.int32)
        return Routing(empty, empty.astype(bool))
    means = pooled(k, present, block)
    if block_gate:
        scores = jnp.einsum("bhad,bhjd->bhaj", pooled(q, present, block), means)
        table, valid = top_blocks(scores, block_candidates(present, segments, block), others)
        return Routing(jnp.repeat(table, block, 2), jnp.repeat(valid, block, 2))
    if fused:
        return Routing(*fused_routing(q, means, present, segments, block, others, causal,
                                      interpret=interpret))  # fmt: skip

    def upto(w):  # queries against the first w blocks
        def one(a, qa):  # [b, h, B, d]
            scores = jnp.einsum("bhqd,bhjd->bhqj", qa, means[:, :, :w])
            allowed = token_candidates(present, segments, block, causal, a)[..., :w]
            return top_blocks(scores, allowed, others)

        return one

    return Routing(*per_block_causal(upto, q, block, causal, others))


TIERS = 4  # causal: the queries in this many parts, each scoring the blocks before its end


def per_block_causal(upto, q: Array, block: int, causal: bool, least: int = 0):
    """:func:`per_block` of ``upto(w)``, a function of query blocks against the first
    ``w`` key blocks. Causal: the queries in :data:`TIERS` parts, each against the
    blocks up to its own end (at least ``least``), so that scores of later blocks,
    which a causal query never uses, are not computed: 5/8 of all blocks for every
    query. Otherwise one part against all blocks."""
    nb = q.shape[2] // block
    ends = sorted({-(-nb * (t + 1) // TIERS) for t in range(TIERS)}) if causal else [nb]
    parts, start = [], 0
    for end in ends:
        width = max(end, least)
        qs = q[:, :, start * block : end * block]
        parts.append(per_block(upto(width), qs, block, width=width, first=start))
        start = end
    return jax.tree.map(lambda *x: jnp.concatenate(x, axis=2), *parts)


def moba_attention(
    query: Array,
    key: Array,
    value: Array,
    top_k: int,
    *,
    block: int = 64,
    causal: bool = False,
    segments: Array | None = None,
    scale: float | None = None,
    block_gate: bool = False,
    routing_only: bool = False,
    kernel: str = "xla",
    interpret: bool | None = None,
    route: str | None = None,
    packed: bool = False,
) -> Array | Routing:
    """MoBA self-attention ``[b, n, h, d] x3 -> [b, n, h, dv]`` (see the module doc);
    ``routing_only``: the :class:`Routing` it would read instead. ``kernel``: ``xla``
    (:mod:`~flaxformer_lite.sparse.ops.chosen_blocks.xla_chunks`, any device), ``xla_rows``
    (:mod:`~flaxformer_lite.sparse.ops.chosen_blocks.xla_gather`: each query's blocks gathered; 5x
    slower on a CPU, kept for comparison) or ``triton`` (fused,
    inputs in their own dtype; ``interpret`` as there): a choice per query on
    :mod:`~flaxformer_lite.sparse.ops.chosen_blocks.pallas_triton_gather` (key block by key block
    over the
    queries that chose it), a choice per query block on
    :mod:`~flaxformer_lite.sparse.ops.chosen_blocks.pallas_triton_tiles` (its tiles). ``route``:
    ``xla``
    (:func:`moba_routing`'s scores and top blocks) or ``fused``
    (:mod:`~flaxformer_lite.sparse.ops.moba.routing_triton`, the same table); default fused on a GPU
    for a per-query gate whose block is a multiple of 16. ``packed``: the rows hold
    several sequences (contiguous runs of one segment id), each blocked from its own
    start as alone (MoBA's varlen semantics; :func:`packed_moba`)."""
    if packed and segments is not None:
        if routing_only:
            raise ValueError("moba: routing_only of packed rows: route the aligned rows "
                             "(sparse.ops.packing.aligned_layout) instead")  # fmt: skip
        kw = dict(block=block, causal=causal, scale=scale, block_gate=block_gate,
                  kernel=kernel, interpret=interpret, route=route)  # fmt: skip
        return packed_moba(query, key, value, top_k, segments, **kw)
    if block_gate and causal:
        raise ValueError("moba's block_gate=1 routes a query block by all its queries, later "
                         "ones too: not causal; use block_gate=0 in causal attention")  # fmt: skip
    b, n, h, d = query.shape
    npad = num_blocks(n, block) * block
    scale = 1.0 / math.sqrt(d) if scale is None else scale
    compute = jnp.promote_types(query.dtype, jnp.float32)
    q = _layout(query, npad).astype(compute) * scale
    k, v = _layout(key, npad).astype(compute), _layout(value, npad).astype(compute)
    present = _present(n, npad, segments, b)
    seg = None if segments is None else pad_to(segments, npad, 1)
    if route is None:
        on_gpu = jax.default_backend() == "gpu" and tile_size(block) is not None
        route = "fused" if on_gpu and not block_gate else "xla"
    if route not in ("xla", "fused") or (route == "fused" and block_gate):
        raise ValueError(f"moba: route={route!r}: 'xla', or 'fused' for a per-query gate")
    routing = moba_routing(q, k, present, seg, block, top_k, causal, block_gate,
                           fused=route == "fused", interpret=interpret)  # fmt: skip
    if routing_only:
        return routing
    if kernel == "triton":  # a shared choice reads whole tiles; one per query, gathered rows
        fused = routed_block_attention if block_gate else routed_gather_attention
        return fused(
            query, key, value, routing.table, routing.valid, block=block, causal=causal,
            segments=segments, scale=scale, interpret=interpret,
        )  # fmt: skip
    m, l, o = XLA_KERNELS[kernel](q, k, v, routing.table, routing.valid, block, n, causal, seg)
    out = normalise(o, l)[:, :, :n]
    return jnp.swapaxes(out, 1, 2).astype(query.dtype)


def packed_moba(query, key, value, top_k: int, segments: Array, *, block: int, **kw) -> Array:
    """MoBA on packed rows as its authors define it there (their varlen kernel): each
    sequence cut into blocks from its own start, routing among its own blocks only. The
    sequences are moved apart first (:func:`~flaxformer_lite.sparse.ops.packing.in_sequences`):
    each longer than a block from a multiple of ``block``, so no block holds two of them
    (a block straddling two sequences would pool both and could hide a sequence's own
    keys); shorter ones share blocks, each inside one, where only its own queries read
    it. Segment ids that grow along the moved row keep the candidate rule exact."""

    def attend(layout, q, k, v):
        return moba_attention(q, k, v, top_k, block=block, segments=layout.ids, **kw)

    return in_sequences(attend, (query, key, value), segments, block, axis=1)


def routed_mask(routing: Routing, block: int, n: int, causal: bool,
                segments: Array | None = None) -> Array:  # fmt: skip
    """``[b, h, n, n]`` bool: the pairs a routing reads (its own block and the chosen
    ones, causal and segment rules applied), for tests and pictures."""
    b, h, N, _ = routing.table.shape
    nb = N // block
    chosen = jnp.zeros((b, h, N, nb), bool).at[
        jnp.arange(b)[:, None, None, None], jnp.arange(h)[None, :, None, None],
        jnp.arange(N)[None, None, :, None], routing.table,
    ].max(routing.valid)  # fmt: skip
    chosen = chosen | (jnp.arange(N)[:, None] // block == jnp.arange(nb)[None, :])
    mask = chosen[:, :, :n][..., jnp.arange(n) // block]
    if causal:
        mask = mask & jnp.tril(jnp.ones((n, n), bool))
    if segments is not None:
        mask = mask & segment_mask(segments[:, :, None], segments[:, None, :])[:, None]
    return mask


__all__ = ["Routing", "decode_mask", "decode_routing", "moba_attention", "routed_mask"]


def decode_routing(q: Array, keys: Array, q_pos: Array, block: int, top_k: int) -> Routing:
    """What cached decoding steps read: ``q [b, h, s, d]`` (scaled queries at positions
    ``q_pos [s]``) against the cache ``keys [b, h, L, d]``: each query's ``top_k - 1``
    best complete earlier blocks by its query . mean key, as :func:`moba_routing` chose
    in the full forward (the same blocks, means and ties: the cached steps equal it)."""
    b, h, L, _ = keys.shape
    nb = num_blocks(L, block)
    others = min(top_k - 1, nb - 1)
    if others <= 0:
        empty = jnp.zeros((b, h, q.shape[2], 0), jnp.int32)
        return Routing(empty, empty.astype(bool))
    keys = pad_to(keys, nb * block, 2)
    means = pooled(keys, jnp.ones((b, nb * block), bool), block)
    allowed = jnp.arange(nb)[None, :] < (q_pos // block)[:, None]  # complete, earlier
    scores = jnp.einsum("bhsd,bhjd->bhsj", q, means)
    return Routing(*top_blocks(scores, allowed[None, None], others))


def decode_mask(routing: Routing, q_pos: Array, length: int, block: int) -> Array:
    """``[b, h, s, L]``: the cache positions the decoding steps' routing reads (own
    block and the chosen ones, up to the query)."""
    k_blocks = jnp.arange(length) // block
    own = k_blocks[None, :] == (q_pos // block)[:, None]  # [s, L]
    chosen = (routing.table[..., None] == k_blocks) & routing.valid[..., None]
    return (own | chosen.any(-2)) & (jnp.arange(length)[None, :] <= q_pos[:, None])
