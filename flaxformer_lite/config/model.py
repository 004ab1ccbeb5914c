"""The model configuration: one frozen dataclass, validated when it is built.

Every choice of "Attention Is All You Need" is a field here, so the paper is one
preset (``PRESETS["paper_base"]``) and an ablation is one override
(``ModelConfig(**{**asdict(base), "ln_position": "pre"})`` or, from the command
line, ``--config.model.ln_position=pre``).

Each field is declared once, with its type, default, allowed values and meaning
(:func:`~flaxformer_lite.config.fields.option`); a bad value raises
:class:`ConfigError` when the config is built, naming the field, the value and
what is allowed, so a typo never reaches XLA.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import ml_collections
from ml_collections import config_dict

from flaxformer_lite.config import rules
from flaxformer_lite.config.fields import (
    NON_NEGATIVE,
    POSITIVE,
    RATE,
    ConfigError,
    Rule,
    Section,
    option,
)
from flaxformer_lite.sparse.dispatch import IMPLS

__all__ = ["PRESETS", "ConfigError", "ModelConfig", "get_preset"]

# Allowed names for the string-valued ablation hooks. Score functions and sparse
# pattern specs are checked against their registries by config/rules.py.
# blocked: the project's kernels (no n x n array for sparse patterns); reference: a
# sparse pattern as a dense mask; chunked: dense attention by chunks with an online
# softmax (no n x n array); cudnn / splash: the GPU / TPU fused kernels.
ATTENTION_IMPLS = IMPLS  # the dispatch table's columns (sparse/dispatch.py)
LN_POSITIONS = ("post", "pre")
# Lists, not tuples: model/registry.py appends the names extensions register.
POSITIONALS = ["sinusoidal", "learned", "rotary", "none"]
FFNS = ["standard"]
NORMS = ["layer_norm", "rms_norm"]
ATTENTIONS = ["multihead"]
TIE_EMBEDDINGS = ("none", "src_tgt", "tgt_softmax", "all")
ACTIVATIONS = ("relu", "gelu", "silu", "tanh")
DTYPES = ("float32", "bfloat16", "float16", "float64")
# What each layer keeps for the backward pass (jax.checkpoint policies, model/transformer.py):
# none: everything (no recomputation); full: only the layer's input; dots: the outputs
# of the projections and the FFN (attention's scores and softmax, norms, activations
# and dropout recomputed); dots_all: every matmul's output (attention's too).
REMAT_POLICIES = ("none", "full", "dots", "dots_all")
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
    positional: str = option(
        "sinusoidal", "position encoding (rotary: queries and keys turned by their "
        "positions in self-attention, nothing added to the embeddings)", choices=POSITIONALS,
    )  # fmt: skip
    tie_embeddings: str = option(
        "all", "shared tables (paper: source, target and softmax)", choices=TIE_EMBEDDINGS
    )
    scale_embeddings: bool = option(True, "multiply embeddings by sqrt(d_model) (paper)")
    activation: str = option("relu", "FFN activation (paper: max(0, .))", choices=ACTIVATIONS)
    ffn: str = option(
        "standard", "feed-forward block: standard = act(x W1) W2 (paper) | registered "
        "(model/registry.py's register_ffn)", choices=FFNS,
    )  # fmt: skip
    norm: str = option(
        "layer_norm", "normalisation of each residual block (and a pre-LN stack's end): "
        "layer_norm (paper) | rms_norm | registered (register_norm)", choices=NORMS,
    )  # fmt: skip
    attention: str = option(
        "multihead", "attention sublayer (self and cross): multihead (paper) | registered "
        "(register_attention: MultiHeadAttention's call)", choices=ATTENTIONS,
    )  # fmt: skip
    extensions: str = option(
        "", "Python files or modules that register names (comma-separated), imported by "
        "every command before the config is checked; training keeps a copy in the run "
        "folder (docs/extending.md)",
    )  # fmt: skip
    use_bias: bool = option(True, "biases in the attention projections")
    layer_norm_epsilon: float = option(1e-6, "LayerNorm epsilon", rule=POSITIVE)
    logits_bias: bool = option(
        False, "a learned bias on the output logits (Marian / OPUS-MT models have one)"
    )
    # A lexical shortcut to the softmax (Nguyen & Chiang 2018): one attention head from
    # the decoder's output over the encoder output reads the *source token embeddings*,
    # and a linear map of that (zero at the start) is added to the decoder output before
    # the logits. With tied embeddings it lets the model predict "the translation of the
    # source word it attends to" directly. Needs the source embedding table (tied src_tgt/all).
    lexical_shortcut: bool = option(False, "attended source embeddings into the softmax")

    # Sparse self-attention (sparse/grammar/spec.py has the spec grammar).
    attention_pattern: str = option(
        "dense", "self-attention pattern: dense | bigbird | local:window=128+global:first=1 | ..."
    )
    attention_impl: str = option(
        "blocked", "kernel: blocked (ours, any platform) | reference (sparse as a dense "
        "mask) | chunked (dense, O(n) memory) | cudnn (GPU fused: cuDNN for dense/causal, "
        "Triton block-sparse for any other pattern) | "
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

    # The task head (data.task=classify: model/classifier.py).
    num_classes: int = option(0, "classify: classes of the sequence classifier", rule=NON_NEGATIVE)

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
    scan_layers: bool = option(
        False, "each layer stack compiled once as a scan (parameters stacked along a "
        "'layers' axis; the unrolled model's initial parameters and dropout masks, so the "
        "same numbers; decoding runs the layers unrolled)",
    )  # fmt: skip
    remat: str = option(
        "none", "recompute each layer in the backward pass, keeping: none (all) | full "
        "(the layer input) | dots (projection/FFN outputs) | dots_all (every matmul output)",
        choices=REMAT_POLICIES,
    )  # fmt: skip

    def check(self) -> None:
        rules.check_model(self)

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
    def compute_dtype(self) -> Any:
        return _usable_dtype("dtype", self.dtype)

    @property
    def parameter_dtype(self) -> Any:
        return _usable_dtype("param_dtype", self.param_dtype)

    def check_precision(self) -> None:
        """ConfigError if a dtype needs a JAX mode that is off (float64 without x64).
        Checked where the model takes its dtypes (in the mode then in force) and by the
        experiment config before any data is read."""
        _usable_dtype("dtype", self.dtype)
        _usable_dtype("param_dtype", self.param_dtype)


def _usable_dtype(field: str, name: str) -> Any:
    """``jnp.dtype(name)``, refusing float64 while JAX's 64-bit mode is off: JAX would
    compute it in float32 without a word. (JAX is imported here, when a model asks for
    its dtypes, not with the config: ``main fields`` and ``--help`` do without it.)"""
    import jax
    import jax.numpy as jnp

    dtype = jnp.dtype(name)
    if jax.dtypes.canonicalize_dtype(dtype) != dtype:
        raise ConfigError(
            f"model.{field}={name} needs JAX's 64-bit mode, which is off (JAX would "
            f"silently compute in float32): run with JAX_ENABLE_X64=1 in the environment "
            "(JAX_ENABLE_X64=1 python -m flaxformer_lite.main ...), or call "
            "jax.config.update('jax_enable_x64', True) before building the model"
        )
    return dtype


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
