"""Dynamic sparse attention at sparse cost: key blocks chosen from the content (MoBA).

``moba:block=B,k=K`` (Mixture of Block Attention, Lu et al., Moonshot 2025): the keys
are cut into blocks of ``B``; each block's mean key is its summary, a query block
scores every summary with its mean query, and reads its own block and the ``K - 1``
best-scoring others (``K`` counts the own block: ``k=1`` is block-local attention,
``K`` at least the number of blocks is dense attention). Causal: only earlier blocks
compete, and the own block is masked causally inside, so no query ever reads a future
key. The routing is ``n * n / B`` dot products of pooled vectors; the attention reads
``K`` blocks per query block through :mod:`~flaxformer_lite.sparse.routed_kernel`
(``n * K * B`` scores, one group of blocks at a time); nothing is ``n x n``.

Design choices the paper leaves open, and why:

- **One choice per query block, not per query.** MoBA routes each query token; a
  block of queries sharing one set of key blocks is what a block-sparse kernel reads
  at ``B x B`` tiles (per-token choices would read the union of ``B`` tokens' blocks).
  Since the gate is linear in the query, the block's gate is the mean of its tokens'
  gates, so the block ranks key blocks by the tokens' average preference.
- **Per head.** Each head routes on its own queries and keys (multi-head attention; a
  head group shares its kernel, not its choice).
- **Packed rows.** A key block is a candidate only where its segment ids overlap the
  query block's (contiguous packing: the id ranges intersect), so a block of another
  example never takes a slot; padding is left out of the means.
- **Gradients** flow through the scores inside the chosen blocks (the routing has
  none: top-k is not differentiable), as in the paper's parameter-free gate.

:func:`routed_mask` returns the ``[b, h, n, n]`` mask a routing chose (tests compare
the kernel with dense attention under it; ``diagnostics`` reads it).
"""

from __future__ import annotations

import dataclasses
import math

import jax.numpy as jnp
from jax import Array, lax

from flaxformer_lite.sparse.online_softmax import normalise, pad_to, segment_mask
from flaxformer_lite.sparse.plans import num_blocks
from flaxformer_lite.sparse.routed_kernel import routed_partial

NO_SCORE = -jnp.inf


@dataclasses.dataclass(frozen=True)
class Routing:
    """Each query block's key blocks: ``table [b, h, nb, K]`` (slot 0: its own block),
    ``valid [b, h, nb, K]`` (False: an empty slot, fewer candidates than ``K``)."""

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
    w = present.astype(x.dtype).reshape(b, 1, N // block, block, 1)
    total = (x.reshape(b, h, N // block, block, e) * w).sum(3)
    return total / jnp.maximum(w.sum(3), 1.0)


def candidates(present: Array, segments: Array | None, block: int, causal: bool) -> Array:
    """``[b, 1, nb, nb]`` bool: key block ``j`` may be chosen for query block ``a``: another
    block (the own one is always read), holding a present key, earlier where causal,
    and sharing a segment id range with ``a`` where rows are packed."""
    b, N = present.shape
    nb = N // block
    a, j = jnp.arange(nb)[:, None], jnp.arange(nb)[None, :]
    ok = (j != a) & (j < a) if causal else (j != a)
    has = present.reshape(b, nb, block).any(-1)  # [b, nb]
    ok = ok[None] & has[:, None, :]
    if segments is not None:
        seg = pad_to(segments, N, 1).reshape(b, nb, block)
        here = present.reshape(b, nb, block)
        lo = jnp.where(here, seg, jnp.iinfo(jnp.int32).max).min(-1)
        hi = jnp.where(here, seg, -1).max(-1)
        ok = ok & (lo[:, :, None] <= hi[:, None, :]) & (lo[:, None, :] <= hi[:, :, None])
    return ok[:, None]


def choose(scores: Array, allowed: Array, k: int) -> Routing:
    """Own block + the ``k - 1`` best-scoring allowed others (ties: the lower index)."""
    b, h, nb, _ = scores.shape
    own = jnp.broadcast_to(jnp.arange(nb, dtype=jnp.int32)[:, None], (b, h, nb, 1))
    others = min(k - 1, nb - 1)
    if others <= 0:
        return Routing(own, jnp.ones_like(own, bool))
    masked = jnp.where(allowed, lax.stop_gradient(scores), NO_SCORE)
    best, index = lax.top_k(masked, others)
    valid = best > NO_SCORE
    table = jnp.concatenate([own, jnp.where(valid, index, own).astype(jnp.int32)], -1)
    return Routing(table, jnp.concatenate([jnp.ones_like(own, bool), valid], -1))


def moba_routing(q: Array, k: Array, present: Array, segments, block: int, top_k: int,
                 causal: bool) -> Routing:  # fmt: skip
    """MoBA's gate on ``[b, h, N, d]`` queries and keys: mean query . mean key per block."""
    scores = jnp.einsum("bhad,bhjd->bhaj", pooled(q, present, block), pooled(k, present, block))
    return choose(scores, candidates(present, segments, block, causal), top_k)


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
    routing_only: bool = False,
) -> Array | Routing:
    """MoBA self-attention ``[b, n, h, d] x3 -> [b, n, h, dv]`` (see the module doc);
    ``routing_only``: the :class:`Routing` it would read instead."""
    b, n, h, d = query.shape
    npad = num_blocks(n, block) * block
    scale = 1.0 / math.sqrt(d) if scale is None else scale
    compute = jnp.promote_types(query.dtype, jnp.float32)
    q = _layout(query, npad).astype(compute) * scale
    k, v = _layout(key, npad).astype(compute), _layout(value, npad).astype(compute)
    present = _present(n, npad, segments, b)
    seg = None if segments is None else pad_to(segments, npad, 1)
    routing = moba_routing(q, k, present, seg, block, top_k, causal)
    if routing_only:
        return routing
    m, l, o = routed_partial(q, k, v, routing.table, routing.valid, block, n, causal, seg)
    out = normalise(o, l)[:, :, :n]
    return jnp.swapaxes(out, 1, 2).astype(query.dtype)


def routed_mask(routing: Routing, block: int, n: int, causal: bool,
                segments: Array | None = None) -> Array:  # fmt: skip
    """``[b, h, n, n]`` bool: the pairs a routing reads (for tests and pictures)."""
    b, h, nb, _ = routing.table.shape
    chosen = jnp.zeros((b, h, nb, nb), bool)
    rows = jnp.arange(b)[:, None, None, None]
    heads = jnp.arange(h)[None, :, None, None]
    blocks = jnp.arange(nb)[None, None, :, None]
    chosen = chosen.at[rows, heads, blocks, routing.table].max(routing.valid)
    i, j = jnp.arange(n) // block, jnp.arange(n) // block
    mask = chosen[:, :, i][:, :, :, j]
    if causal:
        mask = mask & jnp.tril(jnp.ones((n, n), bool))
    if segments is not None:
        mask = mask & segment_mask(segments[:, :, None], segments[:, None, :])[:, None]
    return mask


__all__ = ["Routing", "choose", "moba_attention", "routed_mask"]
