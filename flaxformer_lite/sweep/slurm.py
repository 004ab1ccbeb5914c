"""A sweep's runs as a SLURM job array (``--config.launch.launcher=slurm``).

The sweep command writes each run's ``command.txt`` (and ``score.txt``), submits the
runs not finished, queued or running as one job array (``sbatch``), and records each
run's job; with ``--wait`` it then polls ``squeue`` until they end, collects the rows
and writes the report as a local sweep does. Without it, it returns once submitted:
the same command later (or ``--status``) says where each run is, submits what
stopped without finishing (nothing twice: a run whose job is queued or running is
left to it) and collects what finished. A run's job (:mod:`~flaxformer_lite.sweep.job`)
saves and requeues itself on SIGTERM (``--signal`` before the time limit, a
preemption), so an unattended sweep goes on; where SLURM refuses the requeue, a
waiting sweep (or the command run again) submits the run anew.

The sweep folder's ``slurm/``:

- ``array-N.sbatch``: the N-th submission's job script (readable; ``sbatch`` it again by
  hand), with ``array-N.runs``: its runs, a folder a line (task i runs line i + 1);
- ``jobs.json``: each run's job (``ARRAY_TASK``) and when it was submitted;
- ``ARRAY_TASK.out``: the job's own output (the runs' output is in their folders).
"""

from __future__ import annotations

import json
import os
import shlex
import shutil
import subprocess
import sys
import time

from flaxformer_lite.config.launch import LaunchConfig
from flaxformer_lite.sweep import logs, rows
from flaxformer_lite.sweep.job import DONE_FILE, attempts
from flaxformer_lite.sweep.spec import RunSpec, SweepError
from flaxformer_lite.workdir import location, storage

FOLDER = "slurm"
JOBS = "jobs.json"
TOOLS = ("sbatch", "squeue", "scontrol")
POLL_SECONDS = float(os.environ.get("FLAXFORMER_SLURM_POLL", 10))
# What sbatch says when it refuses a setting, and the field that set it.
REFUSALS = (
    ("Invalid partition", "partition"),
    ("Invalid account", "account"),
    ("Invalid qos", "qos"),
    ("Invalid generic resource", "gpus_per_task"),
    ("Memory specification can not be satisfied", "mem"),
    ("Requested time limit is invalid", "time"),
    ("Requested node configuration is not available", "nodes"),
)


def check_tools() -> None:
    """SLURM's commands on the PATH, else one line naming the fix."""
    missing = [tool for tool in TOOLS if shutil.which(tool) is None]
    if missing:
        raise SweepError(
            f"config.launch.launcher=slurm needs SLURM's {', '.join(missing)} on the PATH; run "
            "the sweep on the cluster's login node (or install SLURM's client), or use "
            "--config.launch.launcher=local"
        )


def _options(launch: LaunchConfig) -> list[str]:
    """The sbatch options of one run, from the launch section."""
    opts = [f"--nodes={launch.nodes}", f"--ntasks-per-node={launch.tasks_per_node}"]
    for field, flag in (("partition", "partition"), ("account", "account"), ("qos", "qos"),
                        ("time", "time"), ("mem", "mem")):  # fmt: skip
        if getattr(launch, field):
            opts.append(f"--{flag}={getattr(launch, field)}")
    if launch.gpus_per_task:
        opts.append(f"--gpus-per-task={launch.gpus_per_task}")
    if launch.cpus_per_task:
        opts.append(f"--cpus-per-task={launch.cpus_per_task}")
    return [*opts, *launch.sbatch_extra()]


def script(folder: str, runs_file: str, count: int, launch: LaunchConfig, name: str) -> str:
    """The job script of an array of ``count`` runs (task i: line i + 1 of ``runs_file``)."""
    array = f"0-{count - 1}" + (f"%{launch.max_running}" if launch.max_running else "")
    lines = ["#!/bin/bash", f"#SBATCH --job-name={name}", f"#SBATCH --array={array}"]
    lines += [f"#SBATCH {opt}" for opt in _options(launch)]
    lines += [
        f"#SBATCH --signal=TERM@{launch.signal_seconds}",  # to the steps: the run saves
        "#SBATCH --requeue",
        "#SBATCH --open-mode=append",
        f"#SBATCH --chdir={os.getcwd()}",
        f"#SBATCH --output={folder}/{FOLDER}/%A_%a.out",
        f"# One run of the sweep in {folder} per task: its command.txt (train, resumed",
        "# after a requeue), then its score.txt; flaxformer_lite/sweep/job.py says how.",
        f"exec {sys.executable} -m flaxformer_lite.sweep.job {runs_file} "
        f"{launch.processes} {launch.score}",
    ]
    return "\n".join(lines) + "\n"


def _absolute(workdir) -> str:
    return str(storage.absolute(workdir))


def jobs(workdir) -> dict[str, dict]:
    """Each submitted run's job record (run folder -> {"job", "submitted"})."""
    path = location.path(workdir) / FOLDER / JOBS
    if not path.exists():
        return {}
    try:
        recorded = json.loads(path.read_text())
    except ValueError:
        raise SweepError(f"{path} is not valid JSON; restore it (or delete it)") from None
    return recorded if isinstance(recorded, dict) else {}


def submit(workdir, specs: list[RunSpec], launch: LaunchConfig, name: str) -> str:
    """Submit ``specs`` as one job array; record each run's job; the array's id."""
    root = location.path(workdir) / FOLDER
    root.mkdir(parents=True, exist_ok=True)
    number = 1 + sum(1 for p in root.iterdir() if p.name.endswith(".sbatch"))
    runs_file = root / f"array-{number}.runs"
    folder = _absolute(workdir)
    storage.write_atomic(runs_file, "".join(f"{folder}/{s.folder}\n" for s in specs))
    path = root / f"array-{number}.sbatch"
    storage.write_atomic(path, script(folder, str(storage.absolute(runs_file)), len(specs),
                                       launch, name))  # fmt: skip
    out = subprocess.run(["sbatch", "--parsable", storage.local_copy(path)],
                         capture_output=True, text=True)  # fmt: skip
    if out.returncode:
        raise SweepError(_refusal(out.stderr, launch))
    array = out.stdout.strip().split(";")[0]
    recorded = jobs(workdir)
    for i, spec in enumerate(specs):
        made = attempts(location.path(workdir) / spec.folder)  # by its jobs before this one
        recorded[spec.folder] = {"job": f"{array}_{i}", "submitted": time.time(), "attempts": made}
    storage.write_atomic(root / JOBS, json.dumps(recorded, indent=1))
    return array


def _refusal(stderr: str, launch: LaunchConfig) -> str:
    """sbatch's own message, naming the setting it refused."""
    said = " ".join(line.removeprefix("sbatch: error:").strip()
                    for line in stderr.strip().splitlines() if line.strip())  # fmt: skip
    for phrase, field in REFUSALS:
        if phrase.lower() in said.lower():
            return (
                f"config.launch.{field}={getattr(launch, field)!r}: SLURM refused the job "
                f"({said}); `sinfo` and `sacctmgr show assoc user=$USER` list what you may use"
            )
    return f"sbatch refused the sweep's jobs ({said}); check config.launch"


def live(job_ids: list[str]) -> dict[str, str]:
    """The queued or running ones of ``job_ids`` (``ARRAY_TASK``), with SLURM's state.

    ``squeue`` alone can miss a task for a moment (a task being requeued between its end
    and its new queue entry, a controller too busy to answer): a task it does not list
    is asked for by name (``scontrol show job``, which knows a job for minutes after it
    ended), and counts as live where its state says it will run again, or where SLURM
    did not answer at all (``UNANSWERED``: a controller restarting is no job's end, and
    a run is never submitted again beside a job that may still be running it)."""
    arrays = sorted({j.split("_")[0] for j in job_ids})
    if not arrays:
        return {}
    out = subprocess.run(["squeue", "-h", "-r", "-o", "%i %T", "-j", ",".join(arrays)],
                         capture_output=True, text=True)  # fmt: skip
    states = {}
    if out.returncode == 0:  # (non-zero: every array gone, or no answer: asked below)
        states = dict(line.split() for line in out.stdout.splitlines() if len(line.split()) == 2)
    for job in job_ids:
        if job not in states:
            again = _scontrol_state(job)
            if again in _WILL_RUN or again == UNANSWERED:
                states[job] = again
    return {j: states[j] for j in job_ids if j in states}


# SLURM's job states of a task that is queued, running or about to run again.
_WILL_RUN = ("PENDING", "REQUEUED", "REQUEUE_HOLD", "REQUEUE_FED", "RUNNING", "CONFIGURING",
             "COMPLETING", "SUSPENDED", "RESIZING", "STAGE_OUT", "SIGNALING")  # fmt: skip


UNANSWERED = "UNANSWERED"  # the state of a job SLURM said nothing about


def _scontrol_state(job: str) -> str | None:
    """A job's ``JobState`` by ``scontrol show job``: None where SLURM no longer knows
    it, :data:`UNANSWERED` where the controller did not answer."""
    out = subprocess.run(["scontrol", "-o", "show", "job", job], capture_output=True, text=True)
    if out.returncode and "invalid job id" not in out.stderr.lower():
        return UNANSWERED
    for field in out.stdout.split() if out.returncode == 0 else ():
        if field.startswith("JobState="):
            return field.removeprefix("JobState=")
    return None


def state(workdir, spec: RunSpec, recorded: dict, running: dict[str, str]) -> tuple[str, str]:
    """(state, detail) of a run: ``done`` (its job finished it), ``queued``/``running``
    (job id), ``unknown`` (SLURM did not answer about its job), ``failed`` (its job
    ended without finishing it: the log's tail), ``stopped`` (saved early and not
    requeued) or ``new`` (never submitted)."""
    folder = location.path(workdir) / spec.folder
    job = recorded.get(spec.folder, {}).get("job")
    if (folder / DONE_FILE).exists():
        return "done", ""
    if running.get(job) == UNANSWERED:
        return "unknown", f"job {job}: SLURM did not answer about it; asked again"
    if job in running:
        kind = "running" if running[job] in ("RUNNING", "COMPLETING") else "queued"
        return kind, f"job {job}, {running[job].lower()}"
    if job is None:
        return "new", ""
    train = logs.tail(folder / "train.log", 3)
    if logs.PREEMPTED in train:
        return "stopped", f"job {job} saved it early; the sweep command again resumes it"
    failed = logs.tail(folder / "evaluate.log", 3) or train
    return "failed", f"job {job}: {failed or 'no output (see slurm/' + job + '.out)'}"


def sweep_rows(sweep, runs: list[RunSpec], workdir, launch: LaunchConfig, *, wait: bool,
               status: bool) -> list[dict] | None:  # fmt: skip
    """Submit what needs a job, say where each run is; with ``wait``, poll until every
    job ended and return the rows in grid order (None otherwise, or for ``status``)."""
    recorded_rows = rows.recorded(workdir)
    unanswered = 0  # jobs SLURM said nothing about at the last poll
    while True:
        submitted = jobs(workdir)
        running = live([r["job"] for r in submitted.values()])
        states = {}
        for spec in runs:
            if rows.finished_row(workdir, spec, recorded_rows.get(spec.folder)) is not None:
                states[spec.folder] = ("done", "")
            else:
                states[spec.folder] = state(workdir, spec, submitted, running)
        ready = [s for s in runs if states[s.folder][0] == "done"]
        for spec in ready:  # a job finished it: its row, once
            if rows.finished_row(workdir, spec, recorded_rows.get(spec.folder)) is None:
                _collect(sweep, spec, workdir, launch)
        if status:
            for spec in runs:
                kind, detail = states[spec.folder]
                print(f"{spec.folder}: {kind}" + (f" ({detail})" if detail else ""), flush=True)
            return None
        again = [s for s in runs if states[s.folder][0] in ("new", "stopped", "failed")]
        again = [
            s for s in again if not (wait and _tried(submitted, s, states[s.folder][0], workdir))
        ]
        if again:
            for spec in again:
                rows.prepare(sweep, spec, workdir)  # command.txt, score.txt
            array = submit(workdir, again, launch, _name(workdir))
            print(f"sweep: {len(again)} run(s) submitted as SLURM job array {array} "
                  f"({location.path(workdir) / FOLDER})", flush=True)  # fmt: skip
            continue
        waiting = [s for s in runs if states[s.folder][0] in ("queued", "running", "unknown")]
        if not wait:
            counts = {}
            for kind, _ in states.values():
                counts[kind] = counts.get(kind, 0) + 1
            print("sweep: " + ", ".join(f"{n} {k}" for k, n in sorted(counts.items()))
                  + "; the same command (or --status) collects the finished runs, --wait "
                  "waits for them", flush=True)  # fmt: skip
            return None
        if not waiting:
            return [_row(workdir, spec, states[spec.folder], recorded_rows) for spec in runs]
        unknown = sum(kind == "unknown" for kind, _ in states.values())
        if unknown and not unanswered:  # once a spell
            print(f"sweep: SLURM did not answer about {unknown} job(s) (its controller "
                  f"busy or restarting?); asking again every {POLL_SECONDS:g} s",
                  flush=True)  # fmt: skip
        unanswered = unknown
        time.sleep(POLL_SECONDS)


def _tried(submitted: dict, spec: RunSpec, kind: str, workdir) -> bool:
    """Whether the run had its last chance in this command already: a job submitted
    in it that failed is reported at the end, not submitted again and again. A run
    that its job saved early is submitted again where its requeue did not take (SLURM
    refused it, MaxBatchRequeue reached, the requeued task killed at its start) as
    long as each job made an attempt (one that never started is reported)."""
    record = submitted.get(spec.folder, {})
    if record.get("submitted", 0) < _STARTED:
        return False
    if kind == "stopped":
        return attempts(location.path(workdir) / spec.folder) <= record.get("attempts", 0)
    return True


_STARTED = time.time()  # this process's start: jobs it submitted itself came after


def _name(workdir) -> str:
    return f"sweep-{location.path(workdir).name}"


def _collect(sweep, spec: RunSpec, workdir, launch: LaunchConfig) -> None:
    """The row of a run its job finished; scored here first where ``launch.score`` is
    local (the job trained it only)."""
    folder = location.path(workdir) / spec.folder
    score = folder / rows.SCORE_FILE
    if launch.score == "local" and score.exists() and not (folder / SCORED).exists():
        command = shlex.split(score.read_text())
        if logs.run_logged(command, folder / "evaluate.log"):
            return  # reported as failed below, from the log's tail
        storage.write_atomic(folder / SCORED, "")
    rows.collect(sweep, spec, workdir, None)


SCORED = "sweep_scored"  # a run scored here after its job (launch.score=local)


def _row(workdir, spec: RunSpec, state_: tuple[str, str], recorded_rows: dict) -> dict:
    row = rows.finished_row(workdir, spec, recorded_rows.get(spec.folder))
    if row is not None:
        return row
    folder = location.path(workdir) / spec.folder
    detail = state_[1] or logs.tail(folder / "evaluate.log") or logs.tail(folder / "train.log")
    return rows.failed_row(spec, detail)
