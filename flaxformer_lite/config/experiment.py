"""Experiment configs: typed sections around the model, built and checked in one place.

An experiment has five sections, each a frozen dataclass whose fields are
declared once (type, default, allowed values, one-line meaning; see
:mod:`flaxformer_lite.config.fields`):

* ``model``: :class:`flaxformer_lite.config.model.ModelConfig`;
* ``data``: :class:`DataConfig`, corpus, direction, lengths, packing;
* ``train``: :class:`TrainConfig`, steps, batch, parallelism, cadence;
* ``optimizer``: :class:`OptimizerConfig`, Adam and its schedule;
* ``decode``: :class:`DecodeConfig`, how ``translate`` / ``evaluate`` decode by default.

``configs/*.py`` build an ``ml_collections.ConfigDict`` (:mod:`~flaxformer_lite.config.files`);
:meth:`ExperimentConfig.from_config` turns that into the typed config, the one place
where an unknown field, a wrong type or a bad value is reported, before any data is
read (the rules across fields: :mod:`~flaxformer_lite.config.rules`).
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Mapping
from typing import Any, NamedTuple

from flaxformer_lite.config import extensions, rules
from flaxformer_lite.config.fields import (
    NON_NEGATIVE,
    POSITIVE,
    RATE,
    UNIT_INTERVAL,
    Rule,
    Section,
    option,
)
from flaxformer_lite.config.launch import LaunchConfig
from flaxformer_lite.config.mesh import DEFAULT_MESH
from flaxformer_lite.config.model import ConfigError, ModelConfig

# translation: encoder-decoder on text pairs; lm: decoder-only on text; recall: decoder-only
# on a generated recall task's token ids, scored where its weights say; classify: an
# encoder and a classification head on a generated task (data/synthetic.py).
TASKS = ("translation", "lm", "recall", "classify")
TEXT_TASKS = ("translation", "lm")
TOO_LONG = ("drop", "truncate")
PARALLELISM = ("jit", "pmap")
SCHEDULES = ("noam", "warmup_cosine", "constant")  # built by training/schedules.py
EMBEDDING_INITS = ("random", "ppmi")
BEAM_STOPS = ("exact", "current", "finished")  # inference/decoding.py's beam_search
# "bleu": the greedy validation BLEU of train.eval_bleu_sentences sentences (translation).
BEST_METRICS = {"loss": "min", "nll": "min", "perplexity": "min", "accuracy": "max", "bleu": "max"}


class Split(NamedTuple):
    """One entry of a split list: a split's name and, for ``name:N``, how many of it."""

    name: str
    count: int | None = None


def parse_train_splits(spec: str, *, allow_empty: bool = False) -> tuple[Split, ...]:
    """``"train,train_phrases:20000"`` -> (Split("train"), Split("train_phrases", 20000)).

    ``split:N`` keeps a fixed random subset of N examples (the same on every
    machine and run), e.g. to mix a little of a large auxiliary split.
    """
    if isinstance(spec, tuple):  # already parsed
        return spec
    out = []
    for item in filter(None, (s.strip() for s in spec.split(","))):
        name, _, count = item.partition(":")
        if not name or (count and not (count.isdigit() and int(count) > 0)):
            raise ConfigError(
                f"split list {spec!r}: {item!r} needs a split name and, after ':', a "
                "positive example count (e.g. train_phrases:20000)"
            )
        out.append(Split(name, int(count) if count else None))
    if not out and not allow_empty:
        raise ConfigError(f"split list {spec!r} is empty; name at least one split")
    return tuple(out)


def format_splits(splits: tuple[Split, ...]) -> str:
    return ",".join(s.name if s.count is None else f"{s.name}:{s.count}" for s in splits)


def _optional_splits(spec: str) -> tuple[Split, ...]:
    return parse_train_splits(spec, allow_empty=True)


def parse_curve(spec: str) -> tuple[tuple[int, float], ...]:
    """``"600:5.1,1560:7.9"`` -> ((600, 5.1), (1560, 7.9)): a measured value by steps
    reached, the steps increasing ('' = none)."""
    if isinstance(spec, tuple):  # already parsed
        return spec
    points = []
    for item in filter(None, (s.strip() for s in spec.split(","))):
        step, _, value = item.partition(":")
        try:
            point = (int(step), float(value))
        except ValueError:
            point = None
        if point is None or point[0] <= 0 or (points and point[0] <= points[-1][0]):
            raise ConfigError(
                f"{item!r} is not a point 'steps:value' with more steps than the one before "
                "it (e.g. '600:5.1,1560:7.9')"
            )
        points.append(point)
    return tuple(points)


def format_curve(points: tuple[tuple[int, float], ...]) -> str:
    return ",".join(f"{step}:{value:g}" for step, value in points)


@dataclasses.dataclass(frozen=True)
class DataConfig(Section):
    """``config.data``: which corpus, which direction, how it is cut and packed."""

    NAME = "data"

    task: str = option(
        "translation", "translation (encoder-decoder), lm (decoder-only, on target_lang), "
        "recall or classify (generated tasks: mqar/..., needle/..., listops/...)",
        choices=TASKS,
    )  # fmt: skip
    dataset: str = option("ding_de_en", "ding_de_en | bible_en_es | files:PATH | a TFDS name")
    source_lang: str = option("en", "feature read as the source sentence")
    target_lang: str = option("de", "feature read as the target sentence (the LM's text)")
    data_dir: str = option("data/tfds", "where TFDS datasets are written and read")
    train_splits: tuple = option(
        (Split("train"),),
        "comma-separated training splits; split:N keeps a fixed subset of N examples",
        parse=parse_train_splits, unparse=format_splits,
    )  # fmt: skip
    aux_min_count: int = option(
        0, "auxiliary splits (after the first) keep pairs whose words all occur this "
        "often in the first split (0 = all)", rule=NON_NEGATIVE,
    )  # fmt: skip
    aux_tag: str = option("", "tag (<name>) starting an auxiliary pair's source; '' = none")
    reverse_tag: str = option(
        "", "also train every pair reversed, its source starting with this tag (<name>)"
    )
    resample_subsets: bool = option(
        False, "an auxiliary split:N draws a fresh N of its pairs every epoch, in turn"
    )
    eval_split: str = option("validation", "split evaluated during training")
    test_split: str = option("test", "split of the final evaluation")
    max_length: int = option(
        64, "tokens per side (EOS included); also the packed row length",
        rule=Rule(lambda v: v >= 2, "must be >= 2: a side holds at least a piece and its EOS"),
    )  # fmt: skip
    too_long: str = option("drop", "what happens to longer training pairs", choices=TOO_LONG)
    pack: bool = option(True, "pack several pairs into each row (segment ids keep them apart)")
    shards: int = option(
        0, "training data read in this many shards (0: one per process); the batches "
        "depend on it alone, so any process count dividing it resumes a run",
        rule=NON_NEGATIVE,
    )  # fmt: skip
    stream: bool = option(False, "lm only: read the split as one running text cut into rows")
    tokenizer: str = option(
        "", "path of an existing sentencepiece model to use instead of training one (a "
        "vocabulary shared across runs; pad/eos/bos/unk ids 0/1/2/3, at most "
        "model.vocab_size pieces); copied into the run folder ('' = train one)",
    )  # fmt: skip
    tokenizer_max_sentences: int = option(1_000_000, "sentences it learns from", rule=POSITIVE)
    tokenizer_max_characters: int = option(
        50_000_000, "and characters (sentencepiece: ~20 bytes each; 0 = any)", rule=NON_NEGATIVE
    )
    subword_alpha: float = option(
        0.0, "> 0: subword regularization, a sampled segmentation each epoch with this "
        "smoothing (0 = off)", rule=UNIT_INTERVAL,
    )  # fmt: skip

    def check(self) -> None:
        rules.check_data(self)

    @property
    def features(self) -> tuple[str, ...]:
        """The text features read: (source, target) for translation, (text,) for an LM."""
        if self.task == "translation":
            return (self.source_lang, self.target_lang)
        return (self.target_lang,)


@dataclasses.dataclass(frozen=True)
class TrainConfig(Section):
    """``config.train``: steps, batch, parallelism, and the cadence of logs, evals, saves."""

    NAME = "train"

    seed: int = option(0, "parameters, data order and dropout")
    batch_size: int = option(64, "rows per step, all devices together", rule=POSITIVE)
    num_steps: int = option(100_000, "training steps", rule=POSITIVE)
    max_minutes: float = option(
        0.0, "> 0: also stop once training has run this many minutes (0 = num_steps only)",
        rule=NON_NEGATIVE,
    )  # fmt: skip
    label_smoothing: float = option(0.1, "label smoothing of the loss (paper 0.1)", rule=RATE)
    parallelism: str = option(
        "jit", "jit (sharded over a device mesh) or pmap", choices=PARALLELISM
    )
    mesh: str = option(
        DEFAULT_MESH, "jit's device mesh 'data:N,fsdp:N,model:N' (-1: the devices left over)"
    )
    # Kept apart from microbatches for speed on CPU: the two halves' chains keep both
    # cores busy, 1.06x (tiny) and 1.09x (base-like) faster steps than one chain in
    # benchmarks/results/train_step.md; on an accelerator leave it at 1.
    concurrent_splits: int = option(
        1, "> 1: the batch as k independent chains of one program (uses CPU cores)", rule=POSITIVE
    )
    microbatches: int = option(
        1, "> 1: the batch as k micro-batches in sequence, gradients added (the same "
        "update with 1/k of the activation memory)", rule=POSITIVE,
    )  # fmt: skip
    log_every: int = option(50, "steps between logged measurements", rule=POSITIVE)
    wandb_project: str = option("", "Weights & Biases project beside TensorBoard ('' = off)")
    profile: str = option("", "START:STEPS: a trace of those steps in <workdir>/profile")
    log_examples: bool = option(
        False, "write each step's training example ids to examples.jsonl (audits the data "
        "order over resumes; ids of process 0's rows)",
    )  # fmt: skip
    eval_every: int = option(1000, "steps between validations", rule=POSITIVE)
    checkpoint_every: int = option(1000, "steps between checkpoints", rule=POSITIVE)
    keep_checkpoints: int = option(5, "last checkpoints kept", rule=POSITIVE)
    # The paper averages the last 5 checkpoints of a 12-hour run, its last ~7%. A
    # wall-clock budget on a slow machine holds few checkpoint_every steps: without
    # these, `average --num=4` reached back two thirds of a 600-step run and lost 1.2
    # BLEU (3 seeds; experiments/translation_recipe, "Averaging the end of a run").
    final_checkpoints: int = option(
        4, "> 0: this many checkpoints evenly over the last final_window of the steps the "
        "run reaches (max_minutes' end projected from the pace; a step budget only where "
        "checkpoint_every leaves fewer there), the last at its end (0 = off)",
        rule=NON_NEGATIVE,
    )  # fmt: skip
    final_window: float = option(
        0.25, "the late share of a run's steps that final_checkpoints fill and `average` "
        "takes its checkpoints from", rule=UNIT_INTERVAL,
    )  # fmt: skip
    expected_bleu: tuple = option(
        (), "test BLEU the recipe gave by steps reached, 'steps:BLEU,...' (its experiment "
        "record): the log says what this machine's budget will reach ('' = off)",
        parse=parse_curve, unparse=format_curve,
    )  # fmt: skip
    best_metric: str = option(
        "loss", "validation metric that selects the best checkpoint", choices=tuple(BEST_METRICS)
    )
    eval_batches: int = option(0, "validation batches per evaluation (0 = all)", rule=NON_NEGATIVE)
    eval_bleu_sentences: int = option(
        0, "greedy BLEU on this many validation sentences per evaluation (0 = off)",
        rule=NON_NEGATIVE,
    )  # fmt: skip
    attention_stats_every: int = option(
        0, "> 0: every N steps, log each attention head's entropy, distance, largest logit "
        "and mass inside attention_stats_patterns, on a validation batch (0 = off)",
        rule=NON_NEGATIVE,
    )  # fmt: skip
    attention_stats_patterns: str = option(
        "local:window=8 topk:k=8", "patterns (space-separated specs) whose share of the "
        "attention mass attention_stats_every logs",
    )  # fmt: skip
    embedding_init: str = option(
        "random", "start of the token embeddings: random, or PPMI co-occurrence vectors",
        choices=EMBEDDING_INITS,
    )  # fmt: skip
    init_from: str = option(
        "", "start from a transformers Marian / OPUS-MT model: hf:DIR (its architecture, "
        "weights and tokenizer; the model fields it sets override the config's)",
    )  # fmt: skip
    embedding_init_splits: tuple = option(
        (), "splits the PPMI vectors are counted on ('' = data.train_splits)",
        parse=_optional_splits, unparse=format_splits,
    )  # fmt: skip

    def check(self) -> None:
        rules.check_train(self)


@dataclasses.dataclass(frozen=True)
class OptimizerConfig(Section):
    """``config.optimizer``: Adam (the paper's 0.9/0.98/1e-9) and the learning-rate schedule."""

    NAME = "optimizer"

    b1: float = option(0.9, "Adam beta1", rule=RATE)
    b2: float = option(0.98, "Adam beta2 (paper 0.98)", rule=RATE)
    eps: float = option(1e-9, "Adam epsilon (paper 1e-9)", rule=POSITIVE)
    schedule: str = option("noam", "learning-rate schedule", choices=SCHEDULES)
    learning_rate: float = option(
        1.0, "noam: a multiplier (paper 1.0); others: the peak value", rule=POSITIVE
    )
    warmup_steps: int = option(4000, "warmup updates (paper 4000)", rule=NON_NEGATIVE)
    cooldown_steps: int = option(
        0, "> 0: the last cooldown_steps updates scale the rate linearly to zero"
    )
    cooldown_fraction: float = option(
        0.0, "> 0: the last fraction of the run (steps or minutes) scales the rate to zero",
        rule=RATE,
    )  # fmt: skip
    clip_grad_norm: float = option(0.0, "global gradient-norm clip (0 = off)", rule=NON_NEGATIVE)
    grad_accum_steps: int = option(1, "> 1: accumulate this many micro-batches", rule=POSITIVE)
    weight_decay: float = option(0.0, "0 = Adam (paper); > 0 = AdamW", rule=NON_NEGATIVE)
    ema_decay: float = option(
        0.0, "> 0: evaluate, keep and translate with a moving average of the parameters",
        rule=RATE,
    )  # fmt: skip
    embedding_lr_scale: float = option(
        1.0, "the token embeddings learn at this multiple of the rate", rule=NON_NEGATIVE
    )
    spike_factor: float = option(
        0.0, "> 1: skip an update whose gradient norm exceeds this multiple of the median "
        "of the last spike_window accepted ones (counted in the logs; 0 = off)",
        rule=NON_NEGATIVE,
    )  # fmt: skip
    spike_window: int = option(
        100, "accepted gradient norms the spike guard's median is taken over", rule=POSITIVE
    )

    def check(self) -> None:
        rules.check_optimizer(self)


@dataclasses.dataclass(frozen=True)
class DecodeConfig(Section):
    """``config.decode``: how ``translate`` and ``evaluate`` decode when not told."""

    NAME = "decode"

    beam_size: int = option(4, "beam size of translate/evaluate (1 = greedy)", rule=POSITIVE)
    alpha: float = option(0.6, "length penalty exponent (paper 0.6)", rule=NON_NEGATIVE)
    max_extra: int = option(50, "outputs get at most source length + max_extra", rule=POSITIVE)
    no_repeat_ngram: int = option(0, "forbid repeating any n tokens (0 = off)", rule=NON_NEGATIVE)
    min_length_ratio: float = option(0.0, "outputs get >= ratio x source pieces (0 = "
        "off)", rule=NON_NEGATIVE)  # fmt: skip
    max_length_ratio: float = option(0.0, "outputs get <= ratio x source pieces + 5 (0 "
        "= off)", rule=NON_NEGATIVE)  # fmt: skip
    beam_stop: str = option("current", "when a beam row is done: current (beam_size "
        "ended, the worst beats every live beam at its current length), exact (no live "
        "beam can still win), finished (beam_size ended)", choices=BEAM_STOPS)  # fmt: skip
    batch_tokens: int = option(512, "source tokens per decoding batch (sorted by "
        "length)", rule=POSITIVE)  # fmt: skip
    streams: int = option(0, "decoding batches run at once (0 = 2 on CPU for a model on "
        "one device, else 1)", rule=NON_NEGATIVE)  # fmt: skip
    continuous: bool = option(True, "greedy and beam search: a row (or beams) whose "
        "sentence ended takes the next one (continuous batching; dense self-attention; "
        "greedy without an n-gram ban or length ratio; the same outputs)")  # fmt: skip

    def check(self) -> None:
        rules.check_decode(self)


SECTIONS: dict[str, type] = {
    "data": DataConfig,
    "train": TrainConfig,
    "optimizer": OptimizerConfig,
    "decode": DecodeConfig,
    "launch": LaunchConfig,
}


@dataclasses.dataclass(frozen=True)
class ExperimentConfig:
    """A whole experiment, typed and checked (sections and the checks across them)."""

    model: ModelConfig
    data: DataConfig = DataConfig()
    train: TrainConfig = TrainConfig()
    optimizer: OptimizerConfig = OptimizerConfig()
    decode: DecodeConfig = DecodeConfig()
    launch: LaunchConfig = LaunchConfig()  # a sweep's launcher (config/launch.py)

    def __post_init__(self):
        rules.check_experiment(self)

    @classmethod
    def from_config(cls, config: Any) -> ExperimentConfig:
        """The typed config of an ml_collections ``ConfigDict`` (or a plain dict, e.g. a
        saved ``config.json``). A missing field or section takes its default, which is
        what a run saved before that field existed means; an unknown one is an error."""
        if isinstance(config, ExperimentConfig):
            return config
        values = config.to_dict() if hasattr(config, "to_dict") else config
        if not isinstance(values, Mapping):  # a saved config.json is data, of one shape
            raise ConfigError(
                f"the config is {type(values).__name__}, not a mapping of sections "
                "(model, data, ...)"
            )
        for name, section in values.items():
            if not isinstance(section, Mapping):
                raise ConfigError(
                    f"the config's section {name!r} is {type(section).__name__}, not a "
                    "mapping of fields"
                )
        unknown = sorted(set(values) - {"model", *SECTIONS})
        if unknown:
            raise ConfigError(
                f"the config has unknown sections {unknown}; sections are model, "
                f"{', '.join(SECTIONS)}"
            )
        if "model" not in values:
            raise ConfigError("the config has no 'model' section; see configs/ende_small.py")
        named = values["model"].get("extensions")
        if not isinstance(named, str | list | tuple | None):
            raise ConfigError(
                f"config.model.extensions={named!r} must be of type str (files, comma-separated)"
            )
        extensions.load(named)  # before names are checked
        sections = {name: kind.from_dict(values.get(name, {})) for name, kind in SECTIONS.items()}
        return cls(model=ModelConfig.from_dict(values["model"]), **sections)

    def to_dict(self) -> dict[str, dict[str, Any]]:
        """Plain values, as ``config.json`` and the ml_collections layer hold them."""
        out = {"model": self.model.to_dict()}
        out.update({name: getattr(self, name).to_dict() for name in SECTIONS})
        return out

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), indent=2)


def validate_experiment(config) -> ModelConfig:
    """Check every section of an experiment config; return its ModelConfig
    (``ExperimentConfig.from_config(config).model``)."""
    return ExperimentConfig.from_config(config).model
