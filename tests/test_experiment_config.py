"""Experiment configs: typed sections, one clear error per bad field, saved runs, the files."""

import dataclasses
import json
import subprocess
import sys

import ml_collections
import pytest

from flaxformer_lite.config.experiment import (
    SECTIONS,
    ExperimentConfig,
    Split,
    validate_experiment,
)
from flaxformer_lite.config.files import base_config, field_table
from flaxformer_lite.config.model import ConfigError, ModelConfig
from flaxformer_lite.training.train import train_and_evaluate
from tests.fixtures import ROOT, load_config


def test_config_errors_come_before_data(tmp_path):
    config = load_config()
    config.data.data_dir = str(tmp_path / "does-not-exist")
    config.train.parallelism = "spmd"
    with pytest.raises(
        ConfigError, match="parallelism='spmd' is not allowed; choose one of jit, pmap"
    ):
        train_and_evaluate(config, tmp_path / "run")
    assert not (tmp_path / "run").exists()
    config = load_config()
    config.data.max_length = 1024
    with pytest.raises(ConfigError, match="exceeds model.max_len"):
        validate_experiment(config)
    config = load_config()
    config.train.concurrent_splits = 3  # the debug batch has 8 rows
    with pytest.raises(ConfigError, match="concurrent_splits=3 must divide"):
        validate_experiment(config)
    config = load_config()
    config.train.best_metric = "bleu"
    config.train.eval_bleu_sentences = 0
    message = "best_metric='bleu' needs a translation task and .*eval_bleu_sentences > 0"
    with pytest.raises(ConfigError, match=message):
        validate_experiment(config)
    for section, field, value, message in (
        ("data", "aux_min_count", -1, "aux_min_count=-1 must be >= 0"),
        ("optimizer", "ema_decay", 1.0, r"ema_decay=1.0 must be in \[0, 1\)"),
        ("optimizer", "cooldown_steps", 10**6, r"cooldown_steps=1000000 must be in \[0, "),
        ("optimizer", "cooldown_steps", -1, r"cooldown_steps=-1 must be in \[0, "),
        ("optimizer", "embedding_lr_scale", -1.0, "embedding_lr_scale=-1.0 must be >= 0"),
        ("train", "embedding_init", "glove", "embedding_init='glove' is not allowed; choose one"),
        ("data", "aux_tag", "dict", "aux_tag='dict' needs a translation task and the form <name>"),
        ("data", "aux_tag", "<two words>", "the form <name>"),
        ("data", "reverse_tag", "2en", "reverse_tag='2en' needs a translation task"),
        ("data", "subword_alpha", -0.1, r"subword_alpha=-0.1 must be in \[0, 1\]"),
        ("data", "subword_alpha", 1.5, r"subword_alpha=1.5 must be in \[0, 1\]"),
        ("train", "max_minutes", -1.0, "max_minutes=-1.0 must be >= 0"),
    ):
        config = load_config()
        config[section][field] = value
        with pytest.raises(ConfigError, match=message):
            validate_experiment(config)
    config = load_config()
    config.train.max_minutes = 15.0
    config.optimizer.cooldown_steps = 2
    with pytest.raises(ConfigError, match="max_minutes=15.0 stops at a step nobody knows"):
        validate_experiment(config)
    config.optimizer.cooldown_steps = 0
    validate_experiment(config)
    config.optimizer.cooldown_fraction = 0.3  # the cooldown that works with a budget
    validate_experiment(config)
    config.train.max_minutes, config.optimizer.cooldown_steps = 0.0, 2
    with pytest.raises(ConfigError, match="are two cooldowns; set one of them to 0"):
        validate_experiment(config)
    for fraction in (-0.1, 1.0):
        config = load_config()
        config.optimizer.cooldown_fraction = fraction
        with pytest.raises(ConfigError, match=rf"cooldown_fraction={fraction} must be in \[0, 1\)"):
            validate_experiment(config)
    config = load_config()
    config.data.resample_subsets, config.data.subword_alpha = True, 0.2
    with pytest.raises(ConfigError, match="resample_subsets=True cannot be combined"):
        validate_experiment(config)
    config = load_config("lm_long_sparse")
    config.data.subword_alpha = 0.2
    with pytest.raises(ConfigError, match="does not apply to data.stream=True"):
        validate_experiment(config)
    bad = ml_collections.ConfigDict(load_config().to_dict())
    bad.train.extra = 1
    with pytest.raises(ConfigError, match=r"unknown fields \['extra'\]"):
        validate_experiment(bad)


def test_a_run_saved_before_later_fields_still_loads():
    """Workdirs written before a field existed (config.json without it) load with the
    field's neutral default, not the current config file's value."""
    values = load_config("ende_small", None).to_dict()
    added = {
        "data": ["aux_min_count", "aux_tag", "reverse_tag", "subword_alpha", "resample_subsets"],
        "train": ["concurrent_splits", "embedding_init", "embedding_init_splits", "max_minutes"],
        "optimizer": ["ema_decay", "embedding_lr_scale", "cooldown_steps", "cooldown_fraction"],
    }
    for section, fields in added.items():
        for name in fields:
            del values[section][name]
    del values["decode"]  # the decode section came later too
    config = ExperimentConfig.from_config(json.loads(json.dumps(values)))
    assert config.train.max_minutes == 0.0  # that run was bounded by num_steps only
    assert config.optimizer.ema_decay == 0.0 and config.train.embedding_init == "random"
    assert config.data.aux_tag == "" and not config.data.resample_subsets
    assert config.train.embedding_init_splits == () and config.decode.beam_size == 4
    # What remains is read as saved: the phrase split keeps its subset size.
    assert [tuple(s) for s in config.data.train_splits] == [
        ("train", None),
        ("train_phrases", 8000),
    ]
    # ... and a round trip through config.json gives the same typed config.
    assert ExperimentConfig.from_config(json.loads(config.to_json())) == config


@pytest.mark.parametrize(
    "name", ["ende_small", "bible_small", "lm_small", "lm_long_sparse", "paper_base", "paper_big"]
)
def test_every_config_file_validates(name):
    for arg in (None, "debug"):
        validate_experiment(load_config(name, arg))
    with pytest.raises(ConfigError, match="unknown config variant 'huge'"):
        load_config(name, "huge")


def _values(**changes):
    """The default config's plain values with ``{"section.field": value}`` changed."""
    values = load_config().to_dict()
    for key, value in changes.items():
        section, name = key.split(".")
        values[section][name] = value
    return values


@pytest.mark.parametrize(
    "key,value,message",
    [
        ("train.batch_size", "8", r"config.train.batch_size='8' must be of type int"),
        ("train.batch_size", True, r"config.train.batch_size=True must be of type int"),
        ("optimizer.b1", "0.9", r"config.optimizer.b1='0.9' must be of type float"),
        ("data.pack", 1, r"config.data.pack=1 must be of type bool"),
        ("data.train_splits", "", r"config.data.train_splits='': split list '' is empty"),
        ("data.train_splits", "train:0", r"train_splits='train:0': .* positive example count"),
        ("data.train_splits", ":5", r"train_splits=':5': .* needs a split name"),
        ("data.too_long", "cut", r"too_long='cut' is not allowed; choose one of drop, truncate"),
        ("decode.beam_size", 0, r"config.decode.beam_size=0 must be > 0"),
        ("decode.min_length_ratio", 2.0, r"min_length_ratio=2.0 exceeds max_length_ratio=1.0"),
    ],
)
def test_one_clear_error_per_bad_field(key, value, message):
    values = _values(**{key: value})
    if key == "decode.min_length_ratio":
        values["decode"]["max_length_ratio"] = 1.0
    with pytest.raises(ConfigError, match=message):
        ExperimentConfig.from_config(values)


def test_unknown_sections_and_fields():
    values = _values()
    values["training"] = {}
    with pytest.raises(ConfigError, match=r"unknown sections \['training'\]"):
        ExperimentConfig.from_config(values)
    values = _values()
    values["decode"]["beam"] = 4
    with pytest.raises(ConfigError, match=r"config.decode: unknown fields \['beam'\]"):
        ExperimentConfig.from_config(values)


def test_split_lists_are_parsed_once_into_typed_values():
    config = ExperimentConfig.from_config(load_config("ende_small", None))
    assert config.data.train_splits == (Split("train"), Split("train_phrases", 8000))
    assert config.train.embedding_init_splits == (Split("train"), Split("train_phrases"))
    # ... and written back in the form the command line and config.json use.
    assert config.to_dict()["data"]["train_splits"] == "train,train_phrases:8000"
    assert config.to_dict()["train"]["embedding_init_splits"] == "train,train_phrases"


def test_base_config_is_generated_from_the_dataclasses():
    """Every field of every section is in base_config at its declared default, and the
    typed config built from it is the all-defaults one."""
    model = ModelConfig(vocab_size=100, d_model=32, num_heads=2, d_ff=64, max_len=64)
    config = base_config(model)
    for name, kind in SECTIONS.items():
        assert config[name].to_dict() == kind().to_dict(), name
    assert ExperimentConfig.from_config(config) == ExperimentConfig(model=model)


def test_field_table_lists_every_field_with_type_default_and_meaning():
    table = field_table()
    for name, kind in {"model": ModelConfig, **SECTIONS}.items():
        for field in dataclasses.fields(kind):
            assert f"  {name}.{field.name}: " in table, f"{name}.{field.name}"
            assert field.metadata.get("doc"), f"{name}.{field.name} has no meaning"
    assert "  train.batch_size: int = 64\n      rows per step" in table
    assert "  data.train_splits: str = 'train'\n" in table
    assert "  optimizer.schedule: str = 'noam'\n" in table and "[noam | warmup_cosine" in table
    cli = subprocess.run(
        [sys.executable, "-m", "flaxformer_lite.main", "fields"],
        capture_output=True,
        text=True,
        cwd=ROOT,
        check=False,
    )
    assert cli.returncode == 0, cli.stderr[-2000:]
    assert cli.stdout.strip() == table.strip()
