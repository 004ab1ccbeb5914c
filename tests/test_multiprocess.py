"""Several processes on JAX's own runtime: 2 local processes x 4 CPU devices train like
1 process x 8 devices, resume from their checkpoint, and stop cleanly when one dies."""

import json
import os
import pathlib
import re
import signal
import socket
import subprocess
import sys
import time

import jax
import numpy as np
import pytest

from flaxformer_lite.training import distributed
from flaxformer_lite.training.state import abstract_train_state
from flaxformer_lite.training.train import train_and_evaluate
from flaxformer_lite.workdir import checkpoints as ckpt_lib
from tests import fixtures
from tests.fixtures import debug_config

ROOT = pathlib.Path(__file__).resolve().parents[1]
# Both layouts read the data in two shards, so that they see the same global batches.
FLAGS = (
    "--config.model.vocab_size=100",
    "--config.model.residual_dropout=0.1",
    "--config.model.embedding_dropout=0.1",
    "--config.train.eval_bleu_sentences=0",
    "--config.train.log_every=1",
    "--config.data.shards=2",
)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("localhost", 0))
        return s.getsockname()[1]


def _launch(fixture_data, workdir, num_steps, *extra):
    """Start 2 processes of 4 CPU devices each on ``workdir``; returns the Popens."""
    raw, data_dir = fixture_data
    env = dict(
        os.environ,
        FLAXFORMER_RAW_DIR=str(raw),
        XLA_FLAGS=fixtures.xla_flags(4),
        JAX_PLATFORMS="cpu",
    )
    port = _free_port()
    return [
        subprocess.Popen(
            [
                sys.executable,
                "-m",
                "flaxformer_lite.main",
                "--config=configs/ende_small.py:debug",
                f"--workdir={workdir}",
                f"--config.data.data_dir={data_dir}",
                f"--config.train.num_steps={num_steps}",
                f"--coordinator_address=localhost:{port}",
                "--num_processes=2",
                f"--process_id={i}",
                *FLAGS,
                *extra,
            ],
            cwd=ROOT,
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for i in range(2)
    ]


def _finish(procs, timeout=240):
    outs = [p.communicate(timeout=timeout) for p in procs]
    for p, (_, err) in zip(procs, outs, strict=True):
        assert p.returncode == 0, err[-3000:]
    return outs


def _train_losses(workdir) -> dict[int, float]:
    lines = (workdir / "metrics.jsonl").read_text().splitlines()
    return {r["step"]: r["loss"] for r in map(json.loads, lines) if r["split"] == "train"}


@pytest.mark.parametrize(
    "resume",
    # Both in the slow tier (~50 s each on 2 cores: three processes import jax and
    # compile a train step): two processes train 3 steps as one does; they stop at 3
    # and resume to 6 (the merged data position of both processes). The default run
    # keeps the process flags' test below; 8 devices in one process: test_sharding.
    [pytest.param(False, marks=pytest.mark.slow), pytest.param(True, marks=pytest.mark.slow)],
    ids=["straight", "resumed"],
)
def test_two_processes_train_and_resume_like_one(fixture_data, tmp_path, resume):
    _, data_dir = fixture_data
    steps = 6 if resume else 3
    # One process, eight devices, straight to the end.
    one = tmp_path / "one"
    config = debug_config(data_dir, num_steps=steps, log_every=1, eval_bleu_sentences=0)
    config.data.shards = 2
    train_and_evaluate(config, one)
    # Two processes of four devices: to step 3, then (resume) on to step 6.
    two = tmp_path / "two"
    _finish(_launch(fixture_data, two, 3))
    assert ckpt_lib.steps(two) == [3]
    if resume:
        outs = _finish(_launch(fixture_data, two, 6))
        assert "resumed from step 3" in outs[0][0] and "resumed from step 3" in outs[1][0]
    want, got = _train_losses(one), _train_losses(two)
    assert sorted(got) == list(range(1, steps + 1))
    # The same 8 devices reduce the gradients in another grouping (2 processes x 4):
    # float32 round-off (epsilon 1.2e-7) in sums of a few thousand terms, compounded
    # over 6 Adam steps, stays one to two orders of magnitude below 1e-5.
    np.testing.assert_allclose(
        [got[s] for s in range(1, steps + 1)], [want[s] for s in range(1, steps + 1)], rtol=1e-5
    )
    # Only process 0 wrote the logs: one line per step, not one per process.
    lines = [json.loads(x) for x in (two / "metrics.jsonl").read_text().splitlines()]
    assert sorted(r["step"] for r in lines if r["split"] == "train") == list(range(1, steps + 1))
    target = abstract_train_state(config).params
    a, _ = ckpt_lib.restore_params(one, target, "last")
    b, _ = ckpt_lib.restore_params(two, target, "last")
    for (path, x), y in zip(
        jax.tree_util.tree_flatten_with_path(a)[0], jax.tree.leaves(b), strict=True
    ):
        if jax.tree_util.keystr(path).endswith("['key']['bias']"):
            continue  # zero true gradient: see tests/test_sharding.py
        error = np.linalg.norm(np.asarray(x) - np.asarray(y)) / np.linalg.norm(np.asarray(x))
        assert error <= 1e-5, jax.tree_util.keystr(path)


@pytest.mark.slow
def test_a_dead_process_stops_the_other_with_a_message(fixture_data, tmp_path):
    procs = _launch(fixture_data, tmp_path / "run", 10_000, "--heartbeat_timeout=10")
    metrics = tmp_path / "run" / "metrics.jsonl"
    deadline = time.monotonic() + 180
    while not (metrics.exists() and len(metrics.read_text().splitlines()) >= 2):
        assert time.monotonic() < deadline, "the processes did not start training"
        assert all(p.poll() is None for p in procs), procs[0].stderr.read()[-2000:]
        time.sleep(0.5)
    procs[1].send_signal(signal.SIGKILL)
    killed = time.monotonic()
    out, err = procs[0].communicate(timeout=120)
    waited = time.monotonic() - killed
    procs[1].communicate()
    shown = [x for x in err.splitlines() if not x.startswith(("I1", "    @", "[Gloo"))]
    assert procs[0].returncode == 1, "\n".join(shown)[-3000:]
    # Whichever notices first: the failed collective, or the missed heartbeats.
    assert re.search(r"error: process 0 of 2(: process 1 sent no heartbeat| lost the others)", err)
    assert "Restart every process with the same command" in err
    assert "Traceback" not in err
    assert waited < 40, waited  # the heartbeat timeout is 10 s


def test_process_flags_come_from_flags_or_the_environment(monkeypatch):
    monkeypatch.setenv("JAX_COORDINATOR_ADDRESS", "10.0.0.1:1234")
    monkeypatch.setenv("JAX_NUM_PROCESSES", "4")
    monkeypatch.setenv("JAX_PROCESS_ID", "2")
    assert distributed.from_environment(None, None, None) == ("10.0.0.1:1234", 4, 2)
    assert distributed.from_environment("h:1", 2, 0) == ("h:1", 2, 0)
    monkeypatch.setenv("JAX_PROCESS_ID", "two")
    with pytest.raises(distributed.DistributedError, match="JAX_PROCESS_ID='two' must be an"):
        distributed.from_environment(None, None, None)
    monkeypatch.delenv("JAX_PROCESS_ID")
    with pytest.raises(distributed.DistributedError, match="needs --coordinator_address, "):
        distributed.initialize()  # an address and a count, but no process id
    monkeypatch.delenv("JAX_COORDINATOR_ADDRESS")
    monkeypatch.delenv("JAX_NUM_PROCESSES")
    assert distributed.initialize() is False  # nothing given: one process
