"""Test oracles: the plainest possible formulas, written apart from the library code
they check (so a shared bug cannot make both sides agree)."""

import jax
import jax.numpy as jnp
import numpy as np


def masked_attention(query, key, value, pattern, *, q_segments=None, kv_segments=None):
    """softmax(q k^T / sqrt(d)) v with the pattern's dense ``[n, n]`` mask and segment ids
    (0 = padding); a query with nothing to attend outputs zeros. Differentiable (jnp)."""
    n, d = query.shape[1], query.shape[-1]
    mask = jnp.asarray(pattern.mask(n))[None, None]  # [1, 1, n, n]
    if q_segments is not None:
        same = (q_segments[:, :, None] == kv_segments[:, None, :]) & (kv_segments[:, None, :] != 0)
        mask = mask & same[:, None]
    scores = jnp.einsum("bqhd,bkhd->bhqk", query, key) / np.sqrt(d)
    scores = jnp.where(mask, scores, -jnp.inf)
    top = jnp.max(jnp.where(mask, scores, -1e30), axis=-1, keepdims=True)
    weights = jnp.where(mask, jnp.exp(scores - top), 0.0)
    total = weights.sum(-1, keepdims=True)
    weights = jnp.where(total > 0, weights / jnp.where(total > 0, total, 1.0), 0.0)
    return jnp.einsum("bhqk,bkhv->bqhv", weights, value)


def topk_attention(query, key, value, top_k, *, causal=False):
    """Dense top-k: each query keeps the keys whose score ties or beats its k-th best."""
    n, d = query.shape[1], query.shape[-1]
    scores = jnp.einsum("bqhd,bkhd->bhqk", query, key) / np.sqrt(d)
    mask = jnp.tril(jnp.ones((n, n), bool)) if causal else jnp.ones((n, n), bool)
    masked = jnp.where(mask, scores, -jnp.inf)
    kth = jnp.sort(masked, axis=-1)[..., -min(top_k, n)][..., None]
    keep = mask & (masked >= kth)
    scores = jnp.where(keep, scores, -jnp.inf)
    weights = jnp.exp(scores - scores.max(-1, keepdims=True))
    weights = weights / weights.sum(-1, keepdims=True)
    return jnp.einsum("bhqk,bkhv->bqhv", weights, value)


def dense_with_mask(q, k, v, mask, xp):
    """Masked dense attention ``[b, n, h, d]`` in q's precision, with numpy or jax.numpy
    as ``xp`` (float64 references and their gradients); a row with no allowed key gives
    0, as the fused kernels do."""
    s = xp.einsum("bqhd,bkhd->bhqk", q, k) / np.sqrt(q.shape[-1])
    s = xp.where(mask, s, -1e30)
    p = xp.where(mask, xp.exp(s - s.max(-1, keepdims=True)), 0.0)
    p = p / xp.maximum(p.sum(-1, keepdims=True), 1e-300)
    return xp.einsum("bhqk,bkhd->bqhd", p, v)


def relative_error(x, y) -> float:
    """||x - y|| / ||y|| (Frobenius), in float64."""
    x, y = np.asarray(x, np.float64), np.asarray(y, np.float64)
    return float(np.linalg.norm(x - y) / np.linalg.norm(y))


def random_qkvw(dtype, b, n, h, d, seed=0):
    """Query, key, value and a gradient weight ``[b, n, h, d]``, standard normal."""
    keys = jax.random.split(jax.random.key(seed), 4)
    return [jax.random.normal(x, (b, n, h, d), jnp.float32).astype(dtype) for x in keys]
