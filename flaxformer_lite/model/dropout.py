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

import contextlib
import contextvars
import math

import flax.linen as nn
import jax
import jax.numpy as jnp
from flax.core.scope import LazyRng
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


# Inside a scanned layer stack (model/stacks.py): (the layer's traced index, the number
# of layers, the rng path of the stack's scope, which ends with the stack's name, and
# the keys drawn so far per module path and stream in this trace of the body).
_SCANNED: contextvars.ContextVar = contextvars.ContextVar("scanned_layer", default=None)


@contextlib.contextmanager
def scanned_layer(index: Array, length: int, stack_path: tuple):
    """While a scanned stack traces its body: :func:`make_rng` draws the keys the
    unrolled layer ``index`` would (see there)."""
    token = _SCANNED.set((index, length, tuple(stack_path), {}))
    try:
        yield
    finally:
        _SCANNED.reset(token)


def make_rng(module: nn.Module, name: str = "dropout") -> Array:
    """``module.make_rng(name)``, the same key whether the layers are unrolled or scanned.

    flax derives a module's key from the call's key and the module's whole path
    (``encoder/layer_1/self_attention/...``), hashed at once. A scanned stack's body is
    one module path (``encoder/layers/layer/...``) traced once for every layer, and flax
    would split the key per layer instead: other dropout masks than the unrolled model's
    for the same seed. Here the path of each unrolled layer is hashed (statically, one
    key per layer, through flax's own ``LazyRng``) and the traced layer index picks
    one, so ``model.scan_layers`` changes how the step compiles, not what it computes.
    The draws are counted here, per trace of the body: flax's own counter goes on
    across the two traces ``nn.scan`` makes of it.
    """
    key = module.make_rng(name)  # the counter's bookkeeping and flax's checks
    scanned = _SCANNED.get()
    scope = module.scope
    if scanned is None or name not in scope.rngs:
        return key
    index, length, stack_path, drawn = scanned
    lazy = scope.rngs[name]
    path = tuple(lazy.suffix)
    body = len(stack_path)
    if path[:body] != stack_path or len(path) <= body:
        return key  # not under the stack's body (cannot happen; keep flax's key)
    counter = drawn[path, name] = drawn.get((path, name), 0) + 1
    keys = [
        LazyRng(lazy.rng, (*stack_path[:-1], f"layer_{i}", *path[body + 1 :], counter))
        for i in range(length)
    ]
    keys = [k.as_jax_rng() for k in keys]
    typed = jax.dtypes.issubdtype(keys[0].dtype, jax.dtypes.prng_key)
    data = jnp.stack([jax.random.key_data(k) if typed else k for k in keys])[index]
    return jax.random.wrap_key_data(data, impl=jax.random.key_impl(keys[0])) if typed else data


class Dropout(nn.Module):
    """``nn.Dropout`` with the cheap mask above; uses the 'dropout' rng stream
    (:func:`make_rng`)."""

    rate: float
    bits: int = 8
    whole_tokens: bool = False  # word dropout (see ``dropout``)

    @nn.compact
    def __call__(self, x: Array, *, deterministic: bool) -> Array:
        if deterministic or self.rate <= 0.0:
            return x
        return dropout(x, self.rate, make_rng(self), self.bits, self.whole_tokens)
