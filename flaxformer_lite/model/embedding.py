"""Token embeddings (shareable with the pre-softmax projection) and positions.

Legend: b batch, l length, m d_model, V vocabulary size.

* ``Embed``: ``[V, m]`` table; ``__call__`` looks tokens up and multiplies by
  sqrt(m) when ``scale`` is set (paper, Section 3.4); ``attend`` is the tied
  pre-softmax projection ``x E^T``.
* ``sinusoidal_positions(length, d_model)``: the paper's table,
  PE(pos, 2i) = sin(pos / 10000^(2i/m)), PE(pos, 2i+1) = cos(...), interleaved.
* ``SinusoidalPositions`` / ``LearnedPositions``: modules taking explicit
  positions ``[b, l]`` (packed rows restart at 0 per example; a decoding step
  passes its own position).
"""

from __future__ import annotations

import math

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
from jax import Array

from flaxformer_lite.model import partitioning as P


class Embed(nn.Module):
    """A token embedding table with an optional sqrt(d_model) scale."""

    vocab_size: int
    features: int
    scale: bool = True
    dtype: jnp.dtype = jnp.float32
    param_dtype: jnp.dtype = jnp.float32

    def setup(self):
        # stddev d^-1/2: scaled embeddings have unit variance, and tied logits x E^T are O(1).
        self.embedding = self.param(
            "embedding",
            P.param_init(nn.initializers.normal(stddev=self.features**-0.5), P.VOCAB, P.EMBED),
            (self.vocab_size, self.features),
            self.param_dtype,
        )

    def __call__(self, tokens: Array) -> Array:
        """``[b, l]`` ids -> ``[b, l, m]``."""
        if not jnp.issubdtype(jnp.asarray(tokens).dtype, jnp.integer):
            raise ValueError(f"token ids must be integers, got dtype {jnp.asarray(tokens).dtype}")
        # The lookup reads a whole table (gathered when the mesh splits it): XLA cannot
        # gather from a vocabulary split over devices into batch-split rows directly.
        table = P.constrain(self.embedding, None, None)
        x = jnp.take(table, tokens, axis=0).astype(self.dtype)
        x = P.constrain(x, P.BATCH, P.LENGTH, P.ACT_EMBED)
        if self.scale:
            x = x * jnp.asarray(math.sqrt(self.features), self.dtype)
        return x

    def attend(self, x: Array) -> Array:
        """Tied output projection: ``[b, l, m]`` -> logits ``[b, l, V]``."""
        logits = tied_logits(x, self.embedding.astype(self.dtype))
        return P.constrain(logits, P.BATCH, P.LENGTH, P.ACT_VOCAB)


@jax.custom_vjp
def tied_logits(x: Array, table: Array) -> Array:
    """``x E^T``; its backward computes dE as ``(x^T g)^T`` so the big ``[tokens, V]``
    gradient ``g`` is read in its own layout (autodiff's ``g^T x`` makes XLA:CPU
    write a transposed copy of ``g``, ~10% of a small model's step)."""
    return jnp.einsum("blm,vm->blv", x, table)


def _tied_logits_fwd(x, table):
    return tied_logits(x, table), (x, table)


def _tied_logits_bwd(residuals, g):
    x, table = residuals
    m, v = x.shape[-1], table.shape[0]
    d_x = jnp.einsum("blv,vm->blm", g, table)
    d_table = (x.reshape(-1, m).T @ g.reshape(-1, v)).T
    return d_x.astype(x.dtype), d_table.astype(table.dtype)


tied_logits.defvjp(_tied_logits_fwd, _tied_logits_bwd)


def _inverse_frequencies(d_model: int) -> np.ndarray:
    """1 / 10000^(2i/d_model) for i = 0 .. d_model/2 - 1, in float64."""
    two_i = np.arange(0, d_model, 2, dtype=np.float64)
    return np.power(10000.0, -two_i / d_model)


def sinusoidal_positions(length: int, d_model: int) -> np.ndarray:
    """The paper's table ``[length, d_model]`` (float64), sin on even dims, cos on odd."""
    if d_model % 2:
        raise ValueError(f"d_model={d_model} must be even for sinusoidal positions")
    angles = np.arange(length, dtype=np.float64)[:, None] * _inverse_frequencies(d_model)[None]
    table = np.empty((length, d_model), dtype=np.float64)
    table[:, 0::2] = np.sin(angles)
    table[:, 1::2] = np.cos(angles)
    return table


def sinusoidal_encoding(positions: Array, d_model: int, dtype=jnp.float32) -> Array:
    """PE for explicit positions ``[b, l]`` -> ``[b, l, d_model]`` (computed, no table)."""
    wide = jnp.promote_types(dtype, jnp.float32)  # float64 when asked, else float32
    inv = jnp.asarray(_inverse_frequencies(d_model), wide)
    angles = jnp.asarray(positions, wide)[..., None] * inv
    # Interleave: stack (sin, cos) on a new last axis, then flatten pairs.
    pe = jnp.stack([jnp.sin(angles), jnp.cos(angles)], axis=-1)
    return pe.reshape(*pe.shape[:-2], d_model).astype(dtype)


class SinusoidalPositions(nn.Module):
    """Adds nothing learnable: returns the paper's encoding for the given positions."""

    d_model: int
    dtype: jnp.dtype = jnp.float32

    def __call__(self, positions: Array) -> Array:
        return sinusoidal_encoding(positions, self.d_model, self.dtype)


class LearnedPositions(nn.Module):
    """A learned ``[max_len, d_model]`` table (the paper's Table 3, row E)."""

    max_len: int
    d_model: int
    dtype: jnp.dtype = jnp.float32
    param_dtype: jnp.dtype = jnp.float32

    @nn.compact
    def __call__(self, positions: Array) -> Array:
        table = self.param(
            "embedding",
            P.param_init(nn.initializers.normal(stddev=0.02), P.POSITION, P.EMBED),
            (self.max_len, self.d_model),
            self.param_dtype,
        )
        return jnp.take(table, positions, axis=0).astype(self.dtype)


def rotate(x: Array, positions: Array) -> Array:
    """Rotary positions (RoFormer, Su et al. 2021): ``x [b, l, h, d]`` with each pair of
    dims ``(2i, 2i+1)`` turned by the angle ``position / 10000^(2i/d)``, the paper's
    frequencies. Applied to queries and keys, their dot product depends on the positions
    only through their difference (``model.positional=rotary``; nothing is added to the
    embeddings)."""
    d = x.shape[-1]
    wide = jnp.promote_types(x.dtype, jnp.float32)
    angles = jnp.asarray(positions, wide)[:, :, None, None] * jnp.asarray(
        _inverse_frequencies(d), wide
    )  # [b, l, 1, d/2]
    cos, sin = jnp.cos(angles), jnp.sin(angles)
    even, odd = x[..., 0::2].astype(wide), x[..., 1::2].astype(wide)
    turned = jnp.stack([even * cos - odd * sin, even * sin + odd * cos], axis=-1)
    return turned.reshape(x.shape).astype(x.dtype)


def default_positions(batch: int, length: int) -> Array:
    """0 .. length-1 for every row: ``[batch, length]`` int32."""
    return jnp.broadcast_to(jnp.arange(length, dtype=jnp.int32), (batch, length))
