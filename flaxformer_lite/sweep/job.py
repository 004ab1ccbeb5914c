"""One task of a sweep's SLURM job array: one run, trained (or resumed), then scored.

    python -m flaxformer_lite.sweep.job RUNS_FILE PROCESSES SCORE

``RUNS_FILE`` lists the array's run folders, a line each: task ``i`` (SLURM's
``SLURM_ARRAY_TASK_ID``) runs line ``i + 1``: its ``command.txt`` through ``srun``
(``PROCESSES`` > 1: that many processes with ``--distributed``; JAX reads SLURM's
variables), its output appended to the run's ``train.log``; then, with ``SCORE`` =
``job``, its ``score.txt`` (``evaluate.log``). Training is a job step, so a SIGTERM
that SLURM sends to the job's steps (``--signal`` before the time limit, ``scancel
--signal=TERM``, a preemption) reaches it: it saves a checkpoint and stops, and the
task requeues itself, to resume from that checkpoint (a refused requeue is said in
``train.log``, and the sweep submits the run again). Each attempt's wall minutes go
to the run's ``sweep_minutes.json``; a finished task writes ``sweep_job.json``, which
tells the sweep the run is ready to collect. Imports nothing that loads JAX.
"""

from __future__ import annotations

import json
import os
import shlex
import subprocess
import sys
import time

from flaxformer_lite.sweep import logs
from flaxformer_lite.workdir import location, storage

DONE_FILE = "sweep_job.json"  # in a run's folder: its job trained (and scored) it
MINUTES_FILE = "sweep_minutes.json"  # in a run's folder: each attempt's wall minutes


def _spent(folder) -> list:
    path = folder / MINUTES_FILE
    try:
        spent = json.loads(path.read_text()) if path.exists() else []
    except ValueError:
        return []
    return spent if isinstance(spent, list) else []


def attempts(folder) -> int:
    """How many attempts the run's jobs have made so far (ended, requeued or failed)."""
    return len(_spent(folder))


def _minutes(folder, started: float) -> None:
    """Add this attempt's wall minutes to the run's record of its attempts."""
    storage.write_atomic(folder / MINUTES_FILE,
                         json.dumps([*_spent(folder), (time.time() - started) / 60]))  # fmt: skip


def _task_id() -> str:
    return f"{os.environ['SLURM_ARRAY_JOB_ID']}_{os.environ['SLURM_ARRAY_TASK_ID']}"


def main(argv: list[str]) -> int:
    runs_file, processes, score = argv[0], int(argv[1]), argv[2]
    index = int(os.environ["SLURM_ARRAY_TASK_ID"])
    folder = location.path(location.path(runs_file).read_text().splitlines()[index])
    started = time.time()
    command = shlex.split((folder / "command.txt").read_text())
    if processes > 1:
        command.append("--distributed")
    step = ["srun", f"--ntasks={processes}", "--kill-on-bad-exit=1", *command]
    code = logs.run_logged(step, folder / "train.log")
    if code:
        _minutes(folder, started)
        return code  # the sweep reports the log's tail
    if logs.PREEMPTED in logs.tail(folder / "train.log", 2):
        _minutes(folder, started)  # saved, not finished: again, from its checkpoint
        print(f"{folder}: stopped early and saved; requeuing it to resume", flush=True)
        requeue = subprocess.run(["scontrol", "requeue", _task_id()], capture_output=True,
                                 text=True)  # fmt: skip
        if requeue.returncode == 0:
            return 0
        said = " ".join((requeue.stderr or requeue.stdout).split()) or f"exit {requeue.returncode}"
        logs.append(folder / "train.log",
                    f"sweep job {_task_id()}: SLURM refused its requeue ({said}); a waiting "
                    "sweep submits the run again, as does the sweep command run again")  # fmt: skip
        return 0
    scored = score == "job" and (folder / "score.txt").exists()
    if scored:
        evaluate = shlex.split((folder / "score.txt").read_text())
        code = logs.run_logged(["srun", "--ntasks=1", *evaluate], folder / "evaluate.log")
        if code:
            _minutes(folder, started)
            return code
    _minutes(folder, started)
    record = {"job": _task_id(), "scored": scored, "finished": time.time()}
    storage.write_atomic(folder / DONE_FILE, json.dumps(record))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
