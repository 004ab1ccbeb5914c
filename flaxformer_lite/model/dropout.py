"""Inverted dropout with cheap randomness.

Random bits dominate dropout's cost on CPU (threefry evaluates one 32-bit
block per element). With ``bits=8`` every 32-bit block is split into four
8-bit numbers, so a mask costs a quarter of the random-number work; the
rate is then a multiple of 1/256 (0.1 -> 26/256 = 0.1016) and kept values
are scaled by 256/(256 - 26) so the expectation is unchanged. ``bits=32`` is
the exact-rate path. ``ModelConfig.dropout_bits`` selects it for every
dropout of the model (embeddings, residuals, attention weights, FFN).
"""

from __future__ import annotations

import math

import flax.linen as nn
import jax
import jax.numpy as jnp
from jax import Array, lax

DROPOUT_BITS = (8, 16, 32)


def keep_mask(
    rng: Array, shape: tuple[int, ...], rate: float, bits: int = 8
) -> tuple[Array, float]:
    """(boolean keep mask, scale for kept values) for a dropout ``rate``."""
    if bits not in DROPOUT_BITS:
        raise ValueError(f"dropout bits={bits}; choose one of {DROPOUT_BITS}")
    if bits == 32:
        return jax.random.bernoulli(rng, 1.0 - rate, shape), 1.0 / (1.0 - rate)
    levels = 2**bits
    threshold = min(max(round(rate * levels), 1), levels - 1)
    n = math.prod(shape)
    per_word = 32 // bits
    words = jax.random.bits(rng, (-(-n // per_word),), jnp.uint32)
    dtype = jnp.uint8 if bits == 8 else jnp.uint16
    draws = lax.bitcast_convert_type(words, dtype).reshape(-1)[:n].reshape(shape)
    return draws >= threshold, levels / (levels - threshold)


def dropout(x: Array, rate: float, rng: Array, bits: int = 8, whole_tokens: bool = False) -> Array:
    """Inverted dropout of ``x``'s elements; ``whole_tokens``: word dropout instead,
    zeroing whole vectors ``x[..., t, :]`` and not rescaling the kept ones (a dropped
    token reads as "some word was here", Gal & Ghahramani 2016)."""
    if rate <= 0.0:
        return x
    if whole_tokens:
        keep, _ = keep_mask(rng, x.shape[:-1] + (1,), rate, bits)
        return jnp.where(keep, x, jnp.zeros((), x.dtype))
    keep, scale = keep_mask(rng, x.shape, rate, bits)
    return jnp.where(keep, x * jnp.asarray(scale, x.dtype), jnp.zeros((), x.dtype))


class Dropout(nn.Module):
    """``nn.Dropout`` with the cheap mask above; uses the 'dropout' rng stream."""

    rate: float
    bits: int = 8
    whole_tokens: bool = False  # word dropout (see ``dropout``)

    @nn.compact
    def __call__(self, x: Array, *, deterministic: bool) -> Array:
        if deterministic or self.rate <= 0.0:
            return x
        return dropout(x, self.rate, self.make_rng("dropout"), self.bits, self.whole_tokens)
