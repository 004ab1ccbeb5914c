"""Faults done for real on a :debug training subprocess: SIGKILL inside a checkpoint
save, SIGTERM (preemption), and Ctrl-C twice; each run then resumes to the end."""

import json
import os
import pathlib
import signal
import subprocess
import sys
import time

import jax
import numpy as np
import pytest

from flaxformer_lite import checkpoints as ckpt_lib
from flaxformer_lite.training.state import abstract_train_state
from tests.fixtures import debug_config

ROOT = pathlib.Path(__file__).resolve().parents[1]


def _command(fixture_data, workdir, num_steps, checkpoint_every=3):
    _, data_dir = fixture_data
    return [
        sys.executable,
        "-m",
        "flaxformer_lite.main",
        "--config=configs/ende_small.py:debug",
        f"--workdir={workdir}",
        f"--config.data.data_dir={data_dir}",
        "--config.model.vocab_size=100",
        "--config.model.residual_dropout=0.1",
        "--config.model.embedding_dropout=0.1",
        f"--config.train.num_steps={num_steps}",
        f"--config.train.checkpoint_every={checkpoint_every}",
        "--config.train.eval_bleu_sentences=0",
        "--config.train.log_every=1",
    ]


def _env(fixture_data):
    raw, _ = fixture_data
    return dict(os.environ, FLAXFORMER_RAW_DIR=str(raw), JAX_PLATFORMS="cpu")


def _run(fixture_data, workdir, num_steps):
    out = subprocess.run(
        _command(fixture_data, workdir, num_steps),
        cwd=ROOT,
        env=_env(fixture_data),
        capture_output=True,
        text=True,
        check=False,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    return out


def _start(fixture_data, workdir, num_steps):
    return subprocess.Popen(
        _command(fixture_data, workdir, num_steps),
        cwd=ROOT,
        env=_env(fixture_data),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


def _start_and_train(fixture_data, workdir, steps: int):
    """A long run, returned once it has logged ``steps`` training steps."""
    proc = _start(fixture_data, workdir, 10_000)
    deadline = time.monotonic() + 180
    while _train_steps_logged(workdir) < steps:
        assert proc.poll() is None, proc.communicate()[1][-3000:]
        assert time.monotonic() < deadline, "the run did not start training"
        time.sleep(0.05)
    return proc


def _train_steps_logged(workdir) -> int:
    path = workdir / "metrics.jsonl"
    if not path.exists():
        return 0
    return sum('"split": "train"' in line for line in path.read_text().splitlines())


def _final_params(fixture_data, workdir):
    target = abstract_train_state(debug_config(fixture_data[1])).params
    params, step = ckpt_lib.restore_params(workdir, target, "last")
    return params, step


def _assert_same_params(a, b):
    for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True):
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y))


def test_sigkill_inside_a_checkpoint_save_resumes(fixture_data, tmp_path):
    """The kill lands while orbax writes step 3 (its temporary folder exists); the next
    start removes the half-written folder and resumes, and the finished run equals an
    uninterrupted one bit for bit."""
    straight = tmp_path / "straight"
    _run(fixture_data, straight, 6)
    run = tmp_path / "killed"
    proc = _start(fixture_data, run, 6)
    folder = run / "checkpoints"
    deadline = time.monotonic() + 180
    while proc.poll() is None:
        if folder.is_dir() and any(".orbax-checkpoint-tmp" in p.name for p in folder.iterdir()):
            proc.send_signal(signal.SIGKILL)
            break
        assert time.monotonic() < deadline, "no checkpoint save began"
        time.sleep(0.0005)
    proc.communicate()
    assert proc.returncode == -signal.SIGKILL, "the run ended before the kill landed"
    assert any(".orbax-checkpoint-tmp" in p.name for p in folder.iterdir())
    out = _run(fixture_data, run, 6)
    assert "an incomplete checkpoint of an interrupted save" in out.stdout
    a, step_a = _final_params(fixture_data, straight)
    b, step_b = _final_params(fixture_data, run)
    assert step_a == step_b == 6
    _assert_same_params(a, b)


def test_sigterm_checkpoints_and_exits_cleanly(fixture_data, tmp_path):
    """Preemption: SIGTERM after a few steps finishes the step, saves it, prints the
    resume command and exits 0; resuming reaches the end like an uninterrupted run."""
    run = tmp_path / "run"
    proc = _start_and_train(fixture_data, run, steps=4)
    proc.send_signal(signal.SIGTERM)
    out, err = proc.communicate(timeout=120)
    assert proc.returncode == 0, err[-3000:]
    assert "Traceback" not in err
    line = next(x for x in out.splitlines() if x.startswith("stopped by SIGTERM at step "))
    step = int(line.split("at step ")[1].split(":")[0])
    assert "Resume with: " in line and "flaxformer_lite.main" in line
    assert ckpt_lib.steps(run)[-1] == step >= 4
    # The same command (here with an end in sight) resumes from that step.
    resumed = _run(fixture_data, run, step + 2)
    assert f"resumed from step {step}" in resumed.stdout
    lines = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
    train_steps = [r["step"] for r in lines if r["split"] == "train"]
    assert train_steps[-2:] == [step + 1, step + 2]


@pytest.mark.slow
def test_a_second_ctrl_c_stops_at_once_and_the_newest_checkpoint_survives(fixture_data, tmp_path):
    run = tmp_path / "run"
    proc = _start_and_train(fixture_data, run, steps=4)
    proc.send_signal(signal.SIGINT)
    # Two signals that arrive before Python runs the handler are one; wait for the first.
    seen = []
    while not any("finishing this step" in x for x in seen):
        seen.append(proc.stderr.readline())
        assert seen[-1], "the run ended without acknowledging Ctrl-C"
    proc.send_signal(signal.SIGINT)
    _, err = proc.communicate(timeout=120)
    err = "".join(seen) + err
    assert proc.returncode == 130, err[-3000:]
    assert "again: stopping now" in err
    newest = ckpt_lib.steps(run)[-1]
    resumed = _run(fixture_data, run, newest + 1)
    assert f"resumed from step {newest}" in resumed.stdout
