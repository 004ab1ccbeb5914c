"""Experiment configs: the ml_collections sections around the model, and their checks.

An experiment config (``configs/*.py``) has four sections:

* ``model``: the fields of :class:`flaxformer_lite.config.ModelConfig`;
* ``data``: corpus, direction, lengths, packing;
* ``train``: steps, batch, parallelism, logging/eval/checkpoint cadence;
* ``optimizer``: Adam and its schedule.

``base_config()`` gives every field a default (the paper's training recipe),
``apply_variants(config, arg)`` applies ``get_config`` arguments such as
``debug`` (a seconds-long CPU run), and ``validate_experiment`` checks all of
it, before any data is read.
"""

from __future__ import annotations

import re

import ml_collections

from flaxformer_lite.config import ConfigError, ModelConfig, model_config_dict, model_config_from

EXPERIMENT_SECTIONS = {
    "model": None,  # validated by ModelConfig
    "data": {
        "task": str,  # translation (encoder-decoder) | lm (decoder-only, on target_lang)
        "dataset": str,  # local builder name (ding_de_en, bible_en_es) or any TFDS name
        "source_lang": str,  # feature read as the source sentence
        "target_lang": str,  # feature read as the target sentence
        "data_dir": str,  # where TFDS datasets are written/read
        "train_splits": str,  # comma-separated; split:N keeps a fixed subset of N examples
        # Splits after the first are auxiliary (e.g. dictionary phrases): keep only pairs
        # whose every word occurs >= aux_min_count times in the first split (0 = all) ...
        "aux_min_count": int,
        # ... and start their source with this tag (a reserved vocabulary symbol; "" = none)
        "aux_tag": str,
        # Also train every pair reversed (target -> source), with this tag (<name>, a
        # reserved symbol) starting the reversed source; "" = one direction only. The
        # configured direction stays untagged, so translation needs no tag.
        "reverse_tag": str,
        # An auxiliary split:N draws a fresh N of its (filtered) pairs every epoch, in
        # turn, so all of them are seen while they keep the share of N; False = the same
        # fixed N every epoch (no effect on splits without :N)
        "resample_subsets": bool,
        "eval_split": str,
        "test_split": str,
        "max_length": int,  # tokens per side (incl. EOS); also the packed row length
        "too_long": str,  # drop | truncate
        "pack": bool,
        "stream": bool,  # lm only: read the split as one running text cut into max_length rows
        "tokenizer_max_sentences": int,
        # >0: subword regularization (Kudo 2018): every epoch each training pair gets a
        # segmentation sampled from the unigram model with this smoothing (smaller = more
        # varied; 0.1 is very noisy, 0.5 nearly the best segmentation); 0 = off
        "subword_alpha": float,
    },
    "train": {
        "seed": int,
        "batch_size": int,  # rows per step, all devices together
        "num_steps": int,
        # >0: also stop once the training command has run this many minutes (a wall-clock
        # budget: the step count then depends on the machine); 0 = train num_steps
        "max_minutes": float,
        "label_smoothing": float,
        "parallelism": str,  # jit (sharded over a device mesh) | pmap
        "concurrent_splits": int,  # >1: the batch as k independent chains (uses CPU cores)
        "log_every": int,
        "eval_every": int,
        "checkpoint_every": int,
        "keep_checkpoints": int,
        "best_metric": str,  # validation metric that selects the best checkpoint
        "eval_batches": int,  # 0 = the whole validation split
        "eval_bleu_sentences": int,  # greedy BLEU on this many validation sentences; 0 = off
        # random | ppmi: start the token embeddings from PPMI co-occurrence vectors of
        # the pairs of embedding_init_splits ("" = data.train_splits); see data/cooccurrence.py
        "embedding_init": str,
        "embedding_init_splits": str,
    },
    "optimizer": {
        "b1": float,
        "b2": float,
        "eps": float,
        "schedule": str,  # noam | warmup_cosine | constant
        "learning_rate": float,  # noam: a multiplier (paper 1.0); others: the peak value
        "warmup_steps": int,
        # >0: the last cooldown_steps updates scale the schedule down linearly to zero
        # (warmup-stable-decay; the noam tail is otherwise still at half its peak)
        "cooldown_steps": int,
        # >0: the last fraction of the run scales the learning rate down linearly to zero,
        # the run's end being train.num_steps or train.max_minutes, whichever comes
        # first (the factor is computed from the clock each step; unlike cooldown_steps
        # it works with a wall-clock budget)
        "cooldown_fraction": float,
        "clip_grad_norm": float,  # 0 = off
        "grad_accum_steps": int,  # >1: optax.MultiSteps
        "weight_decay": float,  # 0 = Adam (paper); >0 = AdamW
        # >0: keep a moving average of the parameters; evaluation, the best checkpoint
        # and translation use it (e.g. 0.99 averages over the last ~100 updates)
        "ema_decay": float,
        # the token embeddings learn at this multiple of the learning rate (1 = the same)
        "embedding_lr_scale": float,
    },
}
# Fields added after runs were saved: a saved config without them means these values.
ADDED_FIELDS = {
    "data": {
        "aux_min_count": 0,
        "aux_tag": "",
        "reverse_tag": "",
        "subword_alpha": 0.0,
        "resample_subsets": False,
    },
    "train": {
        "concurrent_splits": 1,
        "embedding_init": "random",
        "embedding_init_splits": "",
        "max_minutes": 0.0,
    },
    "optimizer": {
        "ema_decay": 0.0,
        "embedding_lr_scale": 1.0,
        "cooldown_steps": 0,
        "cooldown_fraction": 0.0,
    },
}


def with_added_fields(values: dict) -> dict:
    """A saved run's config dict with the later-added fields at their defaults."""
    for section, fields in ADDED_FIELDS.items():
        for name, default in fields.items():
            values.setdefault(section, {}).setdefault(name, default)
    return values


PARALLELISM = ("jit", "pmap")
EMBEDDING_INITS = ("random", "ppmi")
TASKS = ("translation", "lm")
# "bleu": the greedy validation BLEU of train.eval_bleu_sentences sentences (translation).
BEST_METRICS = {"loss": "min", "nll": "min", "perplexity": "min", "accuracy": "max", "bleu": "max"}


def parse_train_splits(spec: str) -> list[tuple[str, int | None]]:
    """``"train,train_phrases:20000"`` -> [("train", None), ("train_phrases", 20000)].

    ``split:N`` keeps a fixed random subset of N examples (the same on every
    machine and run), e.g. to mix a little of a large auxiliary split.
    """
    out = []
    for item in filter(None, (s.strip() for s in spec.split(","))):
        name, _, count = item.partition(":")
        if count and not (count.isdigit() and int(count) > 0):
            raise ConfigError(
                f"config.data.train_splits={spec!r}: {item!r} needs a positive example count "
                "after ':' (e.g. train_phrases:20000)"
            )
        out.append((name, int(count) if count else None))
    if not out:
        raise ConfigError("config.data.train_splits is empty; name at least one split")
    return out


def validate_experiment(config) -> ModelConfig:
    """Check every section of an experiment config; return the model's ModelConfig.

    Runs before any data is read, so a typo costs nothing.
    """
    from flaxformer_lite.training.schedules import SCHEDULES

    for section, fields in EXPERIMENT_SECTIONS.items():
        if section not in config:
            raise ConfigError(f"the config has no {section!r} section; see configs/ende_small.py")
        if fields is None:
            continue
        present = set(config[section].keys())
        missing = sorted(set(fields) - present)
        unknown = sorted(present - set(fields))
        if missing or unknown:
            raise ConfigError(
                f"config.{section}: missing fields {missing}, unknown fields {unknown}; "
                f"expected {sorted(fields)}"
            )
        for name, kind in fields.items():
            value = config[section][name]
            ok = isinstance(value, kind) and not (kind is int and isinstance(value, bool))
            if kind is float and isinstance(value, int) and not isinstance(value, bool):
                ok = True
            if not ok:
                raise ConfigError(
                    f"config.{section}.{name}={value!r} must be of type {kind.__name__}"
                )
    model = model_config_from(config)
    d, t, o = config.data, config.train, config.optimizer

    def positive(section, name, value):
        if value <= 0:
            raise ConfigError(f"config.{section}.{name}={value!r} must be > 0")

    for name in ("max_length", "tokenizer_max_sentences"):
        positive("data", name, d[name])
    for name in (
        "batch_size",
        "num_steps",
        "log_every",
        "eval_every",
        "checkpoint_every",
        "keep_checkpoints",
    ):
        positive("train", name, t[name])
    for name in ("eps", "learning_rate"):
        positive("optimizer", name, o[name])
    positive("optimizer", "grad_accum_steps", o.grad_accum_steps)
    if d.too_long not in ("drop", "truncate"):
        raise ConfigError(f"config.data.too_long={d.too_long!r}; choose drop or truncate")
    if d.task not in TASKS:
        raise ConfigError(f"config.data.task={d.task!r}; choose one of {', '.join(TASKS)}")
    parse_train_splits(d.train_splits)  # resample_subsets only touches split:N after the first
    if not 0.0 <= d.subword_alpha <= 1.0:
        raise ConfigError(
            f"config.data.subword_alpha={d.subword_alpha} must be in [0, 1] (0 = off; "
            "Kudo 2018 uses 0.1-0.5)"
        )
    if d.subword_alpha and d.stream:
        raise ConfigError(
            "config.data.subword_alpha needs sentence pairs; it does not apply to "
            "data.stream=True (running text); set it to 0"
        )
    if d.aux_min_count < 0:
        raise ConfigError(
            f"config.data.aux_min_count={d.aux_min_count} must be >= 0 (0 keeps every pair)"
        )
    for name, example in (("aux_tag", "<dict>"), ("reverse_tag", "<2en>")):
        tag = d[name]
        if tag and (d.task != "translation" or not re.fullmatch(r"<\w+>", tag)):
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
            f"config.data.stream=True needs data.task='lm' (it is {d.task!r}): translation "
            "pairs cannot be cut into running text"
        )
    if d.resample_subsets and (d.subword_alpha or d.stream):
        raise ConfigError(
            "config.data.resample_subsets=True cannot be combined with subword_alpha > 0 or "
            "stream=True (each redraws the epoch's examples its own way); set "
            "data.resample_subsets=False or turn the other off"
        )
    if d.task == "translation" and d.source_lang == d.target_lang:
        raise ConfigError(f"config.data.source_lang and target_lang are both {d.source_lang!r}")
    if d.max_length > model.max_len:
        raise ConfigError(
            f"config.data.max_length={d.max_length} exceeds model.max_len={model.max_len}; "
            "raise model.max_len or lower data.max_length"
        )
    if not 0.0 <= t.label_smoothing < 1.0:
        raise ConfigError(f"config.train.label_smoothing={t.label_smoothing} must be in [0, 1)")
    if t.parallelism not in PARALLELISM:
        raise ConfigError(
            f"config.train.parallelism={t.parallelism!r}; choose one of {', '.join(PARALLELISM)}"
        )
    splits = t.concurrent_splits
    if splits < 1 or t.batch_size % splits:
        raise ConfigError(
            f"config.train.concurrent_splits={splits} must be >= 1 and divide "
            f"train.batch_size={t.batch_size} (per device)"
        )
    if t.best_metric not in BEST_METRICS:
        raise ConfigError(
            f"config.train.best_metric={t.best_metric!r}; choose one of {', '.join(BEST_METRICS)}"
        )
    if t.eval_bleu_sentences < 0:
        raise ConfigError(f"config.train.eval_bleu_sentences={t.eval_bleu_sentences} must be >= 0")
    bleu_ok = t.eval_bleu_sentences > 0 and config.data.task == "translation"
    if t.best_metric == "bleu" and not bleu_ok:
        raise ConfigError(
            "config.train.best_metric='bleu' needs a translation task and "
            f"config.train.eval_bleu_sentences > 0 (got task={config.data.task!r}, "
            f"eval_bleu_sentences={t.eval_bleu_sentences}); set eval_bleu_sentences=128 or "
            "choose best_metric=loss"
        )
    if t.embedding_init not in EMBEDDING_INITS:
        raise ConfigError(
            f"config.train.embedding_init={t.embedding_init!r}; choose one of "
            f"{', '.join(EMBEDDING_INITS)}"
        )
    if t.embedding_init_splits:
        parse_train_splits(t.embedding_init_splits)
    if t.eval_batches < 0:
        raise ConfigError(f"config.train.eval_batches={t.eval_batches} must be >= 0 (0 = all)")
    for name in ("b1", "b2"):
        if not 0.0 <= o[name] < 1.0:
            raise ConfigError(f"config.optimizer.{name}={o[name]} must be in [0, 1)")
    if o.schedule not in SCHEDULES:
        raise ConfigError(
            f"config.optimizer.schedule={o.schedule!r}; choose one of {', '.join(SCHEDULES)}"
        )
    if o.embedding_lr_scale < 0:
        raise ConfigError(
            f"config.optimizer.embedding_lr_scale={o.embedding_lr_scale} must be >= 0 "
            "(0 freezes the embeddings, 1 trains them like the rest)"
        )
    if not 0.0 <= o.ema_decay < 1.0:
        raise ConfigError(
            f"config.optimizer.ema_decay={o.ema_decay} must be in [0, 1) (0 = no average; "
            "0.99-0.999 are usual)"
        )
    if o.schedule == "noam" and o.warmup_steps <= 0:
        raise ConfigError("config.optimizer.warmup_steps must be > 0 for the noam schedule")
    if t.max_minutes < 0:
        raise ConfigError(
            f"config.train.max_minutes={t.max_minutes} must be >= 0 (0 = no time limit; "
            "training then runs train.num_steps steps)"
        )
    if t.max_minutes and (o.schedule == "warmup_cosine" or o.cooldown_steps):
        raise ConfigError(
            f"config.train.max_minutes={t.max_minutes} stops at a step nobody knows in "
            f"advance, but optimizer.schedule={o.schedule!r} with cooldown_steps="
            f"{o.cooldown_steps} is shaped by train.num_steps; use the noam or constant "
            "schedule with optimizer.cooldown_fraction instead of cooldown_steps, or set "
            "max_minutes=0"
        )
    if not 0.0 <= o.cooldown_fraction < 1.0:
        raise ConfigError(
            f"config.optimizer.cooldown_fraction={o.cooldown_fraction} must be in [0, 1): "
            "the share of the run (steps or minutes) over which the learning rate falls "
            "to zero (0 = none; 0.2-0.5 are usual)"
        )
    if o.cooldown_fraction and o.cooldown_steps:
        raise ConfigError(
            f"config.optimizer.cooldown_fraction={o.cooldown_fraction} and cooldown_steps="
            f"{o.cooldown_steps} are two cooldowns; set one of them to 0"
        )
    updates = t.num_steps // o.grad_accum_steps
    if not 0 <= o.cooldown_steps <= max(updates - o.warmup_steps, 0):
        raise ConfigError(
            f"config.optimizer.cooldown_steps={o.cooldown_steps} must be in [0, "
            f"{max(updates - o.warmup_steps, 0)}]: the cooldown fits after the "
            f"{o.warmup_steps} warmup updates of the {updates} updates of the run "
            "(0 = none)"
        )
    if o.warmup_steps < 0 or o.clip_grad_norm < 0 or o.weight_decay < 0:
        raise ConfigError(
            "config.optimizer.warmup_steps, clip_grad_norm and weight_decay must be >= 0"
        )
    return model


def base_config(model: ModelConfig) -> ml_collections.ConfigDict:
    """Every section with defaults: the paper's optimizer (Adam 0.9/0.98/1e-9, noam,
    warmup 4000, label smoothing 0.1) on the local EN->DE corpus."""
    config = ml_collections.ConfigDict()
    config.model = model_config_dict(model)
    config.data = ml_collections.ConfigDict(
        {
            "task": "translation",
            "dataset": "ding_de_en",
            "source_lang": "en",  # EN->DE, the paper's direction
            "target_lang": "de",
            "data_dir": "data/tfds",
            "train_splits": "train",
            "aux_min_count": 0,
            "aux_tag": "",
            "reverse_tag": "",
            "resample_subsets": False,
            "eval_split": "validation",
            "test_split": "test",
            "max_length": 64,
            "too_long": "drop",
            "pack": True,
            "stream": False,
            "tokenizer_max_sentences": 1_000_000,
            "subword_alpha": 0.0,
        }
    )
    config.train = ml_collections.ConfigDict(
        {
            "seed": 0,
            "batch_size": 64,
            "num_steps": 100_000,
            "max_minutes": 0.0,
            "label_smoothing": 0.1,
            "parallelism": "jit",
            "concurrent_splits": 1,
            "log_every": 50,
            "eval_every": 1000,
            "checkpoint_every": 1000,
            "keep_checkpoints": 5,
            "best_metric": "loss",
            "eval_batches": 0,
            "eval_bleu_sentences": 0,
            "embedding_init": "random",
            "embedding_init_splits": "",
        }
    )
    config.optimizer = ml_collections.ConfigDict(
        {
            "b1": 0.9,
            "b2": 0.98,
            "eps": 1e-9,
            "schedule": "noam",
            "learning_rate": 1.0,
            "warmup_steps": 4000,
            "cooldown_steps": 0,
            "cooldown_fraction": 0.0,
            "clip_grad_norm": 0.0,
            "grad_accum_steps": 1,
            "weight_decay": 0.0,
            "ema_decay": 0.0,
            "embedding_lr_scale": 1.0,
        }
    )
    return config


VARIANTS = ("debug",)


def apply_variants(config: ml_collections.ConfigDict, arg: str | None) -> ml_collections.ConfigDict:
    """Apply comma-separated ``get_config`` arguments (``--config=configs/x.py:debug``).

    ``debug``: a tiny model and a few steps, seconds on a CPU, same code paths.
    """
    for variant in filter(None, (arg or "").split(",")):
        if variant not in VARIANTS:
            raise ConfigError(
                f"unknown config variant {variant!r}; choose from {', '.join(VARIANTS)}"
            )
        if variant == "debug":
            config.model.update(
                vocab_size=min(config.model.vocab_size, 400),
                d_model=32,
                num_heads=2,
                d_ff=64,
                num_encoder_layers=1,
                num_decoder_layers=1,
                d_k=None,
                d_v=None,
            )
            config.data.max_length = min(config.data.max_length, 32)
            config.data.tokenizer_max_sentences = 20_000
            config.train.update(
                batch_size=8,
                num_steps=6,
                max_minutes=0.0,  # seconds-long and step-bounded, whatever the machine
                log_every=2,
                eval_every=3,
                checkpoint_every=3,
                eval_batches=2,
                eval_bleu_sentences=min(config.train.eval_bleu_sentences, 8),
            )
            config.optimizer.warmup_steps = min(config.optimizer.warmup_steps, 4)
            if config.optimizer.cooldown_steps:
                config.optimizer.cooldown_steps = 2
    return config


def load_config(
    path: str, arg: str | None = None, overrides: dict | None = None
) -> ml_collections.ConfigDict:
    """The config of ``configs/x.py`` (its ``get_config(arg)``) with ``overrides``
    applied, for notebooks and scripts: ``load_config("configs/ende_small.py",
    "debug", {"train.num_steps": 20})`` is ``--config=configs/ende_small.py:debug
    --config.train.num_steps=20``. An unknown field or a missing file is a ConfigError."""
    import importlib.util
    from pathlib import Path

    file = Path(path)
    if not file.is_file():
        raise ConfigError(f"config file {path!r} not found; pass e.g. 'configs/ende_small.py'")
    spec = importlib.util.spec_from_file_location(f"config_{file.stem}", file)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    if not hasattr(module, "get_config"):
        raise ConfigError(f"{path} has no get_config(arg) function")
    config = module.get_config(arg)
    for key, value in (overrides or {}).items():
        section, _, name = key.partition(".")
        if section not in config or not name or name not in config[section]:
            raise ConfigError(
                f"unknown config field {key!r}; fields look like 'train.num_steps' "
                "(see flaxformer_lite/experiment.py and flaxformer_lite/config.py)"
            )
        try:
            config[section][name] = value
        except TypeError as e:
            raise ConfigError(f"config.{key}={value!r} has the wrong type ({e})") from None
    validate_experiment(config)
    return config
