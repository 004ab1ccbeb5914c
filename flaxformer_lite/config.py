"""The model configuration: one frozen dataclass, validated when it is built.

Every choice of "Attention Is All You Need" is a field here, so the paper is one
preset (``PRESETS["paper_base"]``) and an ablation is one override
(``ModelConfig(**{**asdict(base), "ln_position": "pre"})`` or, from the command
line, ``--config.model.ln_position=pre``).

Each field is declared once, with its type, default, allowed values and meaning
(:func:`~flaxformer_lite.sections.option`); a bad value raises
:class:`ConfigError` when the config is built, naming the field, the value and
what is allowed, so a typo never reaches XLA.
"""

from __future__ import annotations

import dataclasses
import importlib
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import ml_collections
from ml_collections import config_dict

from flaxformer_lite.sections import (
    NON_NEGATIVE,
    POSITIVE,
    RATE,
    ConfigError,
    Rule,
    Section,
    option,
)

__all__ = ["PRESETS", "ConfigError", "ModelConfig", "get_preset", "register_check"]

# Allowed names for the string-valued ablation hooks. Score functions and sparse
# pattern specs are checked by their own registries (components/attention.py,
# components/sparse.py), which add their checks with ``register_check``.
# blocked: the project's kernels (no n x n array for sparse patterns); reference: a
# sparse pattern as a dense mask; chunked: dense attention by chunks with an online
# softmax (no n x n array); cudnn / splash: the GPU / TPU fused kernels.
ATTENTION_IMPLS = ("blocked", "reference", "chunked", "cudnn", "splash")
LN_POSITIONS = ("post", "pre")
POSITIONALS = ("sinusoidal", "learned", "none")
TIE_EMBEDDINGS = ("none", "src_tgt", "tgt_softmax", "all")
ACTIVATIONS = ("relu", "gelu", "silu", "tanh")
DTYPES = ("float32", "bfloat16", "float16", "float64")
HEAD_WIDTH = Rule(lambda v: v is None or v > 0, "must be > 0, or None for d_model // num_heads")


@dataclasses.dataclass(frozen=True)
class ModelConfig(Section):
    """Hyperparameters of the encoder-decoder Transformer and the decoder-only LM.

    Defaults are the paper's base model (Vaswani et al. 2017, Table 3).
    """

    NAME = "model"

    # Sizes.
    vocab_size: int = option(37000, "shared source/target vocabulary (paper: ~37k)", rule=POSITIVE)
    d_model: int = option(512, "width of every sublayer output and the embeddings", rule=POSITIVE)
    num_heads: int = option(8, "attention heads h", rule=POSITIVE)
    d_k: int | None = option(None, "per-head query/key width", rule=HEAD_WIDTH)
    d_v: int | None = option(None, "per-head value width", rule=HEAD_WIDTH)
    d_ff: int = option(2048, "inner width of the position-wise FFN", rule=POSITIVE)
    num_encoder_layers: int = option(6, "encoder layers N", rule=NON_NEGATIVE)
    num_decoder_layers: int = option(6, "decoder layers N (also the LM's)", rule=NON_NEGATIVE)
    max_len: int = option(
        512, "longest sequence: the learned-position table and the cache", rule=POSITIVE
    )

    # Dropout (paper: 0.1 on embeddings+PE and on every sublayer output; none elsewhere).
    embedding_dropout: float = option(0.1, "on embeddings + positional encodings", rule=RATE)
    residual_dropout: float = option(0.1, "on each sublayer output before the add", rule=RATE)
    attention_dropout: float = option(0.0, "on the attention weights", rule=RATE)
    ffn_dropout: float = option(0.0, "on the FFN hidden activations", rule=RATE)
    dropout_bits: int = option(
        8, "random bits per dropout draw (8: fast, rate rounded to k/256)", choices=(8, 16, 32)
    )
    # Word dropout (Gal & Ghahramani 2016; Sennrich & Zhang 2019 for small-data NMT): while
    # training, each source / decoder-input token's embedding is replaced by zeros with this
    # probability (its position encoding stays), so the model cannot lean on any one word.
    source_token_dropout: float = option(0.0, "word dropout on source tokens", rule=RATE)
    target_token_dropout: float = option(0.0, "word dropout on decoder-input tokens", rule=RATE)

    # Ablation hooks.
    score_fn: str = option(
        "scaled_dot", "attention score: scaled_dot | dot | additive | bilinear | registered"
    )
    ln_position: str = option(
        "post", "post: LN(x + f(x)) as in the paper; pre: x + f(LN(x))", choices=LN_POSITIONS
    )
    positional: str = option("sinusoidal", "position encoding", choices=POSITIONALS)
    tie_embeddings: str = option(
        "all", "shared tables (paper: source, target and softmax)", choices=TIE_EMBEDDINGS
    )
    scale_embeddings: bool = option(True, "multiply embeddings by sqrt(d_model) (paper)")
    activation: str = option("relu", "FFN activation (paper: max(0, .))", choices=ACTIVATIONS)
    use_bias: bool = option(True, "biases in the attention projections")
    layer_norm_epsilon: float = option(1e-6, "LayerNorm epsilon", rule=POSITIVE)
    # A lexical shortcut to the softmax (Nguyen & Chiang 2018): one attention head from
    # the decoder's output over the encoder output reads the *source token embeddings*,
    # and a linear map of that (zero at the start) is added to the decoder output before
    # the logits. With tied embeddings it lets the model predict "the translation of the
    # source word it attends to" directly. Needs the source embedding table (tied src_tgt/all).
    lexical_shortcut: bool = option(False, "attended source embeddings into the softmax")

    # Sparse self-attention (components/sparse.py has the spec grammar).
    attention_pattern: str = option(
        "dense", "self-attention pattern: dense | bigbird | local:window=128+global:first=1 | ..."
    )
    attention_impl: str = option(
        "blocked", "kernel: blocked (ours, any platform) | reference (sparse as a dense "
        "mask) | chunked (dense, O(n) memory) | cudnn (GPU fused: dense, causal, local) | "
        "splash (TPU, sparse patterns)",
        choices=ATTENTION_IMPLS,
    )  # fmt: skip
    attention_chunk: int = option(512, "chunked: queries and keys per chunk", rule=POSITIVE)
    attention_block_size: int = option(
        64, "kernel block; also the default block of random/bigbird", rule=POSITIVE
    )
    attention_seed: int = option(0, "draws of random patterns (salted per layer)")
    attention_scan_blocks: int = option(
        0, "> 0: query blocks at a time, recomputed in the backward pass (less memory)",
        rule=NON_NEGATIVE,
    )  # fmt: skip

    # Token ids (the data pipeline's sentencepiece model uses the same).
    pad_id: int = option(0, "padding id")
    eos_id: int = option(1, "end-of-sentence id")
    bos_id: int = option(2, "fed to the decoder at the first position (targets shift right)")

    # Numerics and introspection.
    dtype: str = option(
        "float32", "activations' dtype; softmax and LayerNorm statistics stay float32",
        choices=DTYPES,
    )  # fmt: skip
    param_dtype: str = option("float32", "parameters' dtype", choices=DTYPES)
    sow_attention_weights: bool = option(False, "store weights in 'intermediates'")

    def check(self) -> None:
        _validate(self)

    # Derived values -------------------------------------------------------
    @property
    def sparse_attention(self) -> bool:
        """True when self-attention uses ``attention_pattern`` instead of dense attention."""
        return self.attention_pattern.strip() not in ("", "dense")

    @property
    def token_masks(self) -> bool:
        """True when self-attention takes its mask as token ids (:class:`SegmentIds`),
        never as an ``n x n`` array: sparse patterns, the chunked and cuDNN kernels."""
        return self.sparse_attention or self.token_cross_masks

    @property
    def token_cross_masks(self) -> bool:
        """True when cross-attention takes its mask as token ids too (the dense kernels
        that never form an ``n x n`` array: chunked and cuDNN)."""
        return self.attention_impl in ("chunked", "cudnn")

    @property
    def head_dim_qk(self) -> int:
        return self.d_k if self.d_k is not None else self.d_model // self.num_heads

    @property
    def head_dim_v(self) -> int:
        return self.d_v if self.d_v is not None else self.d_model // self.num_heads

    @property
    def compute_dtype(self) -> jnp.dtype:
        return _usable_dtype("dtype", self.dtype)

    @property
    def parameter_dtype(self) -> jnp.dtype:
        return _usable_dtype("param_dtype", self.param_dtype)

    def check_precision(self) -> None:
        """ConfigError if a dtype needs a JAX mode that is off (float64 without x64).
        Checked where the model takes its dtypes (in the mode then in force) and by the
        experiment config before any data is read."""
        _usable_dtype("dtype", self.dtype)
        _usable_dtype("param_dtype", self.param_dtype)


def _usable_dtype(field: str, name: str) -> jnp.dtype:
    """``jnp.dtype(name)``, refusing float64 while JAX's 64-bit mode is off: JAX would
    compute it in float32 without a word."""
    dtype = jnp.dtype(name)
    if jax.dtypes.canonicalize_dtype(dtype) != dtype:
        raise ConfigError(
            f"model.{field}={name} needs JAX's 64-bit mode, which is off (JAX would "
            f"silently compute in float32): run with JAX_ENABLE_X64=1 in the environment "
            "(JAX_ENABLE_X64=1 python -m flaxformer_lite.main ...), or call "
            "jax.config.update('jax_enable_x64', True) before building the model"
        )
    return dtype


# Checks owned by modules above this one (a registry of names, a spec grammar). Each
# registers itself when imported; the first ModelConfig checked after this module has
# loaded imports them (_RULE_OWNERS), so every ModelConfig runs them whatever the
# caller imported (the package's __init__ imports nothing until a name is used).
_REGISTERED_CHECKS: list[Callable[[ModelConfig], None]] = []
_RULE_OWNERS = (
    "flaxformer_lite.components.attention",
    "flaxformer_lite.components.kernels",
    "flaxformer_lite.components.sparse",
)
_LOADED = False  # set at the end of this module: the presets above it need no owners


def register_check(check: Callable[[ModelConfig], None]) -> Callable[[ModelConfig], None]:
    """Decorator: ``check(config)`` runs on every ModelConfig after the field checks and
    raises :class:`ConfigError` naming the field and the fix."""
    _REGISTERED_CHECKS.append(check)
    return check


def _validate(c: ModelConfig) -> None:
    """The checks across fields (each field's own were made by ``Section``)."""
    if c.d_model % c.num_heads and (c.d_k is None or c.d_v is None):
        raise ConfigError(
            f"model.d_model={c.d_model} is not divisible by model.num_heads={c.num_heads}; "
            "choose num_heads dividing d_model, or set model.d_k and model.d_v explicitly"
        )
    if c.lexical_shortcut and c.tie_embeddings not in ("src_tgt", "all"):
        raise ConfigError(
            f"model.lexical_shortcut reads the shared source embeddings, but "
            f"tie_embeddings={c.tie_embeddings!r} gives the encoder its own table; "
            "set tie_embeddings to src_tgt or all"
        )
    if c.positional == "sinusoidal" and c.d_model % 2:
        raise ConfigError(
            f"model.d_model={c.d_model} must be even for sinusoidal positions "
            "(sin/cos pairs); use an even d_model or model.positional=learned"
        )
    for name in ("pad_id", "eos_id", "bos_id"):
        value = getattr(c, name)
        if not 0 <= value < c.vocab_size:
            raise ConfigError(
                f"model.{name}={value!r} must be a token id in [0, vocab_size={c.vocab_size})"
            )
    if c.eos_id == c.pad_id:
        raise ConfigError(
            f"model.eos_id={c.eos_id} equals model.pad_id: end-of-sentence would be masked "
            "as padding; give them different ids"
        )
    if c.attention_impl == "chunked":
        if c.sparse_attention:
            raise ConfigError(
                f"model.attention_impl='chunked' computes dense attention, not "
                f"attention_pattern={c.attention_pattern!r}: use attention_impl=blocked for "
                "sparse patterns, or attention_pattern=dense"
            )
        if c.score_fn not in ("scaled_dot", "dot") or c.attention_dropout > 0:
            raise ConfigError(
                f"model.attention_impl='chunked' computes dot-product scores without "
                f"dropout on the weights (score_fn={c.score_fn!r}, attention_dropout="
                f"{c.attention_dropout}): use score_fn=scaled_dot or dot and "
                "attention_dropout=0, or attention_impl=blocked"
            )
    if c.sparse_attention:
        if c.score_fn not in ("scaled_dot", "dot"):
            raise ConfigError(
                f"model.score_fn={c.score_fn!r} with a sparse attention_pattern: the blocked "
                "kernel computes dot-product scores; use scaled_dot or dot, or "
                "attention_pattern=dense"
            )
        if c.attention_dropout > 0:
            raise ConfigError(
                f"model.attention_dropout={c.attention_dropout} with a sparse "
                "attention_pattern is not supported; set it to 0 (residual dropout still "
                "applies)"
            )
    if _LOADED:
        for module in _RULE_OWNERS:
            importlib.import_module(module)  # registers its checks (once)
    for check in _REGISTERED_CHECKS:
        check(c)


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


_LOADED = True
