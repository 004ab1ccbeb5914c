"""Dynamic sparse attention: each query keeps its ``top_k`` best-scoring keys.

The learned-pattern family (keys chosen by score, not by position). Scores are
computed one query block at a time, so memory is ``B * n`` while time stays
``n^2``; the static patterns of :mod:`~flaxformer_lite.sparse.ops.block_sparse.xla` are the
sub-quadratic ones.
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
from jax import Array, lax

from flaxformer_lite.sparse.grammar.plans import num_blocks
from flaxformer_lite.sparse.ops.online_softmax import (
    normalise,
    pad_to,
    partial_softmax,
    segment_mask,
)


@functools.partial(jax.jit, static_argnames=("top_k", "causal", "query_block"))
def topk_attention(
    query: Array,
    key: Array,
    value: Array,
    top_k: int,
    *,
    causal: bool = False,
    q_segments: Array | None = None,
    kv_segments: Array | None = None,
    query_block: int = 128,
) -> Array:
    """Each query attends to its ``top_k`` highest-scoring keys (the learned-pattern family).

    Scores are computed one query block at a time (memory ``B * n``, time
    ``n^2``); keys tied with the k-th score are kept. Gradients flow through
    the kept scores.
    """
    b, n, h, d = query.shape
    nb = num_blocks(n, query_block)
    npad = nb * query_block
    q = pad_to(jnp.swapaxes(query, 1, 2), npad, 2).reshape(b, h, nb, query_block, d)
    q = jnp.moveaxis(q, 2, 0) / math.sqrt(d)  # [nb, b, h, B, d]
    k = jnp.swapaxes(key, 1, 2)
    v = jnp.swapaxes(value, 1, 2)
    sq = None if q_segments is None else pad_to(q_segments, npad, 1).reshape(b, nb, query_block)
    kk = min(top_k, n)

    def one_block(args):
        a, qa = args
        scores = jnp.einsum("bhqd,bhkd->bhqk", qa, k)
        i = a * query_block + jnp.arange(query_block)[:, None]
        j = jnp.arange(n)[None, :]
        mask = (j <= i) if causal else jnp.ones((query_block, n), bool)
        mask = mask[None, None]
        if sq is not None:
            seg = segment_mask(sq[:, a][:, :, None], kv_segments[:, None, :])
            mask = mask & seg[:, None]
        masked = jnp.where(mask, scores, -jnp.inf)
        kth = lax.stop_gradient(lax.top_k(masked, kk)[0][..., -1:])
        keep = mask & (masked >= kth)
        part = partial_softmax(scores, keep, lambda p: jnp.einsum("bhqk,bhkv->bhqv", p, v))
        return normalise(part.o, part.l)

    out = lax.map(one_block, (jnp.arange(nb), q))  # [nb, b, h, B, v]
    out = jnp.moveaxis(out, 0, 2).reshape(b, h, npad, -1)[:, :, :n]
    return jnp.swapaxes(out, 1, 2).astype(query.dtype)
