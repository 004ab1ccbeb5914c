"""Native Sparse Attention (Yuan et al., DeepSeek 2025) at sparse cost:
``nsa:block=B,k=K,window=W``.

Three branches over the same queries, mixed by learned gates per head and query:

    out_i = g_c(i) Attn(q_i, K~, V~) + g_s(i) Attn(q_i, K_sel(i), V_sel(i))
            + g_w(i) Attn(q_i, K_win(i), V_win(i))

- **compressed**: each block of ``B`` keys (values) becomes one token, its mean passed
  through a learned per-head projection (``W_k``, ``W_v``, identity at start: the
  paper's MLP over a block, reduced to mean pooling plus a projection); a query sees
  the compressed blocks that end at or before it (causal), of its own segment; cost
  ``n * n / B``, a query block at a time;
- **selected**: the compressed branch's attention probabilities, summed over a query
  block's queries, rank the key blocks; the block reads its own and the ``K - 1`` best
  earlier ones at full resolution (:mod:`~flaxformer_lite.sparse.routed_kernel`,
  ``n * K * B``), as MoBA does with its mean-key gate (same choices of granularity:
  a query block, per head; :mod:`~flaxformer_lite.sparse.routed`);
- **window**: the last ``W`` keys (``local:window=W``, both sides without causality)
  on the blocked kernel, ``n * W``;
- **gates**: ``g = sigmoid(q_h . w_h + b_h)``, three per head, from the head's own
  query (a linear function of the token, as the paper's MLP over the input is; zero
  weights and biases at start: each branch weighs 1/2).

The selection is not differentiable (top-k); the gates, projections and every branch's
scores are. Each branch is a softmax of its own, so a query with nothing in a branch
(the first block has no earlier compressed block) gets zeros from it.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
from jax import Array, lax

from flaxformer_lite.sparse import patterns as P
from flaxformer_lite.sparse.blocked import sparse_attention
from flaxformer_lite.sparse.online_softmax import NEG, normalise, pad_to, partial_softmax
from flaxformer_lite.sparse.plans import num_blocks
from flaxformer_lite.sparse.routed import Routing, _layout, _present, candidates, choose, pooled
from flaxformer_lite.sparse.routed_kernel import routed_partial

BRANCHES = ("compressed", "selected", "window")
PARAMS = ("compress_k", "compress_v", "gate_w", "gate_b")  # the learned parts


def init_params(heads: int, d: int, dv: int) -> dict[str, Array]:
    """The learned parts at their start: identity projections, gates at 1/2."""
    return {
        "compress_k": jnp.broadcast_to(jnp.eye(d), (heads, d, d)),
        "compress_v": jnp.broadcast_to(jnp.eye(dv), (heads, dv, dv)),
        "gate_w": jnp.zeros((heads, d, 3)),
        "gate_b": jnp.zeros((heads, 3)),
    }


def compressed_visible(present: Array, segments: Array | None, block: int, causal: bool) -> Array:
    """``[b, 1, N, nb]`` bool: query ``i`` sees compressed block ``j``: the block holds a
    present key, all of the query's segment, and (causal) ends at or before ``i``."""
    b, N = present.shape
    nb = N // block
    here = present.reshape(b, nb, block)
    ok = jnp.broadcast_to(here.any(-1)[:, None, :], (b, N, nb))
    if causal:
        ok = ok & ((jnp.arange(nb)[None, :] + 1) * block - 1 <= jnp.arange(N)[:, None])[None]
    if segments is not None:
        seg = segments.reshape(b, nb, block)
        lo = jnp.where(here, seg, jnp.iinfo(jnp.int32).max).min(-1)
        hi = jnp.where(here, seg, -1).max(-1)
        ok = ok & (lo == hi)[:, None, :] & (lo[:, None, :] == segments[:, :, None])
    return ok[:, None]


def _compressed(q, kc, vc, visible, present, block):
    """(normalised output ``[b, h, N, dv]``, block importance ``[b, h, nb, nb]``): the
    queries against the compressed keys a query block at a time (recomputed backward);
    a query block's importance of key block ``j`` is its present queries' summed
    probability of compressed block ``j``."""
    b, h, N, d = q.shape
    nb = N // block

    @jax.checkpoint
    def one(args):
        qa, vis, here = args  # [b, h, B, d], [b, 1, B, nb], [b, B]
        scores = jnp.einsum("bhqd,bhjd->bhqj", qa, kc)
        part = partial_softmax(scores, vis, lambda p: jnp.einsum("bhqj,bhjv->bhqv", p, vc))
        probs = jnp.exp(jnp.where(vis, scores, NEG) - part.m[..., None])
        probs = probs / jnp.where(part.l > 0, part.l, 1.0)[..., None]
        importance = (probs * here[:, None, :, None]).sum(2)
        return normalise(part.o, part.l), lax.stop_gradient(importance)

    qs = jnp.moveaxis(q.reshape(b, h, nb, block, d), 2, 0)
    vis = jnp.moveaxis(visible.reshape(b, 1, nb, block, nb), 2, 0)
    here = jnp.moveaxis(present.reshape(b, nb, block), 1, 0)
    out, importance = lax.map(one, (qs, vis, here))  # [nb, b, h, B, dv], [nb, b, h, nb]
    return jnp.moveaxis(out, 0, 2).reshape(b, h, N, -1), jnp.moveaxis(importance, 0, 2)


def nsa_attention(
    query: Array,
    key: Array,
    value: Array,
    params: dict[str, Array],
    top_k: int,
    window: int,
    *,
    block: int = 64,
    causal: bool = False,
    segments: Array | None = None,
    scale: float | None = None,
    parts: bool = False,
):
    """NSA self-attention ``[b, n, h, d] x3 -> [b, n, h, dv]`` (see the module doc).
    ``parts``: also return ``{branch: [b, n, h, dv]}``, the gates ``[b, n, h, 3]`` and
    the selection's :class:`~flaxformer_lite.sparse.routed.Routing` (for the tests)."""
    b, n, h, d = query.shape
    npad = num_blocks(n, block) * block
    scale = 1.0 / math.sqrt(d) if scale is None else scale
    compute = jnp.promote_types(query.dtype, jnp.float32)
    q = _layout(query, npad).astype(compute) * scale
    k, v = _layout(key, npad).astype(compute), _layout(value, npad).astype(compute)
    present = _present(n, npad, segments, b)
    seg = None if segments is None else pad_to(segments, npad, 1)
    kc = jnp.einsum("bhjd,hde->bhje", pooled(k, present, block), params["compress_k"])
    vc = jnp.einsum("bhjv,hvw->bhjw", pooled(v, present, block), params["compress_v"])
    visible = compressed_visible(present, seg, block, causal)
    out_c, importance = _compressed(
        q, kc.astype(compute), vc.astype(compute), visible, present.astype(compute), block
    )
    routing: Routing = choose(importance, candidates(present, seg, block, causal), top_k)
    _, l, o = routed_partial(q, k, v, routing.table, routing.valid, block, n, causal, seg)
    local = P.Local(window).causal() if causal else P.Local(window)
    out_w = sparse_attention(
        query, key, value, local, block_size=block, q_segments=segments,
        kv_segments=segments, scale=scale,
    )  # fmt: skip
    branches = {
        "compressed": jnp.swapaxes(out_c[:, :, :n], 1, 2),
        "selected": jnp.swapaxes(normalise(o, l)[:, :, :n], 1, 2),
        "window": out_w.astype(compute),
    }
    logits = jnp.einsum("bnhd,hdc->bnhc", query.astype(compute), params["gate_w"])
    gates = jax.nn.sigmoid(logits + params["gate_b"])
    out = sum(gates[..., c : c + 1] * branches[name] for c, name in enumerate(BRANCHES))
    out = out.astype(query.dtype)
    return (out, branches, gates, routing) if parts else out
