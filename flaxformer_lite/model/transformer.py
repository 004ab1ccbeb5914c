"""The encoder-decoder Transformer (Vaswani et al. 2017, Figure 1).

Legend: b batch, s source length, t target length, m d_model, V vocabulary.

Masks are built once, at the top (``Transformer.encode`` / ``.decode``), from
token ids, segment ids (packing) and causality, and passed down to every layer.

Decoding step by step (``decode=True``): the caller first creates the cache
with ``model.init(rng, inputs, targets_of_max_len, decode=True)['cache']``,
runs ``encode`` once, then calls ``decode`` with the encoder output on the
first step (this stores each layer's cross-attention keys/values) and with
``encoded=None`` afterwards; each call feeds the previous output tokens
(no shift) and returns logits for the next ones.

Above 400 lines on purpose: this file is Figure 1 of the paper, the encoder and
decoder layers, their stacks and the model sharing one sublayer wiring (residual,
dropout, LayerNorm before or after).
"""

from __future__ import annotations

from collections.abc import Callable

import flax.linen as nn
import jax.numpy as jnp
from jax import Array

from flaxformer_lite.config.model import ModelConfig
from flaxformer_lite.model import partitioning as P
from flaxformer_lite.model.dropout import Dropout
from flaxformer_lite.model.embedding import (
    Embed,
    LearnedPositions,
    SinusoidalPositions,
    default_positions,
)
from flaxformer_lite.model.lexical import LexicalShortcut
from flaxformer_lite.model.masks import (
    SegmentIds,
    combine_masks,
    make_causal_mask,
    make_padding_mask,
    make_segment_mask,
)
from flaxformer_lite.model.registry import (
    added_positions,
    attention_layer,
    ffn_layer,
    norm_layer,
)
from flaxformer_lite.model.stacks import rematerialized, scanned


def shift_right(tokens: Array, bos_id: int, positions: Array | None = None) -> Array:
    """Decoder inputs: ``tokens`` moved one step right with ``bos_id`` in front.

    With ``positions`` (packed rows), every example restarts with ``bos_id``
    wherever its position is 0, so examples never see their neighbour's tokens.
    """
    shifted = jnp.pad(tokens, ((0, 0), (1, 0)), constant_values=bos_id)[:, :-1]
    if positions is not None:
        shifted = jnp.where(positions == 0, jnp.asarray(bos_id, tokens.dtype), shifted)
    return shifted


def _residual(
    c: ModelConfig, x: Array, sublayer: Callable[[Array], Array], name: str, deterministic: bool
) -> Array:
    """post-LN: LN(x + Dropout(f(x))) (paper); pre-LN: x + Dropout(f(LN(x)))."""
    norm = norm_layer(c, f"{name}_norm")
    drop = Dropout(c.residual_dropout, c.dropout_bits)
    if c.ln_position == "pre":
        x = x + drop(sublayer(norm(x)), deterministic=deterministic)
    else:
        x = norm(x + drop(sublayer(x), deterministic=deterministic))
    return _residual_stream(x)


def _residual_stream(x: Array) -> Array:
    """The ``[b, l, m]`` activations between sublayers: split by rows, whole in width."""
    return P.constrain(x, P.BATCH, P.LENGTH, P.ACT_EMBED)


def _check_length(c: ModelConfig, length: int, what: str) -> None:
    if length > c.max_len:
        raise ValueError(
            f"{what} length {length} exceeds model.max_len={c.max_len}; truncate the "
            f"sequences or raise model.max_len"
        )


class EncoderLayer(nn.Module):
    """Self-attention and FFN, each in a residual + LayerNorm block."""

    config: ModelConfig
    layer: int = 0

    @nn.compact
    def __call__(
        self,
        x: Array,
        mask: Array | SegmentIds | None,
        deterministic: bool = True,
        positions: Array | None = None,
    ) -> Array:
        c = self.config
        attn = attention_layer(c, "self_attention", layer=self.layer)
        x = _residual(
            c,
            x,
            lambda h: attn(h, mask=mask, deterministic=deterministic, positions=positions),
            "self_attention",
            deterministic,
        )
        ffn = ffn_layer(c)
        return _residual(c, x, lambda h: ffn(h, deterministic=deterministic), "ffn", deterministic)


class DecoderLayer(nn.Module):
    """Masked self-attention, cross-attention (unless decoder-only) and FFN."""

    config: ModelConfig
    has_cross_attention: bool = True
    layer: int = 0

    @nn.compact
    def __call__(
        self,
        x: Array,
        encoded: Array | None,
        self_mask: Array | SegmentIds | None,
        cross_mask: Array | None,
        deterministic: bool = True,
        decode: bool = False,
        positions: Array | None = None,
    ) -> Array:
        c = self.config
        self_attn = attention_layer(c, "self_attention", layer=self.layer, causal=True)
        x = _residual(
            c,
            x,
            lambda h: self_attn(
                h, mask=self_mask, deterministic=deterministic, decode=decode, positions=positions
            ),
            "self_attention",
            deterministic,
        )
        if self.has_cross_attention:
            cross = attention_layer(c, "cross_attention", self_attention=False)
            x = _residual(
                c,
                x,
                lambda h: cross(h, encoded, cross_mask, deterministic=deterministic, decode=decode),
                "cross_attention",
                deterministic,
            )
        ffn = ffn_layer(c)
        return _residual(c, x, lambda h: ffn(h, deterministic=deterministic), "ffn", deterministic)


def _embed_with_positions(
    c: ModelConfig,
    embed: Embed,
    tokens: Array,
    positions: Array,
    deterministic: bool,
    token_dropout: float = 0.0,
) -> Array:
    # Named, so that the other dropouts keep their automatic names (and random streams).
    word_dropout = Dropout(token_dropout, c.dropout_bits, whole_tokens=True, name="token_dropout")
    x = word_dropout(embed(tokens), deterministic=deterministic)
    if c.positional == "sinusoidal":
        x = x + SinusoidalPositions(c.d_model, c.compute_dtype)(positions)
    elif c.positional == "learned":
        x = x + LearnedPositions(
            c.max_len, c.d_model, c.compute_dtype, c.parameter_dtype, name="positions"
        )(positions)
    elif (added := added_positions(c)) is not None:  # a registered encoding
        x = x + added(positions).astype(x.dtype)
    return _residual_stream(
        Dropout(c.embedding_dropout, c.dropout_bits)(x, deterministic=deterministic)
    )


def _make_embed(c: ModelConfig, name: str) -> Embed:
    return Embed(
        c.vocab_size,
        c.d_model,
        scale=c.scale_embeddings,
        dtype=c.compute_dtype,
        param_dtype=c.parameter_dtype,
        name=name,
    )


class Encoder(nn.Module):
    """Token embedding + positions + N encoder layers (+ final LN when pre-LN)."""

    config: ModelConfig
    embedding: Embed | None = None  # shared table, or None for the encoder's own

    @nn.compact
    def __call__(
        self,
        tokens: Array,
        mask: Array | None,
        positions: Array | None = None,
        *,
        deterministic: bool = True,
    ) -> Array:
        c = self.config
        _check_length(c, tokens.shape[1], "source")
        embed = self.embedding if self.embedding is not None else _make_embed(c, "embed")
        if positions is None:
            positions = default_positions(*tokens.shape)
        x = _embed_with_positions(
            c, embed, tokens, positions, deterministic, c.source_token_dropout
        )
        layer_class = rematerialized(EncoderLayer, c.remat, static_argnums=(3,))
        if c.scan_layers:
            stack = scanned(c.num_encoder_layers)(
                EncoderLayer, c, static=(deterministic,), static_argnums=(3,), name="layers"
            )
            x, _ = stack(x, (mask,), positions)
        for i in range(0 if c.scan_layers else c.num_encoder_layers):
            x = layer_class(c, layer=i, name=f"layer_{i}")(x, mask, deterministic, positions)
        if c.ln_position == "pre":
            x = norm_layer(c, "final_norm")(x)
        return x


class Decoder(nn.Module):
    """Embedding + positions + N decoder layers (+ final LN) + output projection."""

    config: ModelConfig
    embedding: Embed | None = None  # shared table, or None for the decoder's own
    has_cross_attention: bool = True
    tie_output: bool = True  # logits = x E^T with the decoder's embedding

    @nn.compact
    def __call__(
        self,
        encoded: Array | None,
        tokens: Array,
        self_mask: Array | None,
        cross_mask: Array | None,
        positions: Array | None = None,
        *,
        deterministic: bool = True,
        decode: bool = False,
        source_embedded: Array | None = None,
    ) -> Array:
        """``tokens [b, t]`` are the decoder inputs (already shifted); returns ``[b, t, V]``.

        ``source_embedded [b, s, m]``: the source token embeddings, for the lexical
        shortcut (``config.lexical_shortcut``)."""
        c = self.config
        embed = self.embedding if self.embedding is not None else _make_embed(c, "embed")
        if decode:
            positions = self._decode_positions(tokens, positions)
        else:
            _check_length(c, tokens.shape[1], "target")
            if positions is None:
                positions = default_positions(*tokens.shape)
        x = _embed_with_positions(
            c, embed, tokens, positions, deterministic, c.target_token_dropout
        )
        # A cached decoding step has no backward pass: nothing to recompute.
        remat = "none" if decode else c.remat
        layer_class = rematerialized(DecoderLayer, remat, static_argnums=(5, 6))
        scan = c.scan_layers and not decode  # cached decoding runs the layers unrolled
        if scan:
            stack = scanned(c.num_decoder_layers)(
                DecoderLayer, c, (self.has_cross_attention,), (deterministic, False), (5, 6),
                name="layers",
            )  # fmt: skip
            x, _ = stack(x, (encoded, self_mask, cross_mask), positions)
        for i in range(0 if scan else c.num_decoder_layers):
            x = layer_class(c, self.has_cross_attention, layer=i, name=f"layer_{i}")(
                x, encoded, self_mask, cross_mask, deterministic, decode, positions
            )
        if c.ln_position == "pre":
            x = norm_layer(c, "final_norm")(x)
        if c.lexical_shortcut and self.has_cross_attention:
            if source_embedded is None:
                raise ValueError("config.lexical_shortcut needs source_embedded")
            dense_mask = cross_mask.dense() if isinstance(cross_mask, SegmentIds) else cross_mask
            lexical = LexicalShortcut(c, name="lexical")(
                x, encoded, source_embedded, dense_mask, decode=decode
            )
            x = x + Dropout(c.residual_dropout, c.dropout_bits)(
                lexical, deterministic=deterministic
            )
        if self.tie_output:
            logits = embed.attend(x)
        else:
            logits = nn.Dense(
                c.vocab_size,
                use_bias=False,
                dtype=c.compute_dtype,
                param_dtype=c.parameter_dtype,
                kernel_init=P.param_init(nn.initializers.xavier_uniform(), P.EMBED, P.VOCAB),
                name="logits",
            )(x)
            logits = P.constrain(logits, P.BATCH, P.LENGTH, P.ACT_VOCAB)
        logits = logits.astype(jnp.promote_types(logits.dtype, jnp.float32))
        if c.logits_bias:
            init = P.param_init(nn.initializers.zeros_init(), P.VOCAB)
            logits = logits + self.param("logits_bias", init, (c.vocab_size,), c.parameter_dtype)
        return logits

    def _decode_positions(self, tokens: Array, positions: Array | None) -> Array:
        """Positions of this decoding step, counted in the cache unless given."""
        creating = not self.has_variable("cache", "position_index")
        index = self.variable("cache", "position_index", lambda: jnp.array(0, jnp.int32))
        steps = tokens.shape[1]
        if positions is None:
            # index: a scalar, or one position per row (continuous batching)
            here = jnp.reshape(index.value, (-1, 1)) + jnp.arange(steps)
            positions = jnp.broadcast_to(here, tokens.shape)
        if not creating:
            index.value = index.value + steps
        return positions


class Transformer(nn.Module):
    """The encoder-decoder of the paper; ``__call__(inputs, targets)`` -> logits."""

    config: ModelConfig

    def setup(self):
        c = self.config
        tie = c.tie_embeddings
        shared = _make_embed(c, "shared_embedding") if tie in ("src_tgt", "all") else None
        self.shared_embedding = shared
        self.encoder = Encoder(c, embedding=shared)
        self.decoder = Decoder(c, embedding=shared, tie_output=tie in ("tgt_softmax", "all"))

    def encode(
        self,
        inputs: Array,
        inputs_positions: Array | None = None,
        inputs_segmentation: Array | None = None,
        *,
        deterministic: bool = True,
    ) -> Array:
        """``[b, s]`` source ids -> ``[b, s, m]``."""
        c = self.config
        if c.token_masks:
            mask = SegmentIds.from_tokens(inputs, inputs_segmentation, c.pad_id)
        else:
            mask = make_padding_mask(inputs, inputs, c.pad_id)
            if inputs_segmentation is not None:
                mask = combine_masks(
                    mask, make_segment_mask(inputs_segmentation, inputs_segmentation)
                )
        return self.encoder(inputs, mask, inputs_positions, deterministic=deterministic)

    def decode(
        self,
        encoded: Array | None,
        inputs: Array,
        targets: Array,
        *,
        targets_positions: Array | None = None,
        inputs_segmentation: Array | None = None,
        targets_segmentation: Array | None = None,
        deterministic: bool = True,
        decode: bool = False,
    ) -> Array:
        """Logits ``[b, t, V]`` for ``targets`` given the encoder output.

        Training/eval (``decode=False``): ``targets`` are the labels; the decoder
        sees them shifted right behind BOS. Decoding (``decode=True``):
        ``targets`` are the tokens to feed this step (no shift), ``encoded`` is
        needed on the first step only.
        """
        c = self.config
        if (inputs_segmentation is None) != (targets_segmentation is None):
            raise ValueError(
                "packed batches need both inputs_segmentation and targets_segmentation "
                "(or neither for unpacked batches)"
            )
        if decode:
            # Causality comes from the cache; only source padding is masked here.
            self_mask = None
            cross_mask = make_padding_mask(jnp.ones_like(targets), inputs, c.pad_id)
            decoder_inputs = targets
        else:
            decoder_inputs = shift_right(targets, c.bos_id, targets_positions)
            self_mask = combine_masks(
                make_padding_mask(targets, targets, c.pad_id),
                make_causal_mask(targets.shape[1]),
            )
            cross_mask = make_padding_mask(targets, inputs, c.pad_id)
            if targets_segmentation is not None:
                self_mask = combine_masks(
                    self_mask, make_segment_mask(targets_segmentation, targets_segmentation)
                )
                cross_mask = combine_masks(
                    cross_mask, make_segment_mask(targets_segmentation, inputs_segmentation)
                )
            if c.token_masks:  # token ids; the layers bring causality
                self_mask = SegmentIds.from_tokens(targets, targets_segmentation, c.pad_id)
            if c.token_cross_masks:  # cross-attention's ids too (chunked, cuDNN)
                cross_mask = SegmentIds.cross(
                    targets, inputs, targets_segmentation, inputs_segmentation, c.pad_id
                )
        source_embedded = None
        if c.lexical_shortcut:
            source_embedded = self.shared_embedding(inputs)
        return self.decoder(
            encoded,
            decoder_inputs,
            self_mask,
            cross_mask,
            targets_positions,
            deterministic=deterministic,
            decode=decode,
            source_embedded=source_embedded,
        )

    def __call__(
        self,
        inputs: Array,
        targets: Array,
        *,
        inputs_positions: Array | None = None,
        targets_positions: Array | None = None,
        inputs_segmentation: Array | None = None,
        targets_segmentation: Array | None = None,
        deterministic: bool = True,
        decode: bool = False,
    ) -> Array:
        encoded = self.encode(
            inputs, inputs_positions, inputs_segmentation, deterministic=deterministic
        )
        return self.decode(
            encoded,
            inputs,
            targets,
            targets_positions=targets_positions,
            inputs_segmentation=inputs_segmentation,
            targets_segmentation=targets_segmentation,
            deterministic=deterministic,
            decode=decode,
        )
