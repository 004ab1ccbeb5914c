"""The sweep command: spec parsing and its errors, a real debug grid that resumes, a
real sweep stopped by SIGTERM, and what a SLURM sweep makes of SLURM's silence."""

import json
import os
import pathlib
import signal
import subprocess
import sys
import time

import pytest

from flaxformer_lite.sweep import rows
from flaxformer_lite.sweep import runner as sweep
from flaxformer_lite.sweep.report import summarize
from flaxformer_lite.sweep.spec import Axis, Sweep, SweepError, parse_axis
from tests.fixtures import xla_flags

ROOT = pathlib.Path(__file__).resolve().parents[1]


@pytest.mark.parametrize(
    "spec,axis",
    [
        ("model.num_heads=1,4,8", Axis("model.num_heads", (1, 4, 8))),
        (
            "model.positional=sinusoidal, learned",
            Axis("model.positional", ("sinusoidal", "learned")),
        ),
        ("model.residual_dropout=0,0.1", Axis("model.residual_dropout", (0.0, 0.1))),
        ("model.scale_embeddings=true,False", Axis("model.scale_embeddings", (True, False))),
        ("model.d_k=8,16", Axis("model.d_k", (8, 16))),  # int | None: swept as int
        (
            'model.attention_pattern=["dense", "local:window=16,causal=1"]',
            Axis("model.attention_pattern", ("dense", "local:window=16,causal=1")),
        ),
        ("train.label_smoothing=[0, 0.1]", Axis("train.label_smoothing", (0.0, 0.1))),
        ("data.train_splits=train", Axis("data.train_splits", ("train",))),
        (
            "model.num_encoder_layers + model.num_decoder_layers=1,3",
            Axis("model.num_encoder_layers+model.num_decoder_layers", (1, 3)),
        ),
    ],
)
def test_parse_axis_types_values_as_the_field(spec, axis):
    parsed = parse_axis(spec)
    assert parsed == axis
    assert [type(v) for v in parsed.values] == [type(v) for v in axis.values]


@pytest.mark.parametrize(
    "spec,message",
    [
        ("model.num_heads", "has no '='"),
        ("model.num_hedas=1,2", "unknown config field 'model.num_hedas'"),
        ("modle.num_heads=1,2", "unknown config field 'modle.num_heads'"),
        ("model.num_heads=1,two", "'two' is not a int"),
        ("model.num_heads=1.5", "'1.5' is not a int"),
        ("model.residual_dropout=high", "'high' is not a float"),
        ("model.scale_embeddings=maybe", "'maybe' is not a bool"),
        ("model.num_heads=", "the list of values is empty"),
        ("model.num_heads=[]", "the list of values is empty"),
        ("model.num_heads=1,,2", "an empty value"),
        ("model.num_heads=[1, true]", "True is not a int"),
        ("model.num_heads=[1, null]", "None cannot be swept"),
        ("model.num_heads=[1, 2", "is not a JSON list"),
        ("model.num_heads=2,2", "a value appears twice"),
        ("model.num_heads+model.positional=1,2", "linked fields must have one type"),
        ("model.num_heads+model.num_hedas=1,2", "unknown config field 'model.num_hedas'"),
    ],
)
def test_bad_axis_names_the_problem(spec, message):
    with pytest.raises(SweepError, match=None) as error:
        parse_axis(spec)
    assert message in str(error.value)
    assert "\n" not in str(error.value)


def test_linked_fields_move_together():
    spec = Sweep(
        "configs/ende_small.py:debug",
        axes=(parse_axis("model.num_encoder_layers+model.num_decoder_layers=1,2"),),
        seeds=1,
    )
    runs = spec.runs()
    assert [r.folder for r in runs] == [
        "num_encoder_layers+num_decoder_layers=1/seed0",
        "num_encoder_layers+num_decoder_layers=2/seed0",
    ]
    assert runs[1].overrides == {"model.num_encoder_layers": 2, "model.num_decoder_layers": 2}
    with pytest.raises(SweepError, match="more than once"):
        Sweep("x.py", axes=(parse_axis("model.d_ff+model.d_ff=1"),))


def test_grid_is_the_cross_product_times_seeds():
    spec = Sweep(
        "configs/ende_small.py:debug",
        axes=(parse_axis("model.num_heads=1,2"), parse_axis("model.positional=sinusoidal,learned")),
        seeds=3,
        overrides={"train.seed": 10},
    )
    runs = spec.runs()
    assert len(runs) == 12
    assert runs[0].folder == "num_heads=1,positional=sinusoidal/seed10"
    assert runs[-1].folder == "num_heads=2,positional=learned/seed12"
    assert {r.seed for r in runs} == {10, 11, 12}
    assert len({r.folder for r in runs}) == 12
    command = spec.command(runs[-1], pathlib.Path("/s"))
    assert command[3:] == [
        "--config=configs/ende_small.py:debug",
        "--config.train.seed=12",
        "--config.model.num_heads=2",
        "--config.model.positional=learned",
        "--workdir=/s/num_heads=2,positional=learned/seed12",
    ]


@pytest.mark.parametrize(
    "kwargs,message",
    [
        (dict(seeds=0), "--seeds=0 must be >= 1"),
        (
            dict(axes=(Axis("model.num_heads", (1,)), Axis("model.num_heads", (2,)))),
            "more than once",
        ),
        (
            dict(axes=(Axis("model.num_heads", (1,)),), overrides={"model.num_heads": 4}),
            "both swept and set",
        ),
        (dict(axes=(Axis("train.seed", (1, 2)),)), "use --seeds=N"),
    ],
)
def test_bad_sweep_specs(kwargs, message):
    with pytest.raises(SweepError) as error:
        Sweep("configs/ende_small.py:debug", **kwargs)
    assert message in str(error.value)


def test_a_point_that_does_not_validate_fails_before_anything_runs(tmp_path):
    # d_model 32 of the debug model does not split into 3 heads.
    spec = Sweep("configs/ende_small.py:debug", axes=(parse_axis("model.num_heads=2,3"),))
    with pytest.raises(SweepError) as error:
        sweep.run_sweep(spec, tmp_path / "s")
    assert "model.num_heads=3" in str(error.value)
    assert not (tmp_path / "s").exists()


def test_summary_gives_mean_and_sample_std():
    spec = Sweep("configs/ende_small.py:debug", axes=(parse_axis("model.num_heads=1"),), seeds=2)
    rows = [
        {
            "run": "num_heads=1/seed0",
            "status": "ok",
            "valid_nll": 2.0,
            "steps": 6,
            "test_bleu": 5.0,
        },
        {
            "run": "num_heads=1/seed1",
            "status": "ok",
            "valid_nll": 4.0,
            "steps": 6,
            "test_bleu": 7.0,
        },
    ]
    table = summarize(spec, rows)
    line = next(t for t in table.splitlines() if t.startswith("| num_heads=1"))
    cells = [c.strip() for c in line.strip("|").split("|")]
    # sample std of (2, 4) is sqrt(2) = 1.414; of (5, 7) the same
    assert cells == ["num_heads=1", "2/2", "6", "3.000 ± 1.414", "6.00 ± 1.41"]


def test_a_finished_run_is_read_back_not_run_again(tmp_path, monkeypatch):
    """What a resumed sweep relies on: a run whose sweep_result.json exists returns that
    row and starts nothing (the whole resume through the CLI: the slow run of the test
    below)."""
    spec = Sweep("configs/ende_small.py:debug", axes=(parse_axis("model.num_heads=1,2"),))
    run = spec.runs()[1]
    row = {"run": run.folder, "status": "ok", "steps": 6, "valid_nll": 1.5}
    (tmp_path / run.folder).mkdir(parents=True)
    (tmp_path / run.folder / rows.RESULT_FILE).write_text(json.dumps(row))
    monkeypatch.setattr(sweep, "_run_logged", lambda *a: pytest.fail("a finished run ran"))
    assert sweep.execute(spec, run, tmp_path) == row


def _sweep_cli(args, data_dir, raw, cwd=ROOT):
    env = dict(os.environ, FLAXFORMER_RAW_DIR=str(raw), XLA_FLAGS=xla_flags(None))
    cmd = [
        sys.executable,
        "-m",
        "flaxformer_lite.main",
        "sweep",
        "--config=configs/ende_small.py:debug",
        f"--config.data.data_dir={data_dir}",
        "--config.model.vocab_size=100",
        "--config.train.num_steps=3",
        "--limit=4",
        *args,
    ]
    return subprocess.run(cmd, cwd=cwd, env=env, capture_output=True, text=True, check=False)


def test_cli_rejects_a_bad_spec_before_running(fixture_data, tmp_path):
    raw, data_dir = fixture_data
    out = _sweep_cli(["--sweep=model.num_heads=1,x", f"--workdir={tmp_path / 's'}"], data_dir, raw)
    assert out.returncode == 1
    assert out.stderr.strip().splitlines() == ["error: --sweep model.num_heads: 'x' is not a int"]
    assert not (tmp_path / "s").exists()


@pytest.mark.parametrize(
    "seeds,split",
    # Both in the slow run (~35 s and ~90 s of subprocesses): 2 runs trained and
    # validated; 4 runs scored on the test split and the resume through the CLI. The
    # default run keeps the spec, the table, the read-back of finished runs and the
    # report against a baseline (test_significance.py), all in process.
    [pytest.param(1, "", marks=pytest.mark.slow), pytest.param(2, "test", marks=pytest.mark.slow)],
)
def test_debug_sweep_runs_tabulates_and_resumes(fixture_data, tmp_path, seeds, split):
    raw, data_dir = fixture_data
    workdir = tmp_path / "s"
    args = [
        "--sweep=model.positional=sinusoidal,learned",
        f"--seeds={seeds}",
        "--parallel=2",
        f"--workdir={workdir}",
        f"--split={split}",
    ]
    out = _sweep_cli(args, data_dir, raw)
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-2000:]
    rows = [json.loads(line) for line in (workdir / "results.jsonl").read_text().splitlines()]
    assert [r["run"] for r in rows] == [
        f"positional={kind}/seed{seed}"
        for kind in ("sinusoidal", "learned")
        for seed in range(seeds)
    ]
    for row in rows:
        assert row["status"] == "ok" and row["steps"] == 3
        assert row["overrides"]["model.positional"] in ("sinusoidal", "learned")
        assert row["parameters"] > 0 and row["flops_per_step"] > 0 and row["tokens_per_sec"] > 0
        assert row["valid_nll"] > 0 and row["valid_perplexity"] > 1
        assert row["wall_minutes"] > 0
        scored = workdir / row["run"] / "test_scores.json"
        if split:
            assert 0 <= row["test_bleu"] <= 100 and scored.is_file()
        else:  # no split, no evaluate command
            assert "test_bleu" not in row and not scored.exists()
        run = workdir / row["run"]
        config = json.loads((run / "config.json").read_text())
        assert config["train"]["seed"] == row["seed"]
        assert config["model"]["positional"] == row["overrides"]["model.positional"]
        assert (run / "command.txt").read_text().startswith(sys.executable)
    # learned positions add a max_len x d_model table (debug: 256 x 32) to each side
    assert rows[seeds]["parameters"] - rows[0]["parameters"] == 2 * 256 * 32
    table = (workdir / "results.md").read_text()
    assert f"| positional=sinusoidal | {seeds}/{seeds} |" in table
    if seeds > 1:  # different seeds, different runs, and a spread in the table
        assert rows[0]["valid_nll"] != rows[1]["valid_nll"]
        assert " ± " in table
    events = list((workdir / "tensorboard").rglob("events.out.tfevents.*"))
    assert {p.parent.relative_to(workdir / "tensorboard").as_posix() for p in events} >= {
        r["run"] for r in rows
    }

    if seeds > 1:
        # Resume (the slow run; the default one checks that a finished run is read back,
        # below): finished runs are skipped; a run whose result is neither in its folder
        # nor in results.jsonl (killed before it was recorded) is run again (it resumes
        # from its checkpoint, trains nothing more, and is scored again).
        (workdir / rows[-1]["run"] / "sweep_result.json").unlink()
        results = workdir / "results.jsonl"
        kept = [x for x in results.read_text().splitlines() if rows[-1]["run"] not in x]
        results.write_text("".join(x + "\n" for x in kept))
        before = (workdir / rows[0]["run"] / "metrics.jsonl").read_text()
        out = _sweep_cli(args, data_dir, raw)
        assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-2000:]
        assert f"{len(rows) - 1} finished before" in out.stdout
        assert (workdir / rows[0]["run"] / "metrics.jsonl").read_text() == before
        assert "resumed from step 3" in (workdir / rows[-1]["run"] / "train.log").read_text()
        again = [json.loads(x) for x in (workdir / "results.jsonl").read_text().splitlines()]
        assert [r["valid_nll"] for r in again] == [r["valid_nll"] for r in rows]

    # The same folder with other base flags is refused.
    other = _sweep_cli(args + ["--config.train.batch_size=4"], data_dir, raw)
    assert other.returncode == 1 and "choose another --workdir" in other.stderr


def _processes_naming(text: str) -> list[int]:
    """PIDs whose command line mentions ``text`` (from /proc, Linux)."""
    pids = []
    for proc in pathlib.Path("/proc").iterdir():
        try:
            if proc.name.isdigit() and text in (proc / "cmdline").read_bytes().decode(
                errors="replace"
            ):
                pids.append(int(proc.name))
        except OSError:
            continue
    return pids


@pytest.mark.slow
@pytest.mark.skipif(not pathlib.Path("/proc/self/cmdline").exists(), reason="needs /proc")
def test_sigterm_stops_the_sweep_and_its_runs(fixture_data, tmp_path):
    """A preempted sweep (SIGTERM) stops its running runs instead of orphaning them,
    records none of them as finished, and exits with one line; the runs resume later."""
    raw, data_dir = fixture_data
    workdir = tmp_path / "s"
    env = dict(os.environ, FLAXFORMER_RAW_DIR=str(raw), XLA_FLAGS=xla_flags(None))
    cmd = [
        sys.executable, "-m", "flaxformer_lite.main", "sweep",
        "--config=configs/ende_small.py:debug", f"--config.data.data_dir={data_dir}",
        "--config.model.vocab_size=100", "--config.train.num_steps=100000",
        "--config.train.log_every=1", "--sweep=model.num_heads=1,2", "--seeds=1",
        "--split=", f"--workdir={workdir}",
    ]  # fmt: skip
    sweep_process = subprocess.Popen(cmd, cwd=ROOT, env=env, stderr=subprocess.PIPE, text=True)
    log = workdir / "num_heads=1" / "seed0" / "train.log"
    deadline = time.monotonic() + 180
    while not (log.is_file() and "step " in log.read_text()):  # the first run is training
        assert sweep_process.poll() is None, sweep_process.stderr.read()
        assert time.monotonic() < deadline, "the run never started training"
        time.sleep(0.5)
    sweep_process.send_signal(signal.SIGTERM)
    _, stderr = sweep_process.communicate(timeout=90)
    assert sweep_process.returncode == 1
    assert stderr.strip().splitlines()[-1] == (
        "error: sweep interrupted with 0 of 2 runs finished; the same command resumes it"
    )
    assert _processes_naming(str(workdir)) == []  # no orphaned run keeps writing
    assert not (workdir / "num_heads=1" / "seed0" / "sweep_result.json").exists()
    assert not (workdir / "num_heads=2").exists()  # the queued run never started


def test_a_points_folder_stays_inside_the_sweep_folder(tmp_path):
    """Override values become folder names: a value holding a separator, dots only, a
    NUL or a thousand characters still names one folder inside the sweep's."""
    values = ["../../escape", "..", "a/b", "x\x00y", "x" * 1000, "/abs"]
    spec = Sweep(
        "configs/ende_small.py:debug",
        axes=(parse_axis(f"data.reverse_tag={json.dumps(values)}"),),
        seeds=1,
    )
    folders = [r.folder for r in spec.runs()]
    assert len(set(folders)) == len(values)
    for folder in folders:
        point, seed = folder.split("/")
        assert seed.startswith("seed") and "\x00" not in point
        assert point not in (".", "..") and len(point.encode()) <= 200
        inside = (tmp_path / folder).resolve()
        assert inside.is_relative_to(tmp_path.resolve())
        inside.mkdir(parents=True)  # a name the file system takes


def _fake_slurm(folder: pathlib.Path, said: str) -> str:
    """A PATH whose squeue and scontrol fail the way SLURM's do, saying ``said``."""
    folder.mkdir()
    for tool in ("squeue", "scontrol"):
        path = folder / tool
        path.write_text(f"#!/bin/sh\necho 'slurm_load_jobs error: {said}' >&2\nexit 1\n")
        path.chmod(0o755)
    return f"{folder}{os.pathsep}{os.environ['PATH']}"


@pytest.mark.parametrize(
    "said,live,kind",
    [
        ("Unable to contact slurm controller (connect failure)", True, "unknown"),
        ("Invalid job id specified", False, "stopped"),
    ],
)
def test_a_job_slurm_says_nothing_about_is_not_taken_for_ended(
    tmp_path, monkeypatch, said, live, kind
):
    """A controller that does not answer (restarting, busy) leaves the run waiting, so
    it is never submitted beside a job that may still run it; a job SLURM no longer
    knows has ended (a run it saved early is then ``stopped``)."""
    from flaxformer_lite.sweep import slurm
    from flaxformer_lite.sweep.spec import RunSpec

    monkeypatch.setenv("PATH", _fake_slurm(tmp_path / "bin", said))
    running = slurm.live(["5_0"])
    assert running == ({"5_0": "UNANSWERED"} if live else {})
    spec = RunSpec(point=(("model.num_heads", 1),), seed=0, folder="a/seed0")
    (tmp_path / "a/seed0").mkdir(parents=True)
    (tmp_path / "a/seed0/train.log").write_text("stopped by SIGTERM at step 7: ...\n")
    got, detail = slurm.state(tmp_path, spec, {"a/seed0": {"job": "5_0"}}, running)
    assert got == kind and "5_0" in detail
