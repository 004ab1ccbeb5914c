"""Scaled dot-product attention and pluggable score functions.

Shape legend for the einsums below:
  b batch, q query length, k key/value length, h heads, d head dim (query/key),
  v head dim (values), a hidden width of the additive score.

Arrays are ``[b, length, h, d]``; masks are boolean ``[b or 1, h or 1, q, k]``
with True = may attend.

A score function maps ``(query [b q h d], key [b k h d])`` to logits
``[b h q k]``. They live in one registry: ``register_score_fn(name)`` on a
factory ``(*, num_heads, head_dim, dtype, param_dtype, module_name) -> callable``
adds one, and the model config accepts its name from then on. Factories of
parameter-free scores return plain functions; parameterised scores
(``additive``, ``bilinear``) return flax modules named ``module_name``, which
become submodules of the attention layer that builds them.

Fully masked query rows (e.g. a padding query) get all-zero weights, hence a
zero output vector, never NaN.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import flax.linen as nn
import jax
import jax.numpy as jnp
from jax import Array

from flaxformer_lite.config import extensions, rules
from flaxformer_lite.model import partitioning as P
from flaxformer_lite.model.dropout import dropout

ScoreFn = Callable[[Array, Array], Array]
ScoreFactory = Callable[..., ScoreFn]

_SCORE_FNS: dict[str, ScoreFactory] = {}


def register_score_fn(name: str) -> Callable[[ScoreFactory], ScoreFactory]:
    """Decorator: register ``factory(*, num_heads, head_dim, dtype, param_dtype, module_name)``."""

    def wrap(factory: ScoreFactory) -> ScoreFactory:
        if not extensions.claim("score function", name, factory, taken=name in _SCORE_FNS):
            return factory  # the same code again (a run's copy of an extension)
        _SCORE_FNS[name] = factory
        rules.add_score_function(name)  # a valid model.score_fn from now on
        return factory

    return wrap


def score_fn_names() -> tuple[str, ...]:
    """Names accepted by ``ModelConfig.score_fn``."""
    return tuple(_SCORE_FNS)


def make_score_fn(
    name: str,
    *,
    num_heads: int,
    head_dim: int,
    dtype: jnp.dtype = jnp.float32,
    param_dtype: jnp.dtype = jnp.float32,
    module_name: str | None = None,
) -> ScoreFn:
    """Build the registered score function ``name``.

    Called inside a compact module, a parameterised score becomes that module's
    submodule named ``module_name`` (its parameters live there).
    """
    if name not in _SCORE_FNS:
        raise ValueError(f"unknown score function {name!r}; registered: {', '.join(_SCORE_FNS)}")
    return _SCORE_FNS[name](
        num_heads=num_heads,
        head_dim=head_dim,
        dtype=dtype,
        param_dtype=param_dtype,
        module_name=module_name,
    )


# Parameter-free scores ------------------------------------------------------


def scaled_dot_scores(query: Array, key: Array) -> Array:
    """QK^T / sqrt(d_k): the paper's score."""
    query = query / jnp.sqrt(jnp.asarray(query.shape[-1], query.dtype))
    return jnp.einsum("bqhd,bkhd->bhqk", query, key)


def dot_scores(query: Array, key: Array) -> Array:
    """QK^T without scaling (the paper's 'dot-product attention' baseline)."""
    return jnp.einsum("bqhd,bkhd->bhqk", query, key)


@register_score_fn("scaled_dot")
def _scaled_dot_factory(**_) -> ScoreFn:
    return scaled_dot_scores


@register_score_fn("dot")
def _dot_factory(**_) -> ScoreFn:
    return dot_scores


# Parameterised scores -------------------------------------------------------


class AdditiveScore(nn.Module):
    """Additive (Bahdanau) score per head: v^T tanh(W1 q + W2 k).

    Memory is O(b h q k a): meant for ablations at modest lengths.
    """

    num_heads: int
    head_dim: int
    hidden_dim: int | None = None  # a; defaults to head_dim
    dtype: jnp.dtype = jnp.float32
    param_dtype: jnp.dtype = jnp.float32

    @nn.compact
    def __call__(self, query: Array, key: Array) -> Array:
        a = self.hidden_dim or self.head_dim
        init = nn.initializers.lecun_normal(in_axis=-2, out_axis=-1, batch_axis=(0,))
        shape = (self.num_heads, self.head_dim, a)
        init = P.param_init(init, P.HEADS, P.HEAD_DIM, None)
        w_q = self.param("w_query", init, shape, self.param_dtype).astype(self.dtype)
        w_k = self.param("w_key", init, shape, self.param_dtype).astype(self.dtype)
        v = self.param(
            "v",
            P.param_init(nn.initializers.normal(1.0 / math.sqrt(a)), P.HEADS, None),
            (self.num_heads, a),
            self.param_dtype,
        ).astype(self.dtype)
        q = jnp.einsum("bqhd,hda->bhqa", query, w_q)
        k = jnp.einsum("bkhd,hda->bhka", key, w_k)
        hidden = jnp.tanh(q[:, :, :, None, :] + k[:, :, None, :, :])
        return jnp.einsum("bhqka,ha->bhqk", hidden, v)


class BilinearScore(nn.Module):
    """Bilinear (Luong 'general') score per head: q^T W k."""

    num_heads: int
    head_dim: int
    dtype: jnp.dtype = jnp.float32
    param_dtype: jnp.dtype = jnp.float32

    @nn.compact
    def __call__(self, query: Array, key: Array) -> Array:
        # stddev 1/d keeps q^T W k at unit variance for unit-variance q, k.
        w = self.param(
            "w",
            P.param_init(nn.initializers.normal(1.0 / self.head_dim), P.HEADS, None, None),
            (self.num_heads, self.head_dim, self.head_dim),
            self.param_dtype,
        ).astype(self.dtype)
        return jnp.einsum("bqhd,hde,bkhe->bhqk", query, w, key)


@register_score_fn("additive")
def _additive_factory(*, num_heads, head_dim, dtype, param_dtype, module_name) -> ScoreFn:
    return AdditiveScore(
        num_heads, head_dim, dtype=dtype, param_dtype=param_dtype, name=module_name
    )


@register_score_fn("bilinear")
def _bilinear_factory(*, num_heads, head_dim, dtype, param_dtype, module_name) -> ScoreFn:
    return BilinearScore(
        num_heads, head_dim, dtype=dtype, param_dtype=param_dtype, name=module_name
    )


# The core ---------------------------------------------------------------------


def _resolve_score_fn(score_fn: str | ScoreFn, query: Array) -> ScoreFn:
    if callable(score_fn):
        return score_fn
    fn = make_score_fn(score_fn, num_heads=query.shape[-2], head_dim=query.shape[-1])
    if isinstance(fn, nn.Module):
        raise ValueError(
            f"score function {score_fn!r} has parameters; build it with make_score_fn() "
            "inside a module (MultiHeadAttention does) and pass the callable as score_fn"
        )
    return fn


def _check_shapes(query: Array, key: Array, value: Array | None) -> None:
    if query.ndim != 4 or key.ndim != 4:
        raise ValueError(
            f"query and key must be [batch, length, heads, head_dim]; got {query.shape}, "
            f"{key.shape}"
        )
    if query.shape[0] != key.shape[0] or query.shape[2] != key.shape[2]:
        raise ValueError(f"query {query.shape} and key {key.shape} differ in batch or heads")
    if value is not None and (value.ndim != 4 or value.shape[:3] != key.shape[:3]):
        raise ValueError(f"value {value.shape} must match key {key.shape} in batch/length/heads")


def attention_weights(
    query: Array,
    key: Array,
    mask: Array | None = None,
    *,
    score_fn: str | ScoreFn = "scaled_dot",
) -> Array:
    """Softmax attention weights ``[b, h, q, k]``.

    Masked logits are replaced by the most negative finite value of the logits'
    dtype before a float32 (or wider) softmax; masked weights are then set to
    exactly zero, so a fully masked row is all zeros.
    """
    _check_shapes(query, key, None)
    logits = _resolve_score_fn(score_fn, query)(query, key)
    if mask is not None:
        logits = jnp.where(mask, logits, jnp.finfo(logits.dtype).min)
    softmax_dtype = jnp.promote_types(logits.dtype, jnp.float32)
    weights = jax.nn.softmax(logits.astype(softmax_dtype), axis=-1)
    if mask is not None:
        weights = jnp.where(mask, weights, 0.0)
    return weights.astype(query.dtype)


def dropout_weights(weights: Array, rate: float, rng: Array | None, bits: int = 32) -> Array:
    """Inverted dropout on attention weights (``bits``: see model/dropout.py)."""
    if rate <= 0.0:
        return weights
    if rng is None:
        raise ValueError("attention dropout needs dropout_rng when deterministic=False")
    return dropout(weights, rate, rng, bits)


def dot_product_attention(
    query: Array,
    key: Array,
    value: Array,
    mask: Array | None = None,
    *,
    score_fn: str | ScoreFn = "scaled_dot",
    dropout_rate: float = 0.0,
    deterministic: bool = True,
    dropout_rng: Array | None = None,
    return_weights: bool = False,
) -> Array | tuple[Array, Array]:
    """softmax(score(Q, K)) V on ``[b, length, h, d]`` arrays.

    Args:
      query: ``[b, q, h, d]``; key: ``[b, k, h, d]``; value: ``[b, k, h, v]``.
      mask: boolean, broadcastable to ``[b, h, q, k]``; True = may attend.
      score_fn: a registered name without parameters (``scaled_dot``, ``dot``)
        or any callable ``(query, key) -> [b, h, q, k]`` logits.
      dropout_rate, deterministic, dropout_rng: dropout on the weights.
      return_weights: also return the (pre-dropout) weights ``[b, h, q, k]``.
    Returns:
      ``[b, q, h, v]`` (and the weights if asked).
    """
    _check_shapes(query, key, value)
    weights = attention_weights(query, key, mask, score_fn=score_fn)
    dropped = weights if deterministic else dropout_weights(weights, dropout_rate, dropout_rng)
    out = jnp.einsum("bhqk,bkhv->bqhv", dropped, value)
    return (out, weights) if return_weights else out
