"""Config files: ``configs/*.py`` and their variants, as ``ml_collections`` dicts.

A config file's ``get_config(arg)`` starts from :func:`base_config` (every field at
its default, generated from the sections' dataclasses), changes fields, and applies
variants such as ``:debug`` (:func:`apply_variants`); the command line overrides
fields (``--config.train.batch_size=32``), scripts and notebooks use
:func:`load_config`. ``python -m flaxformer_lite.main fields`` prints
:func:`field_table`.
"""

from __future__ import annotations

import dataclasses
import difflib
import importlib.util
from pathlib import Path

import ml_collections

from flaxformer_lite.config.experiment import SECTIONS, ExperimentConfig
from flaxformer_lite.config.fields import ConfigError, describe, type_name
from flaxformer_lite.config.model import ModelConfig, model_config_dict


def base_config(model: ModelConfig) -> ml_collections.ConfigDict:
    """Every section at its defaults (the paper's optimizer: Adam 0.9/0.98/1e-9, noam,
    warmup 4000, label smoothing 0.1, on the local EN->DE corpus) around ``model``."""
    config = ml_collections.ConfigDict()
    config.model = model_config_dict(model)
    for name, kind in SECTIONS.items():
        config[name] = ml_collections.ConfigDict(kind().to_dict())
    return config


def field_table() -> str:
    """Every field of every section with its type, default and meaning (``main fields``)."""
    lines = []
    for name, kind in {"model": ModelConfig, **SECTIONS}.items():
        lines.append(f"{name}:")
        for field, type_, default, meaning in describe(kind):
            lines.append(f"  {name}.{field}: {type_} = {default}")
            if meaning:
                lines.append(f"      {meaning}")
    return "\n".join(lines)


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
                final_checkpoints=0,  # the checkpoints are the cadence's, as a test counts
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
                "(python -m flaxformer_lite.main fields lists them)"
            )
        try:
            config[section][name] = value
        except TypeError as e:
            raise ConfigError(f"config.{key}={value!r} has the wrong type ({e})") from None
    ExperimentConfig.from_config(config)
    return config


def below_a_value(paths: list[str]) -> str | None:
    """The message for an override that reaches below a field holding a value
    (``model.attention.pattern``, where ``model.attention`` is a string), or None."""
    kinds = {"model": ModelConfig, **SECTIONS}
    for given in paths:
        section, field, *rest = given.split(".") + [""]
        known = {f.name: f for f in dataclasses.fields(kinds[section])} if section in kinds else {}
        if rest and rest[0] and field in known:
            return (
                f"--config.{given}: {section}.{field} holds a value "
                f"({type_name(known[field].type)}), not fields; set it whole: "
                f"--config.{section}.{field}=VALUE (`python -m flaxformer_lite.main fields`)"
            )
    return None


def unknown_field(name: str, paths: list[str]) -> str:
    """``unknown config field 'model.dropout_rate'`` with the section's fields that share
    a word with it (``*_dropout``), or else the closest names; ``paths`` the overrides
    given (``model.dropout_rate``), to find the one that holds ``name``."""
    given = next((p for p in paths if name in p.split(".")), name)
    section = given.partition(".")[0] if "." in given else ""
    kinds = {"model": ModelConfig, **SECTIONS}
    if section == name or section not in kinds:  # the section itself is unknown
        close = difflib.get_close_matches(section or name, list(kinds), n=1)
        return (
            f"unknown config section {section or name!r} in {given!r}"
            + (f" (did you mean {close[0]!r}?)" if close else "")
            + f"; sections are {', '.join(kinds)} (`python -m flaxformer_lite.main fields`)"
        )
    known = [f.name for f in dataclasses.fields(kinds[section])] if section in kinds else []
    close = difflib.get_close_matches(name, known, n=1, cutoff=0.8)  # a typo
    words = {w for w in name.split("_") if len(w) > 2}
    alike = [k for k in known if words & set(k.split("_"))]  # another word for one field
    alike = alike or difflib.get_close_matches(name, known, n=3)
    hint = f" (did you mean {close[0]!r}?)" if close else ""
    if alike and not close:
        hint = f"; {section}'s fields like it: {', '.join(alike)}"
    return (
        f"unknown config field {given!r}{hint} "
        "(`python -m flaxformer_lite.main fields` lists every field)"
    )
