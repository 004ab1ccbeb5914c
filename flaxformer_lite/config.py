"""The model configuration: one frozen dataclass, validated when it is built.

Every choice of "Attention Is All You Need" is a field here, so the paper is one
preset (``PRESETS["paper_base"]``) and an ablation is one override
(``ModelConfig(**{**asdict(base), "ln_position": "pre"})`` or, from the command
line, ``--config.model.ln_position=pre``).

A bad value raises :class:`ConfigError` when the config is built, naming the
field, the value and what is allowed, so a typo never reaches XLA.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

import jax.numpy as jnp


class ConfigError(ValueError):
    """A configuration value is invalid; the message names the field and the fix."""


# Allowed names for the string-valued ablation hooks. Score functions are
# validated against the registry in components/attention.py (so a newly
# registered score function is accepted without editing this file).
LN_POSITIONS = ("post", "pre")
POSITIONALS = ("sinusoidal", "learned", "none")
TIE_EMBEDDINGS = ("none", "src_tgt", "tgt_softmax", "all")
ACTIVATIONS = ("relu", "gelu", "silu", "tanh")
DTYPES = ("float32", "bfloat16", "float16", "float64")


@dataclasses.dataclass(frozen=True)
class ModelConfig:
    """Hyperparameters of the encoder-decoder Transformer and the decoder-only LM.

    Defaults are the paper's base model (Vaswani et al. 2017, Table 3).
    """

    # Sizes.
    vocab_size: int = 37000  # shared source/target word-piece vocabulary (paper: ~37k BPE)
    d_model: int = 512  # width of every sublayer output and of the embeddings
    num_heads: int = 8  # h
    d_k: int | None = None  # per-head query/key width; None = d_model // num_heads
    d_v: int | None = None  # per-head value width; None = d_model // num_heads
    d_ff: int = 2048  # inner width of the position-wise FFN
    num_encoder_layers: int = 6  # N (encoder)
    num_decoder_layers: int = 6  # N (decoder, and the decoder-only LM)
    max_len: int = 512  # longest sequence: size of the learned-position table and the cache

    # Dropout (paper: 0.1 on embeddings+PE and on every sublayer output; none elsewhere).
    embedding_dropout: float = 0.1  # on the sum of embeddings and positional encodings
    residual_dropout: float = 0.1  # on each sublayer output before the residual add
    attention_dropout: float = 0.0  # on the attention weights
    ffn_dropout: float = 0.0  # on the FFN hidden activations
    dropout_bits: int = 8  # random bits per dropout draw: 8 (fast; rate rounded to k/256) | 32
    # Word dropout (Gal & Ghahramani 2016; Sennrich & Zhang 2019 for small-data NMT): while
    # training, each source / decoder-input token's embedding is replaced by zeros with this
    # probability (its position encoding stays), so the model cannot lean on any one word.
    source_token_dropout: float = 0.0
    target_token_dropout: float = 0.0

    # Ablation hooks.
    score_fn: str = "scaled_dot"  # scaled_dot | dot | additive | bilinear | any registered name
    ln_position: str = "post"  # post: LN(x + Sublayer(x)) as in the paper; pre: x + Sublayer(LN(x))
    positional: str = "sinusoidal"  # sinusoidal (paper) | learned | none
    tie_embeddings: str = "all"  # none | src_tgt | tgt_softmax | all (paper: src, tgt and softmax)
    scale_embeddings: bool = True  # multiply embeddings by sqrt(d_model) (paper)
    activation: str = "relu"  # FFN activation; the paper's max(0, .)
    use_bias: bool = True  # biases in the attention projections
    layer_norm_epsilon: float = 1e-6
    # A lexical shortcut to the softmax (Nguyen & Chiang 2018): one attention head from
    # the decoder's output over the encoder output reads the *source token embeddings*,
    # and a linear map of that (zero at the start) is added to the decoder output before
    # the logits. With tied embeddings it lets the model predict "the translation of the
    # source word it attends to" directly. Needs the source embedding table (tied src_tgt/all).
    lexical_shortcut: bool = False

    # Sparse self-attention (components/sparse.py has the spec grammar).
    attention_pattern: str = "dense"  # dense | bigbird | local:window=128+global:first=1 | ...
    attention_impl: str = "blocked"  # blocked (no n x n array) | reference (dense mask)
    attention_block_size: int = 64  # kernel block; also the default block of random/bigbird
    attention_seed: int = 0  # draws of random patterns (salted per layer)
    # > 0: compute the blocked kernel this many query blocks at a time, recomputing
    # scores in the backward pass (about half the memory at 8k, ~1.3-1.5x the time).
    attention_scan_blocks: int = 0

    # Token ids (the data pipeline's sentencepiece model uses the same).
    pad_id: int = 0
    eos_id: int = 1
    bos_id: int = 2  # fed to the decoder at the first position (targets are shifted right)

    # Numerics and introspection.
    dtype: str = "float32"  # compute dtype of activations; softmax and LayerNorm stats stay float32
    param_dtype: str = "float32"
    sow_attention_weights: bool = False  # store weights in the 'intermediates' collection

    def __post_init__(self):
        _validate(self)

    # Derived values -------------------------------------------------------
    @property
    def sparse_attention(self) -> bool:
        """True when self-attention uses ``attention_pattern`` instead of dense attention."""
        return self.attention_pattern.strip() not in ("", "dense")

    @property
    def head_dim_qk(self) -> int:
        return self.d_k if self.d_k is not None else self.d_model // self.num_heads

    @property
    def head_dim_v(self) -> int:
        return self.d_v if self.d_v is not None else self.d_model // self.num_heads

    @property
    def compute_dtype(self) -> jnp.dtype:
        return jnp.dtype(self.dtype)

    @property
    def parameter_dtype(self) -> jnp.dtype:
        return jnp.dtype(self.param_dtype)

    def replace(self, **changes: Any) -> ModelConfig:
        """A copy with some fields changed (validated again)."""
        unknown = sorted(set(changes) - {f.name for f in dataclasses.fields(self)})
        if unknown:
            raise ConfigError(_unknown_message(unknown))
        return dataclasses.replace(self, **changes)

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, values: Mapping[str, Any]) -> ModelConfig:
        """Build from a mapping (e.g. an ml_collections ``config.model``); unknown keys fail."""
        if hasattr(values, "to_dict"):
            values = values.to_dict()
        unknown = sorted(set(values) - {f.name for f in dataclasses.fields(cls)})
        if unknown:
            raise ConfigError(_unknown_message(unknown))
        return cls(**dict(values))


def _unknown_message(unknown: list[str]) -> str:
    known = ", ".join(f.name for f in dataclasses.fields(ModelConfig))
    return f"unknown model config field(s) {unknown}; known fields are: {known}"


def _check_choice(name: str, value: Any, allowed: tuple[str, ...]) -> None:
    if value not in allowed:
        raise ConfigError(
            f"model.{name}={value!r} is not allowed; choose one of {', '.join(allowed)}"
        )


def _validate(c: ModelConfig) -> None:
    from flaxformer_lite.components.attention import score_fn_names

    for name in ("vocab_size", "d_model", "num_heads", "d_ff", "max_len"):
        value = getattr(c, name)
        if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
            raise ConfigError(f"model.{name}={value!r} must be a positive integer")
    for name in ("num_encoder_layers", "num_decoder_layers"):
        value = getattr(c, name)
        if isinstance(value, bool) or not isinstance(value, int) or value < 0:
            raise ConfigError(f"model.{name}={value!r} must be a non-negative integer")
    for name in ("d_k", "d_v"):
        value = getattr(c, name)
        if value is not None and (
            isinstance(value, bool) or not isinstance(value, int) or value <= 0
        ):
            raise ConfigError(
                f"model.{name}={value!r} must be a positive integer, or None for "
                "d_model // num_heads"
            )
    if c.d_model % c.num_heads and (c.d_k is None or c.d_v is None):
        raise ConfigError(
            f"model.d_model={c.d_model} is not divisible by model.num_heads={c.num_heads}; "
            "choose num_heads dividing d_model, or set model.d_k and model.d_v explicitly"
        )
    for name in (
        "embedding_dropout",
        "residual_dropout",
        "attention_dropout",
        "ffn_dropout",
        "source_token_dropout",
        "target_token_dropout",
    ):
        value = getattr(c, name)
        if isinstance(value, bool) or not isinstance(value, int | float) or not 0.0 <= value < 1.0:
            raise ConfigError(f"model.{name}={value!r} must be a rate in [0, 1)")
    if not isinstance(c.layer_norm_epsilon, int | float) or c.layer_norm_epsilon <= 0:
        raise ConfigError(f"model.layer_norm_epsilon={c.layer_norm_epsilon!r} must be > 0")
    _check_choice("score_fn", c.score_fn, score_fn_names())
    _check_choice("ln_position", c.ln_position, LN_POSITIONS)
    _check_choice("positional", c.positional, POSITIONALS)
    _check_choice("tie_embeddings", c.tie_embeddings, TIE_EMBEDDINGS)
    _check_choice("activation", c.activation, ACTIVATIONS)
    if c.lexical_shortcut and c.tie_embeddings not in ("src_tgt", "all"):
        raise ConfigError(
            f"model.lexical_shortcut reads the shared source embeddings, but "
            f"tie_embeddings={c.tie_embeddings!r} gives the encoder its own table; "
            "set tie_embeddings to src_tgt or all"
        )
    if c.dropout_bits not in (8, 16, 32):
        raise ConfigError(
            f"model.dropout_bits={c.dropout_bits!r} is not allowed; choose 8, 16 or 32"
        )
    _check_choice("dtype", c.dtype, DTYPES)
    _check_choice("param_dtype", c.param_dtype, DTYPES)
    if c.positional == "sinusoidal" and c.d_model % 2:
        raise ConfigError(
            f"model.d_model={c.d_model} must be even for sinusoidal positions "
            "(sin/cos pairs); use an even d_model or model.positional=learned"
        )
    for name in ("pad_id", "eos_id", "bos_id"):
        value = getattr(c, name)
        if not isinstance(value, int) or not 0 <= value < c.vocab_size:
            raise ConfigError(
                f"model.{name}={value!r} must be a token id in [0, vocab_size={c.vocab_size})"
            )
    _validate_sparse(c)
    if c.eos_id == c.pad_id:
        raise ConfigError(
            f"model.eos_id={c.eos_id} equals model.pad_id: end-of-sentence would be masked "
            "as padding; give them different ids"
        )


def _validate_sparse(c: ModelConfig) -> None:
    from flaxformer_lite.components import sparse

    if not isinstance(c.attention_block_size, int) or c.attention_block_size < 1:
        raise ConfigError(
            f"model.attention_block_size={c.attention_block_size!r} must be a positive integer"
        )
    if not isinstance(c.attention_scan_blocks, int) or c.attention_scan_blocks < 0:
        raise ConfigError(
            f"model.attention_scan_blocks={c.attention_scan_blocks!r} must be an integer >= 0 "
            "(0 = all query blocks at once)"
        )
    if not isinstance(c.attention_seed, int) or isinstance(c.attention_seed, bool):
        raise ConfigError(f"model.attention_seed={c.attention_seed!r} must be an integer")
    _check_choice("attention_impl", c.attention_impl, sparse.IMPLS)
    if sparse.is_dense(c.attention_pattern):
        return
    try:
        sparse.check_spec(
            c.attention_pattern,
            c.num_heads,
            max(c.num_encoder_layers, c.num_decoder_layers),
            c.attention_block_size,
        )
    except sparse.PatternSpecError as e:
        raise ConfigError(
            f"model.attention_pattern={c.attention_pattern!r}: {e} "
            "(grammar: flaxformer_lite/components/sparse.py)"
        ) from None
    if c.score_fn not in ("scaled_dot", "dot"):
        raise ConfigError(
            f"model.score_fn={c.score_fn!r} with a sparse attention_pattern: the blocked kernel "
            "computes dot-product scores; use scaled_dot or dot, or attention_pattern=dense"
        )
    if c.attention_dropout > 0:
        raise ConfigError(
            f"model.attention_dropout={c.attention_dropout} with a sparse attention_pattern is "
            "not supported; set it to 0 (residual dropout still applies)"
        )


# Presets -----------------------------------------------------------------
# Table 3 of the paper. Parameter counts with the 37,000-token shared vocabulary
# (tested in tests/test_config.py): base 63,082,496 (paper: 65M), big 214,245,376
# (paper: 213M).
PRESETS: dict[str, ModelConfig] = {
    "paper_base": ModelConfig(),
    "paper_big": ModelConfig(
        d_model=1024,
        num_heads=16,
        d_ff=4096,
        embedding_dropout=0.3,
        residual_dropout=0.3,
    ),
}


def get_preset(name: str, **overrides: Any) -> ModelConfig:
    """A named preset, optionally with fields overridden."""
    if name not in PRESETS:
        raise ConfigError(f"unknown preset {name!r}; choose one of {', '.join(PRESETS)}")
    return PRESETS[name].replace(**overrides) if overrides else PRESETS[name]


# ml_collections bridge ----------------------------------------------------------


def model_config_dict(model: ModelConfig):
    """An ``ml_collections.ConfigDict`` of a ModelConfig, for ``configs/*.py``.

    Optional integer fields become typed placeholders, so ``--config.model.d_k=64``
    still works from the command line when the preset leaves them ``None``.
    """
    import ml_collections
    from ml_collections import config_dict

    values: dict[str, Any] = {}
    for f in dataclasses.fields(model):
        value = getattr(model, f.name)
        if value is None:
            value = config_dict.placeholder(int)
        values[f.name] = value
    return ml_collections.ConfigDict(values)


def model_config_from(config) -> ModelConfig:
    """The validated ModelConfig of an experiment config (its ``model`` section)."""
    if "model" not in config:
        raise ConfigError("the experiment config has no 'model' section; see configs/paper_base.py")
    return ModelConfig.from_dict(config.model)
