"""Position-wise feed-forward network: act(x W1 + b1) W2 + b2 (paper: act = ReLU)."""

from __future__ import annotations

import flax.linen as nn
import jax
from jax import Array

from flaxformer_lite.config.model import ModelConfig
from flaxformer_lite.model import partitioning as P
from flaxformer_lite.model.dropout import Dropout

ACTIVATIONS = {
    "relu": jax.nn.relu,
    "gelu": jax.nn.gelu,
    "silu": jax.nn.silu,
    "tanh": jax.numpy.tanh,
}


class FeedForward(nn.Module):
    """``[b, l, d_model]`` -> ``[b, l, d_model]`` through a ``d_ff`` hidden layer."""

    config: ModelConfig

    @nn.compact
    def __call__(self, x: Array, *, deterministic: bool = True) -> Array:
        c = self.config
        # W1 splits its columns (the hidden units) over the model axis, W2 its rows.
        dense = lambda features, name, axes: nn.Dense(
            features,
            dtype=c.compute_dtype,
            param_dtype=c.parameter_dtype,
            kernel_init=P.param_init(nn.initializers.xavier_uniform(), *axes),
            bias_init=P.param_init(nn.initializers.zeros_init(), axes[1]),
            name=name,
        )
        h = ACTIVATIONS[c.activation](dense(c.d_ff, "wi", (P.EMBED, P.MLP))(x))
        h = P.constrain(h, P.BATCH, P.LENGTH, P.ACT_MLP)
        h = Dropout(c.ffn_dropout, c.dropout_bits)(h, deterministic=deterministic)
        return dense(c.d_model, "wo", (P.MLP, P.EMBED))(h)
