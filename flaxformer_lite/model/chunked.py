"""Memory-efficient dense attention: chunks of queries and keys with an online softmax.

``model.attention_impl=chunked`` computes the same softmax(QK^T / sqrt(d)) V as the
plain kernel without ever holding the ``[n, m]`` scores: queries are taken ``chunk``
at a time (``lax.map``), and each query chunk walks over the key chunks (``lax.scan``)
keeping the running max, the running sum of ``exp(score - max)`` and the unnormalised
output (the online-softmax identity of Milakov & Gimelshein 2018, as FlashAttention
uses it). The backward pass is written by hand (``jax.custom_vjp``) and recomputes
each chunk's probabilities from the saved log-partition, so training also needs only
O(n) memory beyond q, k, v and the output: dense attention at 16k-32k tokens on a
machine where the plain kernel's ``n x n`` weights do not fit
(benchmarks/attention.py). Values and gradients equal the plain kernel's
(tests/test_chunked.py, float64).

Masks are built per chunk from O(n) descriptions: key padding (keys past the real
length), ``causal``, and segment ids (packed sequences: a query sees keys of its own
segment, none of segment 0). A dense ``[b, 1, n, m]`` boolean ``mask`` is accepted too
(cross-attention's padding mask), sliced per chunk; it costs n*m bytes, not floats.
With ``causal``, the chunk pairs above the diagonal are skipped (``lax.cond``) in
both passes, so causal attention does about half the work of the full square at long
lengths.

Arrays are ``[b, n, h, d]`` as everywhere in the project; the math runs in the
inputs' dtype except the softmax statistics, which are float32 (or float64 for
float64 inputs).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import Array, lax

from flaxformer_lite.sparse.ops.online_softmax import FLOOR, NEG, pad_to

DEFAULT_CHUNK = 512
_SKIP_ABOVE_DIAGONAL = True  # off only for the A/B in experiments/performance/causal_chunks.py


def _skips(statics) -> bool:
    """Whether chunk pairs above the diagonal are skipped (``lax.cond``; without
    causality every pair is needed, and a cond there costs ~10%)."""
    return _SKIP_ABOVE_DIAGONAL and statics[3]


def _pair_visible(statics, i, j) -> Array:
    """Whether some query of chunk ``i`` may see a key of chunk ``j`` (causal)."""
    cq, ck = statics[:2]
    return j * ck <= i * cq + cq - 1


def chunked_attention(
    query: Array,
    key: Array,
    value: Array,
    *,
    mask: Array | None = None,
    q_segments: Array | None = None,
    k_segments: Array | None = None,
    causal: bool = False,
    scale: float | None = None,
    chunk: int = DEFAULT_CHUNK,
) -> Array:
    """Dense attention ``[b, n, h, d] x [b, m, h, d] x [b, m, h, v] -> [b, n, h, v]``.

    Args:
      mask: optional boolean, broadcastable to ``[b, 1, n, m]`` (True = may attend).
      q_segments, k_segments: optional ``[b, n]`` / ``[b, m]`` segment ids (0 = padding).
      causal: query ``i`` sees keys ``<= i``.
      scale: score scale; ``None`` = ``1 / sqrt(d)``.
      chunk: queries and keys per chunk (n and m are padded up to a multiple).
    A query that may attend nothing outputs zeros (as the plain kernel's masked rows).
    """
    if (q_segments is None) != (k_segments is None):
        raise ValueError("give both q_segments and k_segments, or neither")
    b, n, h, d = query.shape
    m = key.shape[1]
    scale = d**-0.5 if scale is None else scale
    cq, ck = min(chunk, n), min(chunk, m)
    n_pad, m_pad = -(-n // cq) * cq, -(-m // ck) * ck
    q = pad_to(jnp.swapaxes(query, 1, 2), n_pad, 2)  # [b, h, n, d]
    k = pad_to(jnp.swapaxes(key, 1, 2), m_pad, 2)
    v = pad_to(jnp.swapaxes(value, 1, 2), m_pad, 2)
    aux = {}
    if mask is not None:
        full = jnp.broadcast_to(mask, (mask.shape[0], 1, n, m))
        aux["mask"] = jnp.pad(full, ((0, 0), (0, 0), (0, n_pad - n), (0, m_pad - m)))
    if q_segments is not None:
        aux["q_seg"] = pad_to(q_segments, n_pad, 1)
        aux["k_seg"] = pad_to(k_segments, m_pad, 1)
    out = _attention(q, k, v, aux, (cq, ck, m, causal, float(scale)))
    return jnp.swapaxes(out[:, :, :n], 1, 2)


def _chunk_mask(aux, statics, i, j):
    """Boolean ``[b or 1, 1, cq, ck]`` for query chunk ``i`` and key chunk ``j``."""
    cq, ck, m, causal, _ = statics
    q_pos = i * cq + jnp.arange(cq)
    k_pos = j * ck + jnp.arange(ck)
    keep = (k_pos < m)[None, :]
    if causal:
        keep = keep & (k_pos[None, :] <= q_pos[:, None])
    keep = keep[None, None]
    if "q_seg" in aux:
        sq = lax.dynamic_slice_in_dim(aux["q_seg"], i * cq, cq, 1)
        sk = lax.dynamic_slice_in_dim(aux["k_seg"], j * ck, ck, 1)
        keep = keep & ((sq[:, :, None] == sk[:, None, :]) & (sk[:, None, :] != 0))[:, None]
    if "mask" in aux:
        part = lax.dynamic_slice_in_dim(aux["mask"], i * cq, cq, 2)
        keep = keep & lax.dynamic_slice_in_dim(part, j * ck, ck, 3)
    return keep


def _stat_dtype(x: Array):
    return jnp.float64 if x.dtype == jnp.float64 else jnp.float32


def _forward(q, k, v, aux, statics):
    """(output [b, h, n, v], log-partition [b, h, n]) chunk by chunk."""
    cq, ck, _, _, scale = statics
    b, h, n, _ = q.shape
    nq, nk = n // cq, k.shape[2] // ck
    st = _stat_dtype(q)

    def query_chunk(i):
        qi = lax.dynamic_slice_in_dim(q, i * cq, cq, 2)

        def key_chunk(carry, j):
            if not _skips(statics):
                return attend(carry, j), None
            return lax.cond(_pair_visible(statics, i, j), attend, lambda c, _: c, carry, j), None

        def attend(carry, j):
            m_run, l_run, acc = carry
            kj = lax.dynamic_slice_in_dim(k, j * ck, ck, 2)
            vj = lax.dynamic_slice_in_dim(v, j * ck, ck, 2)
            s = jnp.einsum("bhqd,bhkd->bhqk", qi, kj).astype(st) * scale
            s = jnp.where(_chunk_mask(aux, statics, i, j), s, NEG)
            m_new = jnp.maximum(m_run, jnp.max(s, axis=-1))
            p = jnp.exp(s - m_new[..., None])
            shrink = jnp.exp(m_run - m_new)
            l_new = l_run * shrink + p.sum(-1)
            pv = jnp.einsum("bhqk,bhkv->bhqv", p.astype(v.dtype), vj)
            return m_new, l_new, acc * shrink[..., None].astype(acc.dtype) + pv

        init = (
            jnp.full((b, h, cq), FLOOR, st),
            jnp.zeros((b, h, cq), st),
            jnp.zeros((b, h, cq, v.shape[-1]), v.dtype),
        )
        (m_run, l_run, acc), _ = lax.scan(key_chunk, init, jnp.arange(nk))
        seen = l_run > 0
        out = jnp.where(seen[..., None], acc / jnp.where(seen, l_run, 1.0)[..., None], 0.0)
        lse = jnp.where(seen, m_run + jnp.log(jnp.where(seen, l_run, 1.0)), 0.0)
        return out.astype(v.dtype), lse

    outs, lses = lax.map(query_chunk, jnp.arange(nq))  # [nq, b, h, cq, ...]
    out = jnp.moveaxis(outs, 0, 2).reshape(b, h, n, v.shape[-1])
    return out, jnp.moveaxis(lses, 0, 2).reshape(b, h, n)


@functools.partial(jax.custom_vjp, nondiff_argnums=(4,))
def _attention(q, k, v, aux, statics):
    return _forward(q, k, v, aux, statics)[0]


def _attention_fwd(q, k, v, aux, statics):
    out, lse = _forward(q, k, v, aux, statics)
    return out, (q, k, v, aux, out, lse)


def _attention_bwd(statics, residuals, d_out):
    """The FlashAttention backward: per key chunk, walk the query chunks, recompute
    ``p = exp(s - lse)``; ``dS = p * (dO V^T - rowsum(dO * O))``."""
    q, k, v, aux, out, lse = residuals
    cq, ck, _, _, scale = statics
    b, h, n, dk = q.shape
    nq, nk = n // cq, k.shape[2] // ck
    st = _stat_dtype(q)
    delta = jnp.sum(d_out.astype(st) * out.astype(st), axis=-1)  # [b, h, n]

    def key_chunk(dq, j):
        kj = lax.dynamic_slice_in_dim(k, j * ck, ck, 2)
        vj = lax.dynamic_slice_in_dim(v, j * ck, ck, 2)

        def query_chunk(carry, i):
            if not _skips(statics):
                return pair(carry, i)
            skipped = (carry, jnp.zeros((b, h, cq, dk), q.dtype))
            return lax.cond(_pair_visible(statics, i, j), pair, lambda c, _: skipped, carry, i)

        def pair(carry, i):
            dk_j, dv_j = carry
            qi = lax.dynamic_slice_in_dim(q, i * cq, cq, 2)
            doi = lax.dynamic_slice_in_dim(d_out, i * cq, cq, 2)
            lse_i = lax.dynamic_slice_in_dim(lse, i * cq, cq, 2)
            delta_i = lax.dynamic_slice_in_dim(delta, i * cq, cq, 2)
            s = jnp.einsum("bhqd,bhkd->bhqk", qi, kj).astype(st) * scale
            p = jnp.where(_chunk_mask(aux, statics, i, j), jnp.exp(s - lse_i[..., None]), 0.0)
            dv_j = dv_j + jnp.einsum("bhqk,bhqv->bhkv", p.astype(v.dtype), doi)
            dp = jnp.einsum("bhqv,bhkv->bhqk", doi, vj).astype(st)
            ds = (p * (dp - delta_i[..., None]) * scale).astype(q.dtype)
            dk_j = dk_j + jnp.einsum("bhqk,bhqd->bhkd", ds, qi)
            return (dk_j, dv_j), jnp.einsum("bhqk,bhkd->bhqd", ds, kj)

        init = (jnp.zeros_like(kj), jnp.zeros_like(vj))
        (dk_j, dv_j), dq_parts = lax.scan(query_chunk, init, jnp.arange(nq))
        return dq + dq_parts, (dk_j, dv_j)

    dq0 = jnp.zeros((nq, b, h, cq, dk), q.dtype)
    dq, (dks, dvs) = lax.scan(key_chunk, dq0, jnp.arange(nk))
    dq = jnp.moveaxis(dq, 0, 2).reshape(q.shape)
    dk_all = jnp.moveaxis(dks, 0, 2).reshape(k.shape)
    dv_all = jnp.moveaxis(dvs, 0, 2).reshape(v.shape)
    return dq, dk_all, dv_all, None


_attention.defvjp(_attention_fwd, _attention_bwd)
