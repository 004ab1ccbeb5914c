"""A table of bad inputs to the command line: config overrides, arguments, corpora,
workdirs and texts. Each must exit non-zero with one ``error:`` line that names the bad
value (the table's expected words), print no traceback, and leave nothing half-written
(a workdir the command created is gone; one that existed is as it was)."""

from __future__ import annotations

import json
import os
import pathlib
import shutil
import subprocess
import sys

import pytest

from tests import fixtures

ROOT = pathlib.Path(__file__).resolve().parents[1]

TRAIN = ["--config=configs/ende_small.py:debug", "--config.model.vocab_size=100"]
SPARSE = ["--config.model.attention_dropout=0"]  # what the sparse and fused kernels need

# (name, command-line arguments, words the error line must hold). In the arguments
# {new} is a fresh workdir, {run} a trained translation run, {data} the fixture TFDS
# folder, {tmp} a scratch folder holding the files the corpus and workdir cases use.
CASES = [
    # Config overrides.
    ("unknown field", ["--config.model.d_modle=3"], ["'model.d_modle'", "did you mean 'd_model'"]),
    (
        "another word for a field",
        ["--config.model.dropout_rate=1.5"],
        ["'model.dropout_rate'", "residual_dropout", "attention_dropout"],
    ),  # fmt: skip
    (
        "an override below a field's value",
        ["--config.model.attention.pattern=nope"],
        ["--config.model.attention.pattern", "model.attention holds a value (str)", "whole"],
    ),  # fmt: skip
    # A field's own fault is named before a rule that combines it with others (the
    # config keeps attention_dropout=0.1, which sparse patterns refuse).
    ("bad pattern name", ["--config.model.attention_pattern=nope"], ["'nope'", "known: full"]),
    ("zero window", ["--config.model.attention_pattern=local:window=0"], ["window=0"]),
    (
        "bad global part",
        ["--config.model.attention_pattern=local:window=8+global:first=-1"],
        ["global:first=-1"],
    ),  # fmt: skip
    ("rows of one token", ["--config.data.max_length=1"], ["max_length=1", "EOS"]),
    ("unknown section", ["--config.modle.d_model=3"], ["'modle'", "fields"]),
    ("wrong type", ["--config.model.num_heads=many"], ["num_heads", "many"]),
    ("float for int", ["--config.model.d_model=32.5"], ["d_model", "32.5"]),
    ("zero heads", ["--config.model.num_heads=0"], ["num_heads=0"]),
    ("heads do not divide width", ["--config.model.num_heads=3"], ["num_heads=3", "d_model"]),
    ("dropout over 1", ["--config.model.residual_dropout=1.5"], ["residual_dropout=1.5"]),
    ("unknown positional", ["--config.model.positional=rope9"], ["positional", "rope9"]),
    ("unknown score", ["--config.model.score_fn=cosine"], ["score_fn", "cosine"]),
    ("unknown pattern", [*SPARSE, "--config.model.attention_pattern=starry"], ["starry"]),
    (
        "pattern with spaces",
        [*SPARSE, "--config.model.attention_pattern=local: window=4"],
        ["spaces"],
    ),  # fmt: skip
    (
        "block larger than the sequence",
        [
            *SPARSE,
            "--config.model.attention_pattern=local:window=2",
            "--config.model.attention_block_size=512",
        ],
        ["512"],
    ),  # fmt: skip
    ("unknown kernel", ["--config.model.attention_impl=flash9"], ["attention_impl", "flash9"]),
    (
        "GPU kernel on a CPU",
        [*SPARSE, "--config.model.attention_impl=cudnn"],
        ["cudnn", "NVIDIA GPU"],
    ),  # fmt: skip
    (
        "TPU kernel on a CPU",
        [
            *SPARSE,
            "--config.model.attention_pattern=local:window=2",
            "--config.model.attention_block_size=8",
            "--config.model.attention_impl=splash",
        ],
        ["splash", "TPU"],
    ),  # fmt: skip
    ("negative learning rate", ["--config.optimizer.learning_rate=-1"], ["learning_rate=-1"]),
    ("unknown schedule", ["--config.optimizer.schedule=cosine9"], ["schedule", "cosine9"]),
    ("spike factor below 1", ["--config.optimizer.spike_factor=0.5"], ["spike_factor=0.5"]),
    (
        "two cooldowns",
        ["--config.optimizer.cooldown_fraction=0.1", "--config.optimizer.cooldown_steps=5"],
        ["cooldown_fraction", "cooldown_steps"],
    ),  # fmt: skip
    ("zero batch", ["--config.train.batch_size=0"], ["batch_size=0"]),
    ("microbatches not dividing", ["--config.train.microbatches=3"], ["microbatches=3"]),
    ("mesh of missing devices", ["--config.train.mesh=data:3"], ["data:3"]),
    ("mesh syntax", ["--config.train.mesh=data=2"], ["data=2"]),
    ("unknown dataset", ["--config.data.dataset=wmt99"], ["wmt99"]),
    ("own corpus missing", ["--config.data.dataset=files:{tmp}/nowhere"], ["no such file"]),
    (
        "own corpus folder without files:",
        ["--config.data.dataset={tmp}/own"],
        ["data.dataset=", "own is a folder", "--config.data.dataset=files:", "/own"],
    ),  # fmt: skip
    ("a path that is not there", ["--config.data.dataset={tmp}/nowhere"], ["no such", "files:"]),
    (
        "own corpus, data_dir under a file",
        ["--config.data.dataset=files:{tmp}/own", "--config.data.data_dir={tmp}/a_file/tfds"],
        ["cannot write data.data_dir=", "a_file", "writable folder"],
    ),
    (
        "token cache in a data_dir where it cannot be written",
        ["--config.data.data_dir={tmp}/tfds_nocache"],
        ["cannot write the token cache", "tfds_nocache", "data.data_dir"],
    ),
    (
        "own corpus, files of unequal length",
        ["--config.data.dataset=files:{tmp}/own_unequal"],
        ["train.de has 199", "lines"],
    ),
    (
        "missing tokenizer file",
        ["--config.data.tokenizer=nope.model"],
        ["data.tokenizer=nope.model", "no such file"],
    ),
    ("averaging window of 0", ["average", "--workdir={run}", "--window=0"], ["--window=0"]),
    ("unknown language", ["--config.data.source_lang=fr"], ["'fr'", "source_lang"]),
    ("validation every 0 steps", ["--config.train.eval_every=0"], ["eval_every=0"]),
    ("unknown best metric", ["--config.train.best_metric=speed"], ["best_metric", "speed"]),
    # Config files and command-line arguments.
    ("missing config file", ["--config=configs/nope.py"], ["nope.py"]),
    ("unknown config variant", ["--config=configs/ende_small.py:nope"], ["nope"]),
    ("no config", ["train", "--workdir={new}/no_config"], ["--config is required"]),
    ("no workdir", ["translate", "x"], ["--workdir is required"]),
    ("unknown command", ["tranlsate", "--workdir={run}"], ["tranlsate", "commands"]),
    ("unknown flag", ["translate", "--workdir={run}", "--beam_sise=2", "x"], ["beam_sise"]),
    (
        "flag of the wrong type",
        ["translate", "--workdir={run}", "--beam_size=wide", "x"],
        ["beam_size", "wide"],
    ),  # fmt: skip
    ("beam of zero", ["translate", "--workdir={run}", "--beam_size=0", "x"], ["beam_size=0"]),
    ("negative alpha", ["translate", "--workdir={run}", "--alpha=-1", "x"], ["alpha=-1"]),
    (
        "length ratios crossed",
        ["translate", "--workdir={run}", "--min_length_ratio=2", "--max_length_ratio=1", "x"],
        ["min_length_ratio=2", "max_length_ratio=1"],
    ),  # fmt: skip
    ("unknown split", ["evaluate", "--workdir={run}", "--split=dev9"], ["dev9"]),
    ("average of none", ["average", "--workdir={run}", "--num=0"], ["--num=0"]),
    (
        "another command's flag",
        ["average", "--workdir={run}", "--beam_size=3"],
        ["--beam_size", "not of average"],
    ),  # fmt: skip
    (
        "ensemble step not kept",
        ["translate", "--workdir={run}", "--ensemble=@999", "x"],
        ["999"],
    ),  # fmt: skip
    (
        "generate with a translation model",
        ["generate", "--workdir={run}", "x"],
        ["translation model"],
    ),  # fmt: skip
    (
        "missing input file",
        ["translate", "--workdir={run}", "--input={tmp}/none.txt"],
        ["none.txt"],
    ),  # fmt: skip
    ("input is a folder", ["translate", "--workdir={run}", "--input={tmp}"], ["--input="]),
    # Corpora (the dataset is built from them by the training command).
    (
        "corpus of comments only",
        ["--config.data.data_dir={tmp}/tfds_comments"],
        ["no sentence pairs", "0 entry lines"],
        "comments",
    ),  # fmt: skip
    ("corpus empty", ["--config.data.data_dir={tmp}/tfds_empty"], ["no sentence pairs"], "empty"),
    (
        "corpus lines without separator",
        ["--config.data.data_dir={tmp}/tfds_nosep"],
        ["no sentence pairs", "without ' :: '"],
        "nosep",
    ),  # fmt: skip
    (
        "corpus not UTF-8",
        ["--config.data.data_dir={tmp}/tfds_latin1"],
        ["not UTF-8", "iconv"],
        "latin1",
    ),  # fmt: skip
    (
        "truncated array_record shard",
        ["--config.data.data_dir={tmp}/tfds_truncated"],
        ["array_record", "truncated"],
    ),  # fmt: skip
    # Workdirs.
    ("workdir is a file", ["--workdir={tmp}/a_file"], ["a_file"]),
    ("workdir under a file", ["--workdir={tmp}/a_file/run"], ["a_file"]),
    (
        "workdir of another model",
        ["--workdir={run}", "--config.model.d_ff=48"],
        ["d_ff", "new --workdir"],
    ),  # fmt: skip
    ("translate a missing workdir", ["translate", "--workdir={tmp}/nothing", "x"], ["nothing"]),
    (
        "export to an unknown format",
        ["export", "--workdir={tmp}/run", "--format=onnx", "--out={tmp}/onnx"],
        ["--format='onnx'", "hf, ctranslate2"],
    ),
    (
        "import without a model to import",
        ["import", *TRAIN, "--workdir={new}/import_none", "--config.data.data_dir={data}"],
        ["import needs", "init_from=hf:DIR"],
    ),
    (
        "import from a path without hf:",
        ["--config.train.init_from={tmp}/empty_dir"],
        ["init_from=", "hf:DIR"],
    ),  # fmt: skip
    (
        "import from a folder with no transformers model",
        [
            "import",
            *TRAIN,
            "--workdir={new}/import_empty",
            "--config.data.data_dir={data}",
            "--config.train.init_from=hf:{tmp}/empty_dir",
        ],
        ["empty_dir", "no config.json", "huggingface-cli download"],
    ),  # fmt: skip
    (
        "translate a folder with no run",
        ["translate", "--workdir={tmp}/empty_dir", "x"],
        ["empty_dir"],
    ),  # fmt: skip
    (
        "workdir with a broken config",
        ["translate", "--workdir={tmp}/broken", "x"],
        ["config.json", "JSON"],
    ),  # fmt: skip
]


def _case_args(case, paths) -> list[str]:
    name, args, _words = case[:3]
    args = [a.format(**paths) for a in args]
    if args and not args[0].startswith("-"):  # another command, or "train" as given
        return args
    given = {a.split("=")[0] for a in args}
    extra = [a for a in TRAIN if a.split("=")[0] not in given]
    if "--workdir" not in given:
        extra.append(f"--workdir={paths['new']}/{name.replace(' ', '_')}")
    if "--config.data.data_dir" not in given:
        extra.append(f"--config.data.data_dir={paths['data']}")
    first = [a for a in extra if a.startswith("--config=")]  # before its overrides
    return [*first, *args, *[a for a in extra if a not in first]]


def _write_corpora(tmp: pathlib.Path, data_dir: pathlib.Path) -> dict[str, str]:
    """Raw roots holding a bad Ding file each; returns case key -> raw dir."""
    raws = {}
    for key in ("comments", "empty", "nosep", "latin1"):
        raw = tmp / f"raw_{key}"
        fixtures.write_raw_root(raw, 20)
        ding = raw / "usr/share/trans/de-en"
        if key == "comments":
            ding.write_text("# Version :: test\n# only comments :: here\n")
        elif key == "empty":
            ding.write_bytes(b"")
        elif key == "nosep":
            ding.write_text("".join(f"Satz {i} - sentence {i}\n" for i in range(50)))
        else:
            ding.write_bytes(
                "".join(f"Große {i}. :: Big {i}.\n" for i in range(50)).encode("latin1")
            )
        raws[key] = str(raw)
    nocache = tmp / "tfds_nocache"  # the corpus built, but no folder for its token ids
    shutil.copytree(data_dir, nocache, ignore=shutil.ignore_patterns("token_cache"))
    (nocache / "token_cache").write_text("a file where the token cache should be")
    truncated = tmp / "tfds_truncated"
    shutil.copytree(data_dir, truncated)
    shard = next(truncated.rglob("*train.array_record*"))
    shard.write_bytes(shard.read_bytes()[: shard.stat().st_size // 2])
    return raws


@pytest.fixture(scope="module")
def table(fixture_data, trained_run, tmp_path_factory):
    raw, data_dir = fixture_data
    tmp = tmp_path_factory.mktemp("bad_inputs")
    run = tmp / "run"  # a copy of the session's trained run: this table checks it is unchanged
    shutil.copytree(trained_run[0], run)
    (tmp / "a_file").write_text("not a folder")
    for name, lines in (("own", 200), ("own_unequal", 199)):  # a user's line-aligned files
        (tmp / name).mkdir()
        (tmp / name / "train.en").write_text("".join(f"a house {i}\n" for i in range(200)))
        (tmp / name / "train.de").write_text("".join(f"ein Haus {i}\n" for i in range(lines)))
    (tmp / "empty_dir").mkdir()
    (tmp / "broken").mkdir()
    (tmp / "broken" / "config.json").write_text('{"model": {"d_model": ')
    raws = _write_corpora(tmp, data_dir)
    paths = {"new": str(tmp / "new"), "run": str(run), "data": str(data_dir), "tmp": str(tmp)}
    before = sorted(str(p.relative_to(run)) for p in run.rglob("*"))
    cases = []
    for case in CASES:
        env = {"FLAXFORMER_RAW_DIR": raws[case[3]] if len(case) > 3 else str(raw)}
        cases.append({"args": _case_args(case, paths), "cwd": str(ROOT), "env": env})
    spec, results = tmp / "cases.json", tmp / "results.json"
    spec.write_text(json.dumps(cases))
    # One device (the cases' messages count devices).
    env = dict(os.environ, JAX_PLATFORMS="cpu", XLA_FLAGS=fixtures.xla_flags(None))
    out = subprocess.run(
        [sys.executable, "-m", "tests.cli_cases", str(spec), str(results)],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        check=False,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    after = sorted(str(p.relative_to(run)) for p in run.rglob("*"))
    return dict(zip([c[0] for c in CASES], json.loads(results.read_text()), strict=True)), {
        "new": tmp / "new",
        "run_unchanged": before == after,
    }


def test_the_table_is_large():
    assert len(CASES) >= 40 and len({c[0] for c in CASES}) == len(CASES)


@pytest.mark.parametrize("case", CASES, ids=[c[0] for c in CASES])
def test_bad_input(table, case):
    results, _ = table
    name, _, words = case[:3]
    r = results[name]
    lines = [x for x in r["stderr"].splitlines() if x.strip()]
    assert r["code"] != 0, f"exit 0; stdout: {r['stdout'][-500:]}"
    assert "Traceback" not in r["stderr"], r["stderr"][-3000:]
    assert len(lines) == 1 and lines[0].startswith("error: "), r["stderr"][-3000:]
    for word in words:
        assert word in lines[0], (word, lines[0])


def test_bad_inputs_leave_nothing_half_written(table):
    """Training commands that failed left no workdir behind, and the trained run the
    other cases pointed at is unchanged."""
    _, state = table
    leftovers = sorted(p.name for p in state["new"].iterdir()) if state["new"].exists() else []
    assert leftovers == []
    assert state["run_unchanged"]
