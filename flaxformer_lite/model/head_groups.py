"""Sparse self-attention in the model: each head group under its layer's pattern.

The patterns come from ``model.attention_pattern`` (grammar:
:mod:`flaxformer_lite.sparse.grammar.spec`);
:func:`multihead_sparse_attention` runs each head group on the kernel ``attention_impl``
names (``blocked``, ``reference``, ``cudnn``, ``splash``; dynamic ``topk`` on its own).
Also the dense ``[b, h, n, n]`` weights of the patterns for pictures and the masks of
cached decoding steps.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
from jax import Array

from flaxformer_lite.model import kernels
from flaxformer_lite.model.attention import attention_weights, dot_product_attention
from flaxformer_lite.sparse import dispatch
from flaxformer_lite.sparse.grammar import dynamic as D
from flaxformer_lite.sparse.grammar import patterns as P
from flaxformer_lite.sparse.grammar.spec import PatternSpecError
from flaxformer_lite.sparse.ops.band.pallas_triton import band_attention
from flaxformer_lite.sparse.ops.block_sparse.pallas_triton import block_sparse_attention
from flaxformer_lite.sparse.ops.block_sparse.xla import sparse_attention
from flaxformer_lite.sparse.ops.moba.xla import decode_mask as decode_routed_mask
from flaxformer_lite.sparse.ops.moba.xla import decode_routing, moba_attention, routed_mask
from flaxformer_lite.sparse.ops.nsa.xla import init_params as nsa_zero_params
from flaxformer_lite.sparse.ops.nsa.xla import nsa_attention, nsa_decode
from flaxformer_lite.sparse.ops.online_softmax import segment_mask
from flaxformer_lite.sparse.ops.packing import aligned_layout, sequences, to_aligned
from flaxformer_lite.sparse.ops.topk.xla import topk_attention


def multihead_sparse_attention(
    query: Array,
    key: Array,
    value: Array,
    patterns: list[P.Pattern],
    *,
    impl: str = "blocked",
    block_size: int = 64,
    segments: Array | None = None,
    packed: bool = False,
    scale: float | None = None,
    scan_blocks: int | None = None,
    nsa_params: dict[int, dict] | None = None,
) -> Array:
    """``[b, n, h, d]`` self-attention, head groups each under their own pattern, each on
    the kernel the dispatch table (:mod:`flaxformer_lite.sparse.dispatch`) gives its
    pattern under ``impl``: the project's XLA kernels (``blocked``), the pattern's dense
    mask (``reference``), cuDNN or the project's Triton kernels (``cudnn``; Pallas'
    interpreter off a GPU), TPU splash (``splash``: all groups in one call).

    ``nsa_params``: head group -> its gates and projections; ``packed``: rows hold several
    examples (``segments`` from the batch's segmentation), for cuDNN's packed layout."""
    if impl == "splash":
        for pattern in patterns:
            dispatch.kernel(pattern, impl)  # refuses a dynamic group
            if packed and not pattern.offset_invariant:
                raise ValueError(
                    f"attention_impl=splash on packed rows: {pattern} counts from each "
                    "sequence's start, splash's mask from the row's; use "
                    "attention_impl=blocked, or rows without packing"
                )
        return kernels.splash_attention(query, key, value, patterns, segments=segments,
                                        scale=scale)  # fmt: skip
    h = query.shape[2]
    per = h // len(patterns)
    outs = []
    for g, pattern in enumerate(patterns):
        sl = slice(g * per, (g + 1) * per)
        q, k, v = query[:, :, sl], key[:, :, sl], value[:, :, sl]
        try:
            name = dispatch.kernel(pattern, impl)
        except dispatch.Refused as e:
            raise ValueError(f"attention_impl={impl}, pattern {pattern}: {e}") from None
        triton = {}  # the Triton kernels: Pallas' interpreter off a GPU
        if impl == "cudnn":
            triton = dict(interpret=kernels.platform_mode("cudnn") != "cudnn")
        if name == "cudnn":
            out = kernels.cudnn_attention(
                q, k, v, pattern=pattern, q_segments=segments, packed=packed, scale=scale
            )
        elif name == "band":  # a two-sided window: not cuDNN's
            out = band_attention(q, k, v, left=pattern.window, right=pattern.window,
                                 scale=scale, segments=segments, **triton)  # fmt: skip
        elif name == "block_sparse" and packed and not pattern.offset_invariant:
            # Its tile plan is one static table for every row; a packed row's sequences
            # each need the cover shifted to their start: the XLA kernel does that.
            out = sparse_attention(q, k, v, pattern, block_size=block_size, q_segments=segments,
                                   kv_segments=segments, scale=scale, packed=True)  # fmt: skip
        elif name == "block_sparse":
            out = block_sparse_attention(q, k, v, pattern, scale=scale, segments=segments,
                                         **triton)  # fmt: skip
        elif name in ("routed", "routed_xla"):  # moba, nsa: their chosen blocks
            kernel = dict(kernel="triton", **triton) if name == "routed" else {}
            out = _dynamic(q, k, v, pattern, g, nsa_params, segments=segments, scale=scale,
                           packed=packed, **kernel)  # fmt: skip
        elif name == "topk":
            out = topk_attention(
                q if scale is None else q * (scale * math.sqrt(q.shape[-1])), k, v,
                pattern.k, causal=pattern.is_causal, q_segments=segments,
                kv_segments=segments, query_block=min(block_size, 128),
            )  # fmt: skip
        elif name == "blocked":
            out = sparse_attention(
                q, k, v, pattern, block_size=block_size, q_segments=segments,
                kv_segments=segments, scale=scale, scan_blocks=scan_blocks, packed=packed,
            )  # fmt: skip
        elif name == "dense_mask":
            out = masked_dense_attention(q, k, v, pattern, segments=segments, scale=scale,
                                         packed=packed)  # fmt: skip
        else:  # a kernel of the table without a call here
            raise NotImplementedError(f"model/head_groups.py has no call for kernel {name!r}")
        outs.append(out)
    return outs[0] if len(outs) == 1 else jnp.concatenate(outs, axis=2)


def _dynamic(q, k, v, pattern, group: int, nsa_params, **kw) -> Array:
    """A ``moba`` or ``nsa`` head group (``kw``: segments, packed, scale, kernel, interpret)."""
    if isinstance(pattern, D.NSA):
        return nsa_attention(q, k, v, nsa_params[group], pattern.k, pattern.window,
                             block=pattern.block, causal=pattern.is_causal, **kw)  # fmt: skip
    return moba_attention(q, k, v, pattern.k, block=pattern.block, causal=pattern.is_causal,
                          block_gate=pattern.block_gate, **kw)  # fmt: skip


def masked_dense_attention(
    query: Array,
    key: Array,
    value: Array,
    pattern: P.Pattern,
    *,
    segments: Array | None = None,
    scale: float | None = None,
    packed: bool = False,
) -> Array:
    """The pattern's attention as dense attention under its ``[n, n]`` mask
    (``attention_impl=reference``): quadratic memory, for checking and small ``n``.
    ``packed``: each sequence of the row under the pattern from its own start."""
    n, d = query.shape[1], query.shape[-1]
    mask = pattern_mask(pattern, n, segments, packed)
    scale = 1.0 / math.sqrt(d) if scale is None else scale
    return dot_product_attention(
        query, key, value, mask, score_fn=lambda q, k: jnp.einsum("bqhd,bkhd->bhqk", q, k) * scale
    )


def pattern_mask(pattern: P.Pattern, n: int, segments: Array | None, packed: bool) -> Array:
    """``[b or 1, 1, n, n]``: the pairs ``pattern`` allows in rows of ``segments``. Packed
    rows (contiguous runs of one id, :mod:`~flaxformer_lite.sparse.ops.packing`): the rule
    at positions from each sequence's start, within the sequence, as if it were alone
    in a padded row of length ``n``."""
    if segments is None:
        return jnp.asarray(pattern.mask(n))[None, None]
    if packed and not pattern.offset_invariant:
        seq = sequences(segments)
        same = (seq.run[:, :, None] == seq.run[:, None, :]) & (seq.run[:, None, :] > 0)
        rule = pattern.allows(seq.pos[:, :, None], seq.pos[:, None, :], n)
        return (same & rule)[:, None]
    mask = jnp.asarray(pattern.mask(n))[None, None]
    return mask & segment_mask(segments[:, :, None], segments[:, None, :])[:, None]


def dense_attention_weights(
    query: Array,
    key: Array,
    patterns: list[P.Pattern],
    *,
    segments: Array | None = None,
    scale: float | None = None,
    packed: bool = False,
) -> Array:
    """``[b, h, n, n]`` attention weights of the head groups' patterns, as a dense array:
    what the blocked kernel computes without forming it, for pictures
    (``sow_attention_weights``) and checks at small ``n``."""
    scores, mask = dense_scores(query, key, patterns, segments=segments, scale=scale,
                                packed=packed)  # fmt: skip
    return attention_weights(query, key, mask, score_fn=lambda q, k: scores)


def dense_scores(
    query: Array,
    key: Array,
    patterns: list[P.Pattern],
    *,
    segments: Array | None = None,
    scale: float | None = None,
    nsa_params: dict[int, dict] | None = None,
    packed: bool = False,
) -> tuple[Array, Array]:
    """(``[b, h, n, n]`` scores, the mask the head groups' patterns allow; for ``moba``
    the blocks it routed to, for ``nsa`` its selected blocks and window; ``packed``: each
    sequence from its own start, :func:`pattern_mask`, :func:`_packed_routed_mask`)."""
    n, h, d = query.shape[1], query.shape[2], query.shape[-1]
    per = h // len(patterns)
    scale = 1.0 / math.sqrt(d) if scale is None else scale
    scores = jnp.einsum("bqhd,bkhd->bhqk", query, key) * scale
    masks = []
    for g, p in enumerate(patterns):
        if isinstance(p, D.MoBA | D.NSA):
            sl = slice(g * per, (g + 1) * per)
            params = (nsa_params or {}).get(g)
            q, k = query[:, :, sl], key[:, :, sl]
            if packed and segments is not None:
                masks.append(_packed_routed_mask(q, k, p, segments, params))
            else:
                masks.append(_routed_mask(q, k, p, segments, params))
        elif isinstance(p, D.TopK):  # the keys scoring at least the k-th best
            allowed = jnp.tril(jnp.ones((n, n), bool)) if p.is_causal else jnp.ones((n, n), bool)
            group = jnp.where(allowed, scores[:, g * per : (g + 1) * per], -jnp.inf)
            kth = jax.lax.top_k(group, min(p.k, n))[0][..., -1:]
            masks.append(allowed & (group >= kth))
        else:
            masks.append(pattern_mask(p, n, segments, packed))
    mask = jnp.concatenate(
        [jnp.broadcast_to(m, (scores.shape[0], per, n, n)) for m in masks], axis=1
    )
    if segments is not None:
        mask = mask & segment_mask(segments[:, :, None], segments[:, None, :])[:, None]
    return scores, mask


def _packed_routed_mask(query: Array, key: Array, p: P.Pattern, segments, params) -> Array:
    """:func:`_routed_mask` of packed rows: routed on the sequences moved apart as the
    kernels move them (the guaranteed layout; NSA without causality gives each sequence
    its own blocks, a sequence that does not fit then reads nothing here), read back at
    the tokens' places."""
    own = isinstance(p, D.NSA) and not p.is_causal
    layout = aligned_layout(sequences(segments), p.block, share=not own)
    moved = [to_aligned(x, layout, 1) for x in (query, key)]
    mask = _routed_mask(*moved, p, layout.ids, params)  # [b, h, S, S]
    mask = jnp.pad(mask, ((0, 0), (0, 0), (0, 1), (0, 1)))  # slot S: padding, nothing
    back = jax.vmap(lambda m, d: m[:, d][:, :, d])(mask, layout.dest)
    return back & (segments != 0)[:, None, :, None]


def _routed_mask(query: Array, key: Array, p: P.Pattern, segments, params) -> Array:
    """``[b, h, n, n]``: the pairs a ``moba`` head group reads (``nsa``: its selected
    blocks and its window; the compressed branch reads pooled blocks, not keys)."""
    n, kw = query.shape[1], dict(block=p.block, causal=p.is_causal, segments=segments)
    if isinstance(p, D.NSA):
        h, d = query.shape[2], key.shape[-1]
        params = dict(params or nsa_zero_params(h, d, d))  # only the keys route: values
        params["compress_v"] = jnp.broadcast_to(jnp.eye(d, dtype=key.dtype), (h, d, d))
        routing = nsa_attention(query, key, key, params, p.k, p.window, parts=True, **kw)[3]
    else:
        routing = moba_attention(
            query, key, key, p.k, routing_only=True, block_gate=p.block_gate, **kw
        )
    mask = routed_mask(routing, p.block, n, p.is_causal, segments)
    if isinstance(p, D.NSA):
        local = P.Local(p.window).causal() if p.is_causal else P.Local(p.window)
        mask = mask | jnp.asarray(local.mask(n))[None, None]
    return mask


def decode_mask(
    patterns: list[P.Pattern], num_heads: int, q_pos: Array, k_pos: Array, n: int,
    query: Array | None = None, keys: Array | None = None, scale: float | None = None,
) -> Array:  # fmt: skip
    """``[b or 1, h, q, k]`` mask of the head groups' patterns for cached decoding steps.

    ``moba`` and ``nsa`` groups route over the cache (``query [b, q, h, d]``, ``keys [b, h,
    L, d]``, ``k_pos`` = the cache's positions 0..L-1): each step reads the blocks its
    query ranks first, as the full forward chose (``nsa``: its selected blocks and
    window; :func:`nsa_decode_groups` then computes its gated branches)."""
    per = num_heads // len(patterns)
    if any(isinstance(p, D.TopK) for p in patterns):
        raise PatternSpecError(
            "cached decoding is not implemented for topk attention: its keys depend on "
            "the scores of every key; evaluate perplexity, or use moba/nsa or a static "
            "pattern to generate"
        )
    masks = []
    for g, p in enumerate(patterns):
        if isinstance(p, D.MoBA | D.NSA):
            sl = slice(g * per, (g + 1) * per)
            d = query.shape[-1]
            q = jnp.swapaxes(query[:, :, sl], 1, 2).astype(
                jnp.promote_types(query.dtype, jnp.float32)
            )
            q = q * (1.0 / math.sqrt(d) if scale is None else scale)
            routing = decode_routing(q, keys[:, sl].astype(q.dtype), q_pos, p.block, p.k)
            mask = decode_routed_mask(routing, q_pos, keys.shape[2], p.block)
            if isinstance(p, D.NSA):
                near = (q_pos[:, None] - k_pos[None, :] <= p.window) & (k_pos <= q_pos[:, None])
                mask = mask | near
            masks.append(mask)
        else:
            mask = p.allows(q_pos[:, None], k_pos[None, :], n)[None, None]
            masks.append(jnp.broadcast_to(mask, (1, per, *mask.shape[2:])))
    b = max(m.shape[0] for m in masks)
    return jnp.concatenate([jnp.broadcast_to(m, (b, *m.shape[1:])) for m in masks], axis=1)


def nsa_decode_groups(
    out: Array, patterns: list[P.Pattern], query: Array, keys: Array, values: Array,
    q_pos: Array, nsa_params: dict[int, dict], scale: float | None = None,
) -> Array:  # fmt: skip
    """``out [b, q, h, dv]`` with each ``nsa`` head group's heads replaced by its gated
    branches over the cache (``keys``/``values`` ``[b, h, L, e]``)."""
    per = out.shape[2] // len(patterns)
    for g, p in enumerate(patterns):
        if isinstance(p, D.NSA):
            sl = slice(g * per, (g + 1) * per)
            heads = nsa_decode(
                query[:, :, sl], keys[:, sl], values[:, sl], nsa_params[g], q_pos, p.k,
                p.window, block=p.block, scale=scale,
            )  # fmt: skip
            out = out.at[:, :, sl].set(heads.astype(out.dtype))
    return out
