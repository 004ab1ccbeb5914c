"""Decoder-only language model: the Transformer's decoder without cross-attention.

``LanguageModel(config)(tokens)`` returns logits ``[b, l, V]`` where position i
predicts ``tokens[:, i]`` from ``tokens[:, :i]`` (the input is shifted right
behind BOS, exactly as the encoder-decoder's targets). Packed rows pass
``positions`` and ``segmentation``. Step-by-step decoding uses the same cache
protocol as ``Transformer.decode`` (``decode=True``, tokens fed unshifted).

Layers come from ``num_decoder_layers``; the output projection is tied to the
embedding unless ``tie_embeddings="none"``.
"""

from __future__ import annotations

import flax.linen as nn
from jax import Array

from flaxformer_lite.config.model import ModelConfig
from flaxformer_lite.model.masks import (
    SegmentIds,
    combine_masks,
    make_causal_mask,
    make_padding_mask,
    make_segment_mask,
)
from flaxformer_lite.model.transformer import Decoder, shift_right


class LanguageModel(nn.Module):
    """Decoder-only Transformer: ``(tokens [b, l]) -> logits [b, l, V]``, causal (see the
    module docstring); ``decode=True`` steps with a KV cache like ``Transformer.decode``."""

    config: ModelConfig

    def setup(self):
        c = self.config
        self.decoder = Decoder(c, has_cross_attention=False, tie_output=c.tie_embeddings != "none")

    def __call__(
        self,
        tokens: Array,
        *,
        positions: Array | None = None,
        segmentation: Array | None = None,
        deterministic: bool = True,
        decode: bool = False,
    ) -> Array:
        c = self.config
        if decode:
            return self.decoder(
                None, tokens, None, None, positions, deterministic=deterministic, decode=True
            )
        if c.token_masks:  # token-level ids; the layers bring causality
            mask = SegmentIds.from_tokens(tokens, segmentation, c.pad_id)
        else:
            mask = combine_masks(
                make_padding_mask(tokens, tokens, c.pad_id),
                make_causal_mask(tokens.shape[1]),
                None if segmentation is None else make_segment_mask(segmentation, segmentation),
            )
        return self.decoder(
            None,
            shift_right(tokens, c.bos_id, positions),
            mask,
            None,
            positions,
            deterministic=deterministic,
        )
