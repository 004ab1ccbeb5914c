"""Sweeps on SLURM, against a real cluster of one node started on this machine
(tests/slurm_cluster.py: Debian's slurmctld, slurmd and munged in a folder of their
own, on free ports).

The default suite submits a 2-point :debug sweep as a job array, waits for it and
collects it, and checks that a second run of the command submits nothing. The slow
tier: a run of 2 processes in one job trains as the local 2-process run; a job stopped
by SIGTERM saves, requeues itself (or, where SLURM refuses the requeue, the waiting
sweep submits it again) and the sweep ends with the numbers of an uninterrupted one;
the status of queued, running, done and failed runs; SLURM's refusal of a partition,
no SLURM on the PATH and a failing run, each in one line.
"""

import json
import shutil
import subprocess
import sys
import time

import pytest

from tests import fixtures, slurm_cluster
from tests.fixtures import ROOT

pytestmark = pytest.mark.skipif(slurm_cluster.missing() is not None,
                                reason=slurm_cluster.missing() or "")  # fmt: skip


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    cluster = slurm_cluster.start(tmp_path_factory.mktemp("slurm"))
    yield cluster
    cluster.stop()


def _sweep(fixture_data, cluster, workdir, *args, env=None, check=True):
    """``main sweep`` on the fixture corpus with SLURM as its launcher (polling fast)."""
    command = [
        sys.executable, "-m", "flaxformer_lite.main", "sweep",
        f"--config={ROOT / 'configs/ende_small.py'}:debug", f"--workdir={workdir}",
        f"--config.data.data_dir={fixture_data[1]}", "--config.model.vocab_size=100",
        "--config.launch.launcher=slurm", "--seeds=1", *args,
    ]  # fmt: skip
    env = env or {**fixtures.debug_env(fixture_data), **cluster.env, "FLAXFORMER_SLURM_POLL": "1"}
    out = subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True)
    if check:
        assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    return out


def test_a_sweep_runs_as_a_job_array(fixture_data, cluster, tmp_path):
    workdir = tmp_path / "sweep"
    args = ("--sweep=model.num_heads=1,2", "--split=", "--config.train.num_steps=2", "--wait")
    out = _sweep(fixture_data, cluster, workdir, *args)
    assert "2 run(s) submitted as SLURM job array" in out.stdout
    rows = [json.loads(x) for x in (workdir / "results.jsonl").read_text().splitlines()]
    assert [r["status"] for r in rows] == ["ok", "ok"] and [r["steps"] for r in rows] == [2, 2]
    script = (workdir / "slurm/array-1.sbatch").read_text()
    assert "#SBATCH --array=0-1" in script and "#SBATCH --signal=TERM@120" in script
    assert "flaxformer_lite.sweep.job" in script
    for run in ("num_heads=1/seed0", "num_heads=2/seed0"):
        folder = workdir / run
        assert {"command.txt", "train.log", "sweep_job.json", "sweep_result.json"} <= {
            p.name for p in folder.iterdir()
        }
        assert "srun --ntasks=1" in (folder / "train.log").read_text()
    again = _sweep(fixture_data, cluster, workdir, *args)  # nothing is submitted twice
    assert "submitted" not in again.stdout
    assert sorted(p.name for p in (workdir / "slurm").glob("*.sbatch")) == ["array-1.sbatch"]


def _task(workdir, run: str) -> str:
    return json.loads((workdir / "slurm/jobs.json").read_text())[run]["job"]


def _until(ready, what: str, timeout: float = 240) -> None:
    deadline = time.monotonic() + timeout
    while not ready():
        assert time.monotonic() < deadline, f"not {what} after {timeout} s"
        time.sleep(0.5)


@pytest.mark.slow
def test_two_processes_in_one_job_train_as_two_local_processes(fixture_data, cluster, tmp_path):
    """A run of 1 node x 2 tasks: srun starts both with --distributed (JAX reads SLURM's
    variables), and they train as the same 2 processes started by hand do."""
    from tests.test_multiprocess import FLAGS, _finish, _launch, _train_losses

    workdir = tmp_path / "sweep"
    env = {**fixtures.debug_env(fixture_data), **cluster.env, "FLAXFORMER_SLURM_POLL": "1",
           "XLA_FLAGS": fixtures.xla_flags(4)}  # fmt: skip
    _sweep(fixture_data, cluster, workdir, "--sweep=train.num_steps=3", "--split=", "--wait",
           "--config.launch.tasks_per_node=2", *FLAGS[1:], env=env)  # fmt: skip
    run = workdir / "num_steps=3/seed0"
    assert "--distributed" in (run / "train.log").read_text()
    local = tmp_path / "local"
    _finish(_launch(fixture_data, local, 3))
    assert _train_losses(run) == _train_losses(local)


def _sigterm_args(fixture_data) -> tuple[str, ...]:
    flags = [a for a in fixtures.debug_command(fixture_data, "x", 12)
             if a.startswith("--config.") and "num_steps" not in a]  # fmt: skip
    return ("--split=", "--sweep=train.num_steps=12", "--wait", *flags)


@pytest.fixture(scope="module")
def uninterrupted(fixture_data, cluster, tmp_path_factory):
    """The sweep of the SIGTERM tests, run through without a stop."""
    straight = tmp_path_factory.mktemp("straight")
    _sweep(fixture_data, cluster, straight, *_sigterm_args(fixture_data))
    return straight


# A SLURM that refuses the requeue: scontrol on the job's PATH says no to it alone.
REFUSING_SCONTROL = """#!/bin/sh
if [ "$1" = requeue ]; then echo "scontrol: error: Requeue of job $2 refused" >&2; exit 1; fi
exec {real} "$@"
"""


@pytest.mark.slow
@pytest.mark.parametrize("requeue", ["taken", "refused"])
def test_a_job_stopped_by_sigterm_requeues_and_ends_as_an_uninterrupted_run(
    fixture_data, cluster, uninterrupted, tmp_path, requeue
):
    """SIGTERM to the running job's steps (what --signal sends before the time limit):
    the run saves and stops, its task requeues itself and resumes (or, where SLURM
    refuses the requeue, the waiting sweep submits the run again); the sweep ends with
    the losses, examples and parameters of the same sweep uninterrupted."""
    from flaxformer_lite.training.state import abstract_train_state
    from flaxformer_lite.workdir import checkpoints as ckpt_lib

    env = {**fixtures.debug_env(fixture_data), **cluster.env, "FLAXFORMER_SLURM_POLL": "1"}
    if requeue == "refused":
        (tmp_path / "bin").mkdir()
        wrapper = tmp_path / "bin/scontrol"
        wrapper.write_text(REFUSING_SCONTROL.format(real=shutil.which("scontrol")))
        wrapper.chmod(0o755)
        env["PATH"] = f"{tmp_path / 'bin'}:{env['PATH']}"
    workdir = tmp_path / "sweep"
    sweep = subprocess.Popen(
        [sys.executable, "-m", "flaxformer_lite.main", "sweep", f"--workdir={workdir}",
         f"--config={ROOT / 'configs/ende_small.py'}:debug", "--seeds=1",
         "--config.launch.launcher=slurm", *_sigterm_args(fixture_data)],
        cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )  # fmt: skip
    run = workdir / "num_steps=12/seed0"
    _until(lambda: (run / "metrics.jsonl").exists()
           and len(fixtures.train_losses(run)) >= 4, "training")  # fmt: skip
    task = _task(workdir, "num_steps=12/seed0")
    cluster.run("scancel", "--signal=TERM", task)
    out, err = sweep.communicate(timeout=300)
    log = (run / "train.log").read_text()
    assert sweep.returncode == 0, out[-2000:] + err[-2000:] + "\ntrain.log:\n" + log[-4000:]
    assert "stopped by SIGTERM" in log and "resumed from step" in log
    if requeue == "refused":  # the same run, submitted again as a second array
        assert "Requeue of job" in log and out.count("1 run(s) submitted") == 2
        assert _task(workdir, "num_steps=12/seed0") != task
    else:
        assert out.count("submitted") == 1 and _task(workdir, "num_steps=12/seed0") == task
    straight = uninterrupted / "num_steps=12/seed0"
    assert fixtures.train_losses(run) == fixtures.train_losses(straight)
    assert fixtures.step_examples(run) == fixtures.step_examples(straight)
    target = abstract_train_state(fixtures.debug_config(fixture_data[1])).params
    fixtures.assert_same_params(ckpt_lib.restore_params(straight, target, "last", 12)[0],
                                ckpt_lib.restore_params(run, target, "last", 12)[0])  # fmt: skip
    rows = [json.loads((d / "results.jsonl").read_text()) for d in (uninterrupted, workdir)]
    assert rows[0]["valid_nll"] == rows[1]["valid_nll"] and rows[1]["steps"] == 12


@pytest.mark.slow
def test_status_and_nothing_submitted_twice(fixture_data, cluster, tmp_path):
    """Submitted without --wait, one run at a time: the same command again submits
    nothing while the jobs are queued or running, --status says which is which."""
    workdir = tmp_path / "sweep"
    args = ("--sweep=model.num_heads=1,2", "--split=", "--config.train.num_steps=40",
            "--config.launch.max_running=1")  # fmt: skip
    first = _sweep(fixture_data, cluster, workdir, *args)
    assert (
        "2 run(s) submitted" in first.stdout
        and "#SBATCH --array=0-1%1" in (workdir / "slurm/array-1.sbatch").read_text()
    )
    again = _sweep(fixture_data, cluster, workdir, *args)
    assert "submitted" not in again.stdout
    _until(lambda: (workdir / "num_heads=1/seed0/train.log").exists(), "started")
    status = _sweep(fixture_data, cluster, workdir, *args, "--status").stdout
    assert "num_heads=1/seed0: running (job " in status
    assert "num_heads=2/seed0: queued (job " in status
    cluster.run("scancel", _task(workdir, "num_heads=1/seed0").split("_")[0])


@pytest.mark.slow
def test_what_slurm_refuses_and_a_failing_run(fixture_data, cluster, tmp_path):
    bad = _sweep(fixture_data, cluster, tmp_path / "a", "--sweep=model.num_heads=1",
                 "--config.launch.partition=nope", check=False)  # fmt: skip
    assert bad.returncode == 1 and len(bad.stderr.strip().splitlines()) == 1
    assert "config.launch.partition='nope': SLURM refused the job (" in bad.stderr
    assert "Invalid partition name specified" in bad.stderr
    env = {**fixtures.debug_env(fixture_data), **cluster.env, "PATH": str(tmp_path)}
    none = _sweep(fixture_data, cluster, tmp_path / "b", "--sweep=model.num_heads=1", env=env,
                  check=False)  # fmt: skip
    assert none.returncode == 1 and "needs SLURM's sbatch, squeue, scontrol on the PATH" in (
        none.stderr
    )
    workdir = tmp_path / "c"
    args = ("--split=", "--sweep=data.max_length=32,2", "--config.train.num_steps=2")
    failing = _sweep(fixture_data, cluster, workdir, *args, "--wait", check=False)
    assert failing.returncode == 1
    assert "1 of 2 runs failed: max_length=2/seed0" in failing.stderr
    status = _sweep(fixture_data, cluster, workdir, *args, "--status").stdout
    assert "max_length=32/seed0: done" in status
    assert "max_length=2/seed0: failed (job " in status
    assert "data.max_length=2 drops every training pair" in status
