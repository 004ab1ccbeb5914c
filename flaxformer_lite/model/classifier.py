"""A sequence classifier: the Transformer's encoder, mean-pooled, and one dense layer.

``Classifier(config)(inputs)`` returns logits ``[b, 1, C]`` (``C = model.num_classes``)
for token ids ``inputs [b, s]``: the encoder (its self-attention under
``model.attention_pattern`` like any encoder), the mean of its outputs over the real
(non-padding) tokens, then a dense layer. The singleton axis lets the training loss
treat a row's label as a one-token target (``data.task=classify``; the batch's
``targets [b, 1]`` and ``weights [b, 1]``), so loss, accuracy and their sums over
devices are the language model's, unchanged. This file is the worked example of a new
task head in docs/extending.md.
"""

from __future__ import annotations

import flax.linen as nn
import jax.numpy as jnp
from jax import Array

from flaxformer_lite.config.model import ModelConfig
from flaxformer_lite.model import partitioning as P
from flaxformer_lite.model.masks import SegmentIds, make_padding_mask
from flaxformer_lite.model.transformer import Encoder


class Classifier(nn.Module):
    """``(inputs [b, s]) -> logits [b, 1, num_classes]``: encoder, mean pooling, dense."""

    config: ModelConfig

    @nn.compact
    def __call__(self, inputs: Array, *, deterministic: bool = True) -> Array:
        c = self.config
        if c.token_masks:
            mask = SegmentIds.from_tokens(inputs, None, c.pad_id)
        else:
            mask = make_padding_mask(inputs, inputs, c.pad_id)
        x = Encoder(c, name="encoder")(inputs, mask, deterministic=deterministic)
        real = (inputs != c.pad_id)[..., None].astype(x.dtype)
        pooled = jnp.sum(x * real, axis=1) / jnp.maximum(jnp.sum(real, axis=1), 1)
        logits = nn.Dense(
            c.num_classes,
            dtype=c.compute_dtype,
            param_dtype=c.parameter_dtype,
            kernel_init=P.param_init(nn.initializers.xavier_uniform(), P.EMBED, None),
            name="head",
        )(pooled)
        return logits[:, None, :].astype(jnp.promote_types(logits.dtype, jnp.float32))
