"""Faults done for real on :debug training subprocesses: SIGKILL at several moments
(one inside a checkpoint save), SIGTERM (preemption), Ctrl-C twice, unreadable
checkpoints, a second run on a held workdir, a full and a read-only disk. Each
faulted run must end as an uninterrupted one does: the same per-step losses, the
same examples in every step, bit-identical parameters."""

import json
import pathlib
import shutil
import signal
import socket
import subprocess
import time

import numpy as np
import pytest

from flaxformer_lite.inference.evaluation import evaluate_workdir
from flaxformer_lite.inference.translate import Translator
from flaxformer_lite.training.state import abstract_train_state
from flaxformer_lite.workdir import checkpoints as ckpt_lib
from tests import fixtures
from tests.fixtures import debug_config

ROOT = pathlib.Path(__file__).resolve().parents[1]
# In-process training here is not about devices (its subprocesses: one device too).
pytestmark = pytest.mark.usefixtures("one_device")
STEPS = 12  # checkpoints at 3, 6, 9, 12; the first epoch (105 pairs) ends at step 7


def _command(fixture_data, workdir, num_steps, checkpoint_every=3):
    return fixtures.debug_command(fixture_data, workdir, num_steps, checkpoint_every)


_env = fixtures.debug_env


def _run(fixture_data, workdir, num_steps=STEPS, expect=0):
    out = subprocess.run(
        _command(fixture_data, workdir, num_steps),
        cwd=ROOT,
        env=_env(fixture_data),
        capture_output=True,
        text=True,
        check=False,
    )
    assert out.returncode == expect, out.stderr[-3000:]
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


def _kill_when(fixture_data, workdir, ready, moment: str):
    """Start a run of STEPS steps and SIGKILL it as soon as ``ready()`` holds."""
    proc = _start(fixture_data, workdir, STEPS)
    fixtures.kill_when(proc, ready, 180, moment, poll=0.0005)


def _train_steps_logged(workdir) -> int:
    path = workdir / "metrics.jsonl"
    if not path.exists():
        return 0
    return sum('"split": "train"' in line for line in path.read_text().splitlines())


def _newest_train_step(workdir) -> int:
    path = workdir / "metrics.jsonl"
    steps = [0]
    for line in path.read_text().splitlines() if path.exists() else []:
        try:
            record = json.loads(line)
        except ValueError:  # the line being written as we read
            continue
        if record["split"] == "train":
            steps.append(record["step"])
    return max(steps)


def _saving(folder):
    return lambda: (
        folder.is_dir() and any(".orbax-checkpoint-tmp" in p.name for p in folder.iterdir())
    )


_losses = fixtures.train_losses
_examples = fixtures.step_examples


def _final_params(fixture_data, workdir, step=STEPS):
    target = abstract_train_state(debug_config(fixture_data[1])).params
    params, restored = ckpt_lib.restore_params(workdir, target, "last", step)
    return params, restored


_assert_same_params = fixtures.assert_same_params


def _assert_reproduces(fixture_data, run, straight):
    """``run`` (faulted, restarted) ended exactly as the uninterrupted ``straight``:
    losses, the examples of every step (none twice in an epoch, none skipped), and
    the final parameters bit for bit."""
    assert _losses(run) == _losses(straight)
    seen = _examples(run)
    assert seen == _examples(straight) and sorted(seen) == list(range(1, STEPS + 1))
    by_epoch: dict[int, list[int]] = {}
    for step in sorted(seen):
        for i in seen[step]:
            by_epoch.setdefault(i >> 32, []).append(i & 0xFFFFFFFF)
    assert len(by_epoch) == 2  # the run crossed an epoch's end
    assert sorted(by_epoch[0]) == list(range(len(by_epoch[0])))  # each example once
    assert len(set(by_epoch[1])) == len(by_epoch[1])
    _assert_same_params(
        _final_params(fixture_data, straight)[0], _final_params(fixture_data, run)[0]
    )


@pytest.fixture(scope="module")
def straight(fixture_data, tmp_path_factory):
    """The uninterrupted run every faulted one is compared with."""
    run = tmp_path_factory.mktemp("straight") / "run"
    _run(fixture_data, run)
    return run


def test_sigkill_inside_a_checkpoint_save_resumes(fixture_data, straight, tmp_path):
    """The kill lands while orbax writes step 3 (its temporary folder exists); the next
    start takes over the dead run's lock, removes the half-written folder and trains
    from the start, ending as the uninterrupted run did."""
    run = tmp_path / "killed"
    _kill_when(fixture_data, run, _saving(run / "checkpoints"), "a checkpoint save")
    assert _saving(run / "checkpoints")()
    out = _run(fixture_data, run)
    assert "took over" in out.stdout and "a run that ended without releasing it" in out.stdout
    assert "an incomplete checkpoint of an interrupted save" in out.stdout
    _assert_reproduces(fixture_data, run, straight)


@pytest.mark.slow
def test_sigkill_at_other_moments_resumes(fixture_data, straight, tmp_path):
    """Killed before the first checkpoint, right after one completes, and between two;
    each restart resumes from the newest complete checkpoint."""
    run = tmp_path / "killed"
    folder = run / "checkpoints"
    _kill_when(fixture_data, run, lambda: _train_steps_logged(run) >= 1, "its first step")
    assert not ckpt_lib.steps(run)
    _kill_when(fixture_data, run, lambda: (folder / "6").is_dir(), "checkpoint 6")
    # The newest step logged, not a count of lines: how many steps each killed run
    # logged before its SIGKILL landed depends on the machine's speed.
    _kill_when(fixture_data, run, lambda: _newest_train_step(run) >= 10, "step 10")
    assert ckpt_lib.steps(run)[-1] == 9
    out = _run(fixture_data, run)
    assert "resumed from step 9" in out.stdout
    _assert_reproduces(fixture_data, run, straight)


def _truncate_arrays(folder: pathlib.Path) -> None:
    """Cut every array data file of a checkpoint to 100 bytes (a write cut short)."""
    files = [p for p in folder.rglob("*") if p.is_file() and p.parent.name == "d"]
    assert files
    for path in files:
        with open(path, "r+b") as f:
            f.truncate(100)


@pytest.mark.slow
def test_an_unreadable_checkpoint_falls_back_to_the_one_before(
    fixture_data, straight, tmp_path, capsys
):
    """Truncated files and a missing item: translate/evaluate and the resume take the
    newest checkpoint they can read, with a warning naming each bad one; a resume
    from there ends as the uninterrupted run did; none readable is one clear error."""
    run = tmp_path / "run"
    shutil.copytree(straight, run)
    best = ckpt_lib.steps(run, "best")[-1]
    _truncate_arrays(run / "checkpoints_best" / str(best))
    _truncate_arrays(run / "checkpoints" / "12")
    shutil.rmtree(run / "checkpoints" / "9" / "data")  # the data position: training needs it

    translator = Translator.from_workdir(run)
    err = capsys.readouterr().err
    assert f"the best checkpoint of step {best} in {run} cannot be read" in err
    assert f"the last checkpoint of step 12 in {run} cannot be read" in err
    assert "Traceback" not in err and "Event loop is closed" not in err
    assert translator.checkpoint == "last checkpoint, step 9"  # its parameters are whole
    assert len(translator.translate(["Wo ist der Bahnhof?", "", "Komm her!"], beam_size=1)) == 3
    scores = evaluate_workdir(run, "validation", limit=4, beam_size=1)
    assert np.isfinite(scores.bleu)

    out = _run(fixture_data, run)
    assert "the last checkpoint of step 12" in out.stdout and "step 9" in out.stdout
    assert "resumed from step 6" in out.stdout and "Traceback" not in out.stderr
    assert (run / "checkpoints" / "12.unreadable").is_dir()  # kept for a look, not used
    _assert_reproduces(fixture_data, run, straight)

    # Shapes of another model: nothing can be read, and that is one error.
    other = debug_config(fixture_data[1])
    other.model.d_ff = 24
    checkpoints = ckpt_lib.Checkpoints(run)
    with pytest.raises(ckpt_lib.CheckpointError, match="no checkpoint in .* can be read"):
        checkpoints.restore(abstract_train_state(other))
    checkpoints.close()
    config = json.loads((run / "config.json").read_text())
    config["model"]["d_ff"] = 24
    (run / "config.json").write_text(json.dumps(config))
    with pytest.raises(
        ckpt_lib.CheckpointError, match=r"no checkpoint in .* can be read \(\d+ tried"
    ):
        Translator.from_workdir(run)


@pytest.mark.slow  # ~30 s; its in-process form in the default run: a stop while resuming
def test_sigterm_checkpoints_and_exits_cleanly(fixture_data, tmp_path):
    """Preemption: SIGTERM after a few steps finishes the step, saves it, prints the
    resume command and exits 0; resuming reaches the end like an uninterrupted run."""
    run = tmp_path / "run"
    proc = _start_and_train(fixture_data, run, steps=4)
    # One writer per workdir: a second run refuses, naming the holder.
    second = _run(fixture_data, run, expect=1)
    assert second.stderr.strip().splitlines() == [
        f"error: {run} is in use by another training run: PID {proc.pid} on host "
        f"{socket.gethostname()} (since {second.stderr.split('(since ')[1].split(')')[0]}); "
        f"wait for it to finish, stop it (kill -TERM {proc.pid} saves a checkpoint first), "
        "or train in another --workdir"
    ]
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


def _catches_sigterm(pid: int) -> bool:
    """The process has installed a SIGTERM handler (Linux: /proc/PID/status SigCgt)."""
    try:
        status = pathlib.Path(f"/proc/{pid}/status").read_text()
    except OSError:
        return False
    caught = next(x for x in status.splitlines() if x.startswith("SigCgt:"))
    return bool(int(caught.split()[1], 16) >> (signal.SIGTERM - 1) & 1)


@pytest.mark.slow
@pytest.mark.skipif(not pathlib.Path("/proc/self/status").exists(), reason="needs /proc")
def test_sigterm_while_starting_stops_cleanly(fixture_data, tmp_path):
    """A preemptible machine is reclaimed while the run starts (imports, data, model,
    compilation): SIGTERM then stops it with nothing to save, says so, removes the
    workdir it created and exits 0 (not 143), so the same command starts afresh. Sent
    twice: during the imports (as soon as the handler is in, before JAX has loaded)
    and once the data is ready."""
    env = dict(_env(fixture_data), PYTHONUNBUFFERED="1")
    for moment in ("imports", "data"):
        run = tmp_path / moment
        proc = subprocess.Popen(
            _command(fixture_data, run, STEPS),
            cwd=ROOT,
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        deadline = time.monotonic() + 180
        seen = []
        if moment == "imports":
            while not _catches_sigterm(proc.pid):
                assert proc.poll() is None and time.monotonic() < deadline
                time.sleep(0.001)
        else:
            while not any(x.startswith("data: ") for x in seen):
                seen.append(proc.stdout.readline())
                assert seen[-1], proc.communicate()[1][-3000:]
        proc.send_signal(signal.SIGTERM)
        out, err = proc.communicate(timeout=120)
        out = "".join(seen) + out
        assert proc.returncode == 0, (moment, err[-3000:])
        assert "Traceback" not in err
        line = next(x for x in out.splitlines() if x.startswith("stopped by SIGTERM"))
        assert "before the first step (while " in line, line
        assert "nothing to save. The same command starts afresh: " in line, line
        assert "flaxformer_lite.main" in line
        assert not run.exists()  # nothing half-made is left behind


def test_a_stop_while_resuming_keeps_the_checkpoints(fixture_data, straight, tmp_path, capsys):
    """The same, in process, for a run that has checkpoints: nothing is removed and
    the message says the command resumes from the newest one."""
    from flaxformer_lite.training import preemption
    from flaxformer_lite.training.train import train_and_evaluate

    run = tmp_path / "run"
    shutil.copytree(straight, run)
    before = sorted(p.name for p in (run / "checkpoints").iterdir())
    asked = preemption.Preemption()
    asked.requested = "SIGTERM"  # as if it had arrived while the process started
    with pytest.MonkeyPatch.context() as m:
        m.setattr(preemption, "_AT_START", asked)
        metrics = train_and_evaluate(debug_config(fixture_data[1], num_steps=STEPS + 3), run)
    assert metrics == {"step": STEPS, "trained_steps": 0, "preempted": 1.0}
    assert f"nothing to save. The same command resumes from step {STEPS}" in capsys.readouterr().out
    assert sorted(p.name for p in (run / "checkpoints").iterdir()) == before


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


def _mount_tmpfs(path: pathlib.Path, size: str, options: str = "") -> bool:
    path.mkdir(parents=True, exist_ok=True)
    command = ["mount", "-t", "tmpfs", "-o", f"size={size}{options}", "tmpfs", str(path)]
    return subprocess.run(command, capture_output=True, check=False).returncode == 0


@pytest.fixture
def small_disk(tmp_path):
    """A 64 MiB tmpfs (a real filesystem that fills up); skipped where mounting is not
    allowed (not root), where the mocked ENOSPC test below still runs."""
    disk = tmp_path / "disk"
    if not _mount_tmpfs(disk, "64m"):
        pytest.skip("cannot mount a tmpfs here (needs root)")
    yield disk
    subprocess.run(["umount", "-l", str(disk)], check=False)


@pytest.mark.slow  # the mocked ENOSPC test below is its reduced form in the default run
def test_a_full_disk_stops_with_one_message_and_keeps_the_last_checkpoint(fixture_data, small_disk):
    from flaxformer_lite.training.train import train_and_evaluate

    run = small_disk / "run"
    train_and_evaluate(debug_config(fixture_data[1], num_steps=3, checkpoint_every=3), run)
    free = shutil.disk_usage(small_disk).free
    (small_disk / "filler").write_bytes(b"\0" * (free - 60_000))
    config = debug_config(fixture_data[1], num_steps=9, checkpoint_every=3)
    with pytest.raises(ckpt_lib.CheckpointError) as e:
        train_and_evaluate(config, run)
    assert "(No space left on device)" in str(e.value) and "step 6" in str(e.value)
    assert "the checkpoint of step 3 is intact" in str(e.value)
    for kind in ("checkpoints", "checkpoints_best"):  # no half-written step left behind
        assert sorted(p.name for p in (run / kind).iterdir()) == ["3"]
    (small_disk / "filler").unlink()
    metrics = train_and_evaluate(config, run)
    assert metrics["step"] == 9 and metrics["trained_steps"] == 6
    # A read-only filesystem: refused before anything is read or written.
    subprocess.run(["mount", "-o", "remount,ro", str(small_disk)], check=True)
    with pytest.raises(Exception, match=r"cannot write to --workdir=.*\(Read-only file system\)"):
        train_and_evaluate(config.copy_and_resolve_references(), run)


def test_a_failed_checkpoint_write_is_cleaned_up(fixture_data, tmp_path, monkeypatch):
    """The same guarantee without a tmpfs: orbax's write fails with ENOSPC halfway
    through step 6 (a partial folder exists); the error names it, the folder goes."""
    import errno

    import orbax.checkpoint as ocp

    from flaxformer_lite.training.train import train_and_evaluate

    run = tmp_path / "run"
    save = ocp.CheckpointManager.save

    def failing_save(self, step, *args, **kwargs):
        if step == 6:
            (pathlib.Path(self.directory) / "6.orbax-checkpoint-tmp-123").mkdir()
            raise OSError(errno.ENOSPC, "No space left on device")
        return save(self, step, *args, **kwargs)

    monkeypatch.setattr(ocp.CheckpointManager, "save", failing_save)
    config = debug_config(fixture_data[1], num_steps=6, checkpoint_every=3, eval_every=100)
    with pytest.raises(ckpt_lib.CheckpointError, match=r"step 6 .*No space left on device"):
        train_and_evaluate(config, run)
    assert sorted(p.name for p in (run / "checkpoints").iterdir()) == ["3"]
    assert ckpt_lib.restore_params(run, abstract_train_state(config).params, "last")[1] == 3
