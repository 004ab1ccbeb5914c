"""Every rule that combines config fields, in one place, with one table of what each
attention kernel supports.

A config is checked in this order, so that an error names the value the user got wrong:

1. each field alone: its type, allowed values and range (``fields.option``, as the
   section is built);
2. each field's own validity that needs a parser or a registry: ``model.score_fn``
   names a registered score function, ``model.attention_pattern`` parses,
   ``train.mesh`` parses (:func:`check_model`, :func:`check_train`, first);
3. the rules that combine fields of one section (the rest of ``check_<section>``);
4. the rules across sections (:func:`check_experiment`).

Each section's ``check()`` calls its function here, and the experiment config calls
:func:`check_experiment`, so every rule runs whatever the caller imported: the
registries it reads live at this level or below (score-function names here, which
``model/attention.py`` extends when it registers one; pattern names in
``sparse/grammar/spec.py``).
"""

from __future__ import annotations

import dataclasses
import importlib.util
import re
from typing import Any

from flaxformer_lite.config.fields import ConfigError
from flaxformer_lite.config.mesh import MeshError, parse_mesh
from flaxformer_lite.config.profile import profile_steps
from flaxformer_lite.sparse import dispatch
from flaxformer_lite.sparse.grammar import spec as grammar
from flaxformer_lite.sparse.grammar.spec import PatternSpecError, check_spec, is_dense, parse_spec

# Score functions ----------------------------------------------------------------------
# Their names (the factories are model code: model/attention.py registers them here).
SCORE_FUNCTIONS: list[str] = ["scaled_dot", "dot", "additive", "bilinear"]


def add_score_function(name: str) -> None:
    """Make ``name`` a valid ``model.score_fn`` (model/attention.py's register_score_fn)."""
    if name not in SCORE_FUNCTIONS:
        SCORE_FUNCTIONS.append(name)


# The attention kernels ------------------------------------------------------------------
# Which kernel computes which pattern (or refuses it, and why) is the dispatch table's
# (sparse/dispatch.py); what each attention_impl takes besides a pattern is here.


@dataclasses.dataclass(frozen=True)
class Kernel:
    """What one ``model.attention_impl`` takes besides a pattern, as the rules check it."""

    what: str  # how messages name it
    any_score: bool = False  # other scores than dot products
    attention_dropout: bool = False  # dropout on the attention weights
    float64: bool = True
    head_sizes: str = ""  # "" = any; else the rule's words


KERNELS = {
    "blocked": Kernel("the project's kernels", any_score=True, attention_dropout=True),
    "reference": Kernel("a sparse pattern as a dense mask", any_score=True,
                        attention_dropout=True),
    "chunked": Kernel("dense attention by chunks"),
    "cudnn": Kernel("the fused GPU kernels", float64=False,
                    head_sizes="a multiple of 8 and at most 256 (128 before Hopper)"),
    "splash": Kernel("TPU splash attention"),
}  # fmt: skip
# With a sparse pattern, blocked and reference compute dot-product scores without
# dropout on the weights (their dense path takes any score and dropout).
SPARSE_NEEDS_DOT = ("blocked", "reference")


# The model -------------------------------------------------------------------------------


def check_model(c: Any) -> None:
    """``model``: score function and pattern first (each alone), then the rest."""
    if c.score_fn not in SCORE_FUNCTIONS:
        raise ConfigError(
            f"model.score_fn={c.score_fn!r} is not allowed; choose one of "
            f"{', '.join(SCORE_FUNCTIONS)} (or register one with register_score_fn)"
        )
    layers = None
    if not is_dense(c.attention_pattern):
        try:
            layers = parse_spec(c.attention_pattern, c.attention_block_size)
        except PatternSpecError as e:
            raise ConfigError(_pattern_message(c, e)) from None
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
    if c.positional == "rotary" and c.head_dim_qk % 2:
        raise ConfigError(
            f"model.positional=rotary turns pairs of query/key dims, and the head size is "
            f"{c.head_dim_qk}; choose an even d_k (d_model / num_heads)"
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
    if layers is not None:
        try:  # the pattern against the model: head groups, block sizes
            check_spec(
                c.attention_pattern, c.num_heads, max(c.num_encoder_layers, c.num_decoder_layers),
                c.attention_block_size, c.num_decoder_layers,
            )  # fmt: skip
        except PatternSpecError as e:
            raise ConfigError(_pattern_message(c, e)) from None
    _check_kernel(c, layers)
    if c.scan_layers:
        _check_scan(c, layers)


def _check_scan(c: Any, layers: list | None) -> None:
    """``model.scan_layers`` compiles one layer for all: every layer must be the same."""
    varies = layers is not None and (
        any(layer != layers[0] for layer in layers)
        or any(p.for_layer(1) != p.for_layer(0) for p in layers[0])
    )
    if varies:
        raise ConfigError(
            f"model.scan_layers compiles one layer for all, and attention_pattern="
            f"{c.attention_pattern!r} differs between layers (layers separated by '|', or "
            "random blocks drawn per layer); use one pattern without random blocks, or "
            "scan_layers=False"
        )
    if c.sow_attention_weights:
        raise ConfigError(
            "model.sow_attention_weights names each layer's weights, and model.scan_layers "
            "stacks the layers; the attention maps and statistics unroll a scanned run "
            "themselves: set sow_attention_weights=False"
        )


def _pattern_message(c: Any, error: Exception) -> str:
    return (
        f"model.attention_pattern={c.attention_pattern!r}: {error} "
        "(grammar: flaxformer_lite/sparse/grammar/spec.py)"
    )


def _check_kernel(c: Any, layers: list | None) -> None:
    """The model against the table of what its ``attention_impl`` supports."""
    impl, k = c.attention_impl, KERNELS[c.attention_impl]
    where = f"model.attention_impl={impl}"
    if layers is None:
        try:
            dispatch.kernel(None, impl)
        except dispatch.Refused as e:
            raise ConfigError(f"{where} {e}") from None
    dot_only = not k.any_score or (layers is not None and impl in SPARSE_NEEDS_DOT)
    no_dropout = not k.attention_dropout or (layers is not None and impl in SPARSE_NEEDS_DOT)
    what = k.what if layers is None or impl not in SPARSE_NEEDS_DOT else "the sparse kernels"
    if dot_only and c.score_fn not in ("scaled_dot", "dot"):
        raise ConfigError(
            f"model.score_fn={c.score_fn!r} with {where} ({what}): it computes dot-product "
            "scores; use score_fn=scaled_dot or dot"
            + (", or attention_pattern=dense" if layers is not None else "")
            + (", or attention_impl=blocked" if impl not in SPARSE_NEEDS_DOT else "")
        )
    if no_dropout and c.attention_dropout > 0:
        raise ConfigError(
            f"model.attention_dropout={c.attention_dropout} with {where} ({what}): it has no "
            "dropout on the attention weights; set it to 0 (residual dropout still applies)"
            + (", or use attention_impl=blocked" if impl not in SPARSE_NEEDS_DOT else "")
        )
    if not k.float64 and "float64" in (c.dtype, c.param_dtype):
        raise ConfigError(
            f"{where} takes bfloat16/float16 (a float32 model's attention is rounded to "
            f"bfloat16), not float64 (dtype={c.dtype}, param_dtype={c.param_dtype}); use "
            "attention_impl=blocked for float64"
        )
    if impl == "cudnn":
        for name, size in (("d_k", c.head_dim_qk), ("d_v", c.head_dim_v)):
            if size % 8 or size > 256:
                raise ConfigError(
                    f"{where} needs a head size that is {k.head_sizes}, and {name} is {size} "
                    f"(d_model={c.d_model} / num_heads={c.num_heads} unless set); change "
                    "num_heads or d_k/d_v, or use attention_impl=chunked"
                )
    for pattern in (p for layer in layers or () for p in layer):
        try:
            dispatch.kernel(pattern, impl)
        except dispatch.Refused as e:
            spec = f"model.attention_pattern={c.attention_pattern!r}"
            raise ConfigError(f"{where}, {spec}: {e}") from None


# The other sections ----------------------------------------------------------------------

_TAG = re.compile(r"<\w+>")


def check_data(d: Any) -> None:
    if d.subword_alpha and d.stream:
        raise ConfigError(
            "config.data.subword_alpha needs sentence pairs; it does not apply to "
            "data.stream=True (running text); set it to 0"
        )
    for name, example in (("aux_tag", "<dict>"), ("reverse_tag", "<2en>")):
        tag = getattr(d, name)
        if tag and (d.task != "translation" or not _TAG.fullmatch(tag)):
            raise ConfigError(
                f"config.data.{name}={tag!r} needs a translation task and the form <name> "
                f"(e.g. {example}), one symbol with no spaces"
            )
    if d.reverse_tag and d.reverse_tag == d.aux_tag:
        raise ConfigError(
            f"config.data.reverse_tag and aux_tag are both {d.aux_tag!r}; give them different names"
        )
    if d.stream and d.task != "lm":
        raise ConfigError(
            f"config.data.stream=True needs data.task='lm' (it is {d.task!r}): "
            "translation pairs cannot be cut into running text"
        )
    if d.resample_subsets and (d.subword_alpha or d.stream):
        raise ConfigError(
            "config.data.resample_subsets=True cannot be combined with subword_alpha > 0 "
            "or stream=True (each redraws the epoch's examples its own way); set "
            "data.resample_subsets=False or turn the other off"
        )
    if d.task == "translation" and d.source_lang == d.target_lang:
        raise ConfigError(f"config.data.source_lang and target_lang are both {d.source_lang!r}")


def check_train(t: Any) -> None:
    try:
        parse_mesh(t.mesh)
    except MeshError as e:
        raise ConfigError(str(e)) from None
    profile_steps(t.profile)
    if t.wandb_project and importlib.util.find_spec("wandb") is None:
        raise ConfigError(
            f"config.train.wandb_project={t.wandb_project!r} needs Weights & Biases: pip "
            "install 'flaxformer_lite[wandb]' (or wandb), or set train.wandb_project=''"
        )
    if t.init_from and (not t.init_from.startswith("hf:") or t.init_from == "hf:"):
        raise ConfigError(
            f"config.train.init_from={t.init_from!r}: write hf:DIR, DIR a transformers "
            "Marian / OPUS-MT folder (e.g. hf:opus-mt-en-de)"
        )
    if t.batch_size % t.microbatches:
        raise ConfigError(
            f"config.train.microbatches={t.microbatches} must divide "
            f"train.batch_size={t.batch_size}"
        )
    if t.batch_size % t.concurrent_splits:
        raise ConfigError(
            f"config.train.concurrent_splits={t.concurrent_splits} must divide "
            f"train.batch_size={t.batch_size} (per device)"
        )
    for spec in t.attention_stats_patterns.split():
        try:
            layers = parse_spec(spec)
        except PatternSpecError as e:
            raise ConfigError(f"config.train.attention_stats_patterns: {e}") from None
        if len(layers) > 1 or len(layers[0]) > 1:
            raise ConfigError(
                f"config.train.attention_stats_patterns: {spec!r} is one pattern for every "
                "head (no '|' layers or ';' head groups)"
            )
    if t.final_checkpoints and not t.final_window:
        raise ConfigError(
            f"config.train.final_checkpoints={t.final_checkpoints} needs a window to place "
            "them in: set train.final_window > 0 (e.g. 0.25) or final_checkpoints=0"
        )
    if t.concurrent_splits > 1 and t.microbatches > 1:
        raise ConfigError(
            f"config.train.concurrent_splits={t.concurrent_splits} and microbatches="
            f"{t.microbatches} both split the batch (concurrently for CPU cores, in sequence "
            "for memory); set one of them to 1"
        )


def check_optimizer(o: Any) -> None:
    if o.spike_factor and o.spike_factor <= 1:
        raise ConfigError(
            f"config.optimizer.spike_factor={o.spike_factor} would skip ordinary "
            "updates; use a factor > 1 (e.g. 5) or 0 to turn the guard off"
        )
    if o.schedule == "noam" and o.warmup_steps <= 0:
        raise ConfigError("config.optimizer.warmup_steps must be > 0 for the noam schedule")
    if o.cooldown_fraction and o.cooldown_steps:
        raise ConfigError(
            f"config.optimizer.cooldown_fraction={o.cooldown_fraction} and "
            f"cooldown_steps={o.cooldown_steps} are two cooldowns; set one of them to 0"
        )


def check_decode(dc: Any) -> None:
    if dc.max_length_ratio and dc.min_length_ratio > dc.max_length_ratio:
        raise ConfigError(
            f"config.decode.min_length_ratio={dc.min_length_ratio} exceeds "
            f"max_length_ratio={dc.max_length_ratio}"
        )


# Across sections ---------------------------------------------------------------------------


def check_experiment(e: Any) -> None:
    d, t, o, m = e.data, e.train, e.optimizer, e.model
    if d.task == "classify" and m.num_classes < 2:
        raise ConfigError(
            f"config.data.task='classify' needs model.num_classes >= 2 (it is "
            f"{m.num_classes}); set it to the task's classes (listops: 10)"
        )
    if d.task in ("recall", "classify"):
        if d.pack:
            raise ConfigError(
                f"config.data.task={d.task!r} reads one generated example per row; set "
                "data.pack=False"
            )
        if t.embedding_init != "random":
            raise ConfigError(
                f"config.train.embedding_init={t.embedding_init!r} counts words of text "
                f"pairs; data.task={d.task!r} has none: use embedding_init=random"
            )
    if t.init_from and (d.task != "translation" or d.tokenizer):
        raise ConfigError(
            f"config.train.init_from={t.init_from!r} brings a translation model and its "
            f"tokenizer; it needs data.task='translation' (it is {d.task!r}) and no "
            f"data.tokenizer (it is {d.tokenizer!r})"
        )
    if d.task == "classify" and m.num_encoder_layers == 0:
        raise ConfigError(
            "config.data.task='classify' runs an encoder: set model.num_encoder_layers >= 1"
        )
    if d.pack and not d.stream and m.sparse_attention and m.attention_impl == "splash":
        layers = parse_spec(m.attention_pattern, m.attention_block_size)
        texts = [grammar.parse_spec_texts(m.attention_pattern, i) for i in range(len(layers))]
        anchored = sorted({
            text for names, layer in zip(texts, layers, strict=True)
            for text, p in zip(names, layer, strict=True) if not p.offset_invariant
        })  # fmt: skip
        if anchored:
            raise ConfigError(
                "config.model.attention_impl='splash' on packed rows (data.pack): its masks "
                "are one static mask a head, counted from the row's start, and "
                f"{', '.join(anchored)} count from each sequence's start; use "
                "attention_impl=blocked, or data.pack=False"
            )
    if d.max_length > m.max_len:
        raise ConfigError(
            f"config.data.max_length={d.max_length} exceeds model.max_len={m.max_len}; "
            "raise model.max_len or lower data.max_length"
        )
    if m.sparse_attention and m.attention_block_size > d.max_length:
        raise ConfigError(
            f"config.model.attention_block_size={m.attention_block_size} is larger than the "
            f"sequences (data.max_length={d.max_length}): the sparse pattern would be one "
            "padded block; choose a block that divides data.max_length, e.g. "
            f"{max(1, d.max_length // 4)}"
        )
    if t.best_metric == "bleu" and not (t.eval_bleu_sentences > 0 and d.task == "translation"):
        raise ConfigError(
            "config.train.best_metric='bleu' needs a translation task and "
            f"config.train.eval_bleu_sentences > 0 (got task={d.task!r}, "
            f"eval_bleu_sentences={t.eval_bleu_sentences}); set eval_bleu_sentences=128 "
            "or choose best_metric=loss"
        )
    if t.max_minutes and (o.schedule == "warmup_cosine" or o.cooldown_steps):
        raise ConfigError(
            f"config.train.max_minutes={t.max_minutes} stops at a step nobody knows in "
            f"advance, but optimizer.schedule={o.schedule!r} with cooldown_steps="
            f"{o.cooldown_steps} is shaped by train.num_steps; use the noam or constant "
            "schedule with optimizer.cooldown_fraction instead of cooldown_steps, or set "
            "max_minutes=0"
        )
    updates = t.num_steps // o.grad_accum_steps
    room = max(updates - o.warmup_steps, 0)
    if not 0 <= o.cooldown_steps <= room:
        raise ConfigError(
            f"config.optimizer.cooldown_steps={o.cooldown_steps} must be in [0, {room}]: "
            f"the cooldown fits after the {o.warmup_steps} warmup updates of the "
            f"{updates} updates of the run (0 = none)"
        )
