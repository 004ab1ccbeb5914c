"""Native Sparse Attention (Yuan et al., DeepSeek 2025) at sparse cost:
``nsa:block=B,k=K,window=W``.

Three branches over the same queries, mixed by learned gates per head and query:

    out_i = g_c(i) Attn(q_i, K~, V~) + g_s(i) Attn(q_i, K_sel(i), V_sel(i))
            + g_w(i) Attn(q_i, K_win(i), V_win(i))

- **compressed**: each block of ``B`` keys (values) becomes one token, its mean passed
  through a learned per-head projection (``W_k``, ``W_v``, identity at start: the
  paper's MLP over a block, reduced to mean pooling plus a projection); a query sees
  the compressed blocks that end at or before it (causal), of its own segment; cost
  ``n * n / B``, a query block at a time (causal: the queries in four parts, each
  scoring only the blocks before its end, 5/8 of that), or fused on a GPU
  (:mod:`~flaxformer_lite.sparse.ops.nsa.compressed_triton`: no scores in memory);
- **selected**: each query's attention probabilities over the compressed blocks rank
  the key blocks; it reads its own block and the ``K - 1`` most probable earlier ones
  at full resolution (:mod:`~flaxformer_lite.sparse.ops.chosen_blocks.xla_chunks`, ``n * K * B``),
  as
  MoBA does with its mean-key gate (the same choices: per query, so that causality
  holds and cached decoding can choose the same; per head;
  :mod:`~flaxformer_lite.sparse.ops.moba.xla`). The ranking is taken on the compressed
  scores, which order a query's probabilities alike (one softmax per query and head)
  without computing them; a candidate its compressed branch does not see (a block
  partly of another packed sequence: probability 0) ranks after those it sees;
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

from flaxformer_lite.sparse.grammar import patterns as P
from flaxformer_lite.sparse.grammar.plans import num_blocks
from flaxformer_lite.sparse.ops.band.pallas_triton import band_attention
from flaxformer_lite.sparse.ops.block_sparse.xla import sparse_attention
from flaxformer_lite.sparse.ops.chosen_blocks.pallas_triton_gather import routed_gather_attention
from flaxformer_lite.sparse.ops.moba.routing_triton import fused_routing, tile_size
from flaxformer_lite.sparse.ops.moba.xla import (
    XLA_KERNELS,
    Routing,
    _layout,
    _present,
    _spans,
    decode_mask,
    per_block_causal,
    pooled,
    token_candidates,
    top_blocks,
)
from flaxformer_lite.sparse.ops.nsa.compressed_triton import compressed_attention
from flaxformer_lite.sparse.ops.online_softmax import NEG, normalise, pad_to, partial_softmax
from flaxformer_lite.sparse.ops.packing import in_sequences

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


def compressed_visible(present: Array, segments: Array | None, block: int, causal: bool, a):
    """``[b, 1, B, nb]`` bool for query block ``a``'s queries: query ``i`` sees compressed
    block ``j``: the block holds a present key, all of the query's segment, and (causal)
    ends at or before ``i``."""
    b, N = present.shape
    nb = N // block
    has, lo, hi = _spans(present, segments, block)
    i = a * block + jnp.arange(block)
    ok = jnp.broadcast_to(has[:, None, :], (b, block, nb))
    if causal:
        ok = ok & ((jnp.arange(nb)[None, :] + 1) * block - 1 <= i[:, None])[None]
    if segments is not None:
        seg = lax.dynamic_slice_in_dim(segments, a * block, block, 1)[:, :, None]
        ok = ok & (lo == hi)[:, None, :] & (lo[:, None, :] == seg)
    return ok[:, None]


def _compressed(q, kc, vc, present, segments, block, causal, others):
    """(normalised compressed output ``[b, h, N, dv]``, the selection :class:`Routing`):
    the queries against the compressed keys, a query block at a time (recomputed
    backward); each query's selection is its ``others`` most probable compressed blocks
    among its candidates (the paper's importance, per query and head). Causal queries
    go in parts, each against the compressed blocks that end before its
    last query (:func:`~flaxformer_lite.sparse.ops.moba.xla.per_block_causal`)."""

    def upto(w):  # queries against the first w compressed blocks
        kw, vw = kc[:, :, :w], vc[:, :, :w]

        def one(a, qa):  # [b, h, B, d]
            visible = compressed_visible(present, segments, block, causal, a)[..., :w]
            scores = jnp.einsum("bhqd,bhjd->bhqj", qa, kw)
            part = partial_softmax(scores, visible, lambda p: jnp.einsum("bhqj,bhjv->bhqv", p, vw))
            if others <= 0:
                empty = jnp.zeros((*qa.shape[:3], 0), jnp.int32)
                return normalise(part.o, part.l), empty, empty.astype(bool)
            allowed = token_candidates(present, segments, block, causal, a)[..., :w]
            ranked = jnp.where(visible, scores, NEG)  # a probability's order, module doc
            return (normalise(part.o, part.l), *top_blocks(ranked, allowed, others))

        return one

    out, table, valid = per_block_causal(upto, q, block, causal, others)
    return out, Routing(table, valid)


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
    kernel: str = "xla",
    interpret: bool | None = None,
    route: str | None = None,
    packed: bool = False,
):
    """NSA self-attention ``[b, n, h, d] x3 -> [b, n, h, dv]`` (see the module doc).
    ``parts``: also return ``{branch: [b, n, h, dv]}``, the gates ``[b, n, h, 3]`` and
    the selection's :class:`~flaxformer_lite.sparse.ops.moba.xla.Routing` (for the tests).
    ``kernel=triton``: every branch fused (``interpret`` as there): the compressed one and
    its selection (:mod:`~flaxformer_lite.sparse.ops.nsa.compressed_triton`,
    :mod:`~flaxformer_lite.sparse.ops.moba.routing_triton`; XLA's where ``block`` is no
    multiple of 16), the selected one on the routed kernel (``chosen_blocks``'
    ``pallas_triton_gather``) and the window on the band kernel (``band.pallas_triton``);
    the gates are XLA's either way. ``route``: the compressed branch and selection
    ``fused`` (the default under ``kernel=triton``) or ``xla`` (a query block at a time;
    the benchmark's baseline). ``packed``: each sequence from its own start (:func:`packed_nsa`)."""
    if packed and segments is not None and not parts:  # parts: of the rows as given
        kw = dict(block=block, causal=causal, scale=scale, kernel=kernel, interpret=interpret)
        return packed_nsa(query, key, value, params, top_k, window, segments, route=route, **kw)
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
    others = min(top_k - 1, npad // block - 1)
    if route not in (None, "xla", "fused"):
        raise ValueError(f"nsa: route={route!r}: 'xla' or 'fused' (kernel=triton)")
    if route is None:
        route = "fused" if kernel == "triton" and tile_size(block) is not None else "xla"
    if route == "fused":
        x = _layout(query, npad)  # its own dtype (the tensor cores'), scaled in the kernel
        out_c = compressed_attention(x, kc, vc, present, seg, block, causal, scale=scale,
                                     interpret=interpret).astype(compute)  # fmt: skip
        empty = jnp.zeros((b, h, npad, 0), jnp.int32)
        routing = Routing(empty, empty.astype(bool))
        if others > 0:
            routing = Routing(*fused_routing(x, kc, present, seg, block, others, causal,
                                             whole_first=True, interpret=interpret))  # fmt: skip
    else:
        out_c, routing = _compressed(
            q, kc.astype(compute), vc.astype(compute), present, seg, block, causal, others
        )
    if kernel == "triton":
        out_s = routed_gather_attention(
            query, key, value, routing.table, routing.valid, block=block, causal=causal,
            segments=segments, scale=scale, interpret=interpret,
        )  # fmt: skip
        out_w = band_attention(
            query, key, value, left=window, right=0 if causal else window, scale=scale,
            segments=segments, interpret=interpret,
        )  # fmt: skip
    else:
        partial = XLA_KERNELS[kernel]
        _, l, o = partial(q, k, v, routing.table, routing.valid, block, n, causal, seg)
        out_s = jnp.swapaxes(normalise(o, l)[:, :, :n], 1, 2)
        local = P.Local(window).causal() if causal else P.Local(window)
        out_w = sparse_attention(
            query, key, value, local, block_size=block, q_segments=segments,
            kv_segments=segments, scale=scale,
        )  # fmt: skip
    # Gated in the head-major layout of q and the compressed branch, one gate at a
    # time: the gates' [b, n, h, 3] einsum and the branches in token order made
    # XLA:CPU's forward+backward 1.3x slower at 16k tokens (2.94 s against 2.27).
    branches = {
        "compressed": out_c[:, :, :n],
        "selected": jnp.swapaxes(out_s.astype(compute), 1, 2),
        "window": jnp.swapaxes(out_w.astype(compute), 1, 2),
    }
    unscaled = jnp.swapaxes(query, 1, 2).astype(compute)  # [b, h, n, d]
    gates = [
        jax.nn.sigmoid(
            jnp.einsum("bhnd,hd->bhn", unscaled, params["gate_w"][..., c])
            + params["gate_b"][None, :, None, c]
        )
        for c in range(len(BRANCHES))
    ]
    out = sum(g[..., None] * branches[name] for g, name in zip(gates, BRANCHES, strict=True))
    out = jnp.swapaxes(out, 1, 2).astype(query.dtype)
    if not parts:
        return out
    tokens = {name: jnp.swapaxes(x, 1, 2) for name, x in branches.items()}
    return out, tokens, jnp.stack(gates, axis=-1).transpose(0, 2, 1, 3), routing


def packed_nsa(query, key, value, params, top_k: int, window: int, segments: Array, *,
               block: int, causal: bool, **kw) -> Array:  # fmt: skip
    """NSA on packed rows: every branch per sequence, blocked from its own start (the
    compressed blocks, the selection among them, the window within the sequence), as
    :func:`~flaxformer_lite.sparse.ops.moba.xla.packed_moba` moves the sequences apart.
    Without causality a sequence shorter than a block sees its own compressed block, so
    each sequence gets blocks of its own (``share=False``); a row whose sequences do not
    fit twice its blocks that way lets the short ones share, and those then see no
    compressed block (their other two branches are exact)."""

    def attend(layout, q, k, v):
        return nsa_attention(q, k, v, params, top_k, window, block=block, causal=causal,
                             segments=layout.ids, **kw)  # fmt: skip

    return in_sequences(attend, (query, key, value), segments, block, axis=1, share=causal)


def _softmax_attend(scores: Array, mask: Array, values: Array) -> Array:
    part = partial_softmax(scores, mask, lambda p: jnp.einsum("bhsj,bhjv->bhsv", p, values))
    return normalise(part.o, part.l)


def nsa_decode(
    query: Array,
    keys: Array,
    values: Array,
    params: dict[str, Array],
    q_pos: Array,
    top_k: int,
    window: int,
    *,
    block: int = 64,
    scale: float | None = None,
) -> Array:
    """Causal NSA for cached decoding steps: ``query [b, s, h, d]`` at positions ``q_pos``
    against the cache ``keys``/``values`` ``[b, h, L, e]``: the compressed blocks that
    end at or before each query, the ``top_k - 1`` complete earlier blocks they rank
    first (with the own block), the window, gated: what the full forward computes."""
    b, s, h, d = query.shape
    L = keys.shape[2]
    nb = num_blocks(L, block)
    scale = 1.0 / math.sqrt(d) if scale is None else scale
    compute = jnp.promote_types(query.dtype, jnp.float32)
    q = jnp.swapaxes(query, 1, 2).astype(compute) * scale  # [b, h, s, d]
    k, v = keys.astype(compute), values.astype(compute)
    full = jnp.ones((b, nb * block), bool)
    kc = jnp.einsum("bhjd,hde->bhje", pooled(pad_to(k, nb * block, 2), full, block),
                    params["compress_k"].astype(compute))  # fmt: skip
    vc = jnp.einsum("bhjv,hvw->bhjw", pooled(pad_to(v, nb * block, 2), full, block),
                    params["compress_v"].astype(compute))  # fmt: skip
    j = jnp.arange(nb)
    visible = ((j[None, :] + 1) * block - 1 <= q_pos[:, None])[None, None]  # [1, 1, s, nb]
    scores = jnp.einsum("bhsd,bhjd->bhsj", q, kc)
    part = partial_softmax(scores, visible, lambda p: jnp.einsum("bhsj,bhjv->bhsv", p, vc))
    out_c = normalise(part.o, part.l)
    others = min(top_k - 1, nb - 1)
    k_pos = jnp.arange(L)
    causal = k_pos[None, :] <= q_pos[:, None]
    own = (k_pos[None, :] // block == (q_pos // block)[:, None]) & causal
    selected = jnp.broadcast_to(own, (b, h, s, L))
    if others > 0:
        ranked = jnp.where(visible, scores, NEG)
        allowed = (j[None, :] < (q_pos // block)[:, None])[None, None]
        selected = decode_mask(Routing(*top_blocks(ranked, allowed, others)), q_pos, L, block)
    near = causal & (q_pos[:, None] - k_pos[None, :] <= window)
    kv_scores = jnp.einsum("bhsd,bhld->bhsl", q, k)
    branches = {
        "compressed": out_c,
        "selected": _softmax_attend(kv_scores, selected, v),
        "window": _softmax_attend(kv_scores, near[None, None], v),
    }
    logits = jnp.einsum("bshd,hdc->bshc", query.astype(compute), params["gate_w"])
    gates = jnp.swapaxes(jax.nn.sigmoid(logits + params["gate_b"]), 1, 2)  # [b, h, s, 3]
    out = sum(gates[..., c : c + 1] * branches[name] for c, name in enumerate(BRANCHES))
    return jnp.swapaxes(out, 1, 2).astype(query.dtype)
