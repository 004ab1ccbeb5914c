"""Running a sweep: a cross product of config overrides, times seeds, each an ordinary run.

  python -m flaxformer_lite.main sweep --config=configs/ende_small.py:debug \\
      --sweep=model.num_heads=1,2 --sweep=model.positional=sinusoidal,learned \\
      --seeds=3 --workdir=runs/sweeps/heads [--parallel=2] [--config.train.num_steps=20]

Every point of the grid and every seed is a run in its own folder,
``<workdir>/<point>/seed<N>``, started as the command in its ``command.txt`` (the
``train`` command with the base overrides, the point's overrides and
``train.seed``), so any run can be repeated, inspected, translated or averaged
by itself. Translation runs are then scored with ``main evaluate`` on
``--split`` (BLEU and chrF; ``--limit`` sentences, 0 = all).

Re-running the same command resumes: a run whose ``sweep_result.json`` exists, or
whose row in the sweep's ``results.jsonl`` is finished (its folder may be gone), is
skipped; an interrupted one is started again with the same command, which resumes
from its newest checkpoint. SIGTERM (a scheduler's preemption) or
Ctrl-C stops the running runs too, so none is left writing into its folder. The sweep folder gets

* ``results.jsonl``: one row per run (overrides, seed, parameters, FLOPs per
  training step, tokens/s, wall minutes, steps, the best validation
  nll / accuracy / perplexity and its step, test BLEU / chrF, status);
* ``results.md``: mean ± sample std over seeds per point;
* ``tensorboard/``: an HParams summary per run (``tensorboard --logdir <workdir>/tensorboard``);
* ``sweep.json``: the spec, so that a different sweep cannot reuse the folder.

A bad spec (no ``=``, an unknown field, a value of the wrong type, an empty list,
a point whose config does not validate) fails before anything runs, with one
line naming it. ``--sweep=model.num_encoder_layers+model.num_decoder_layers=1,3``
moves two fields together (a zip, not a product). Values are split at commas; a
value that holds commas (a sparse pattern, ``data.train_splits``) goes in a JSON list:
``--sweep='model.attention_pattern=["dense","local:window=16,causal=1"]'``.
"""

from __future__ import annotations

import concurrent.futures
import hashlib
import json
import math
import os
import shlex
import signal
import statistics
import subprocess
import sys
import threading
import time
from typing import Any

import jax

from flaxformer_lite.config import trust
from flaxformer_lite.config.experiment import ExperimentConfig
from flaxformer_lite.config.fields import ConfigError, json_of
from flaxformer_lite.data import synthetic
from flaxformer_lite.data.builders import LOCAL_BUILDERS, build_local_dataset
from flaxformer_lite.inference.run import Run
from flaxformer_lite.sweep import significance
from flaxformer_lite.sweep.record import RESULTS_JSONL, SPEC_FILE
from flaxformer_lite.sweep.report import METRICS, summarize
from flaxformer_lite.sweep.spec import RunSpec, Sweep, SweepError, parse_axis
from flaxformer_lite.training.flops import train_step_flops
from flaxformer_lite.training.logging import summary_writer_class
from flaxformer_lite.workdir import location
from flaxformer_lite.workdir.folder import read_config

RESULT_FILE = "sweep_result.json"  # in a run's folder: the run is finished
RESULTS_MD = "results.md"


def _claim_folder(sweep: Sweep, workdir: location.Path) -> None:
    spec_file = workdir / SPEC_FILE
    if spec_file.is_file():
        old = _json(spec_file, dict)
        for key in ("config", "overrides"):
            if old.get(key) != sweep.to_json()[key]:
                raise SweepError(
                    f"{workdir} holds a sweep with {key} {old.get(key)!r}, not "
                    f"{sweep.to_json()[key]!r}; choose another --workdir (or the same flags)"
                )
    elif workdir.exists() and any(workdir.iterdir()):
        raise SweepError(
            f"--workdir={workdir} exists and holds no {SPEC_FILE}: not a sweep folder; "
            "choose a new or empty folder"
        )
    workdir.mkdir(parents=True, exist_ok=True)
    location.write_atomic(spec_file, json.dumps(sweep.to_json(), indent=2))


def _json(path, shape: type):
    """A sweep's or run's JSON file, read as data of its one shape (else a SweepError
    naming the file and the fix)."""
    try:
        return json_of(path.read_text(), shape, str(path))
    except ConfigError as e:
        raise SweepError(f"{e}; restore it, or delete it to run that part again") from None


def _row(line: str, path) -> dict[str, Any]:
    """One line of a JSON-lines file, a dict (else a SweepError naming the file)."""
    try:
        return json_of(line, dict, f"a line of {path}")
    except ConfigError as e:
        raise SweepError(f"{e}; restore the file") from None


class SweepInterrupted(SweepError):
    """SIGTERM or SIGINT reached the sweep: its runs were stopped, none half-recorded."""


class _Children:
    """The runs' live processes, so that an interrupted sweep stops them instead of
    leaving them to write into folders that the resumed sweep runs again."""

    def __init__(self):
        self._lock = threading.Lock()
        self._live: set[subprocess.Popen] = set()
        self.stopping = False

    def run(self, command: list[str], out, env: dict[str, str] | None) -> int:
        with self._lock:
            if self.stopping:
                return -signal.SIGTERM
            process = subprocess.Popen(command, stdout=out, stderr=subprocess.STDOUT, env=env)
            self._live.add(process)
        try:
            return process.wait()
        finally:
            with self._lock:
                self._live.discard(process)

    def stop(self, grace_seconds: float = 30.0) -> None:
        with self._lock:
            self.stopping = True
            live = list(self._live)
        for process in live:
            process.terminate()
        for process in live:
            try:
                process.wait(grace_seconds)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait()


_CHILDREN = _Children()


def _run_logged(command: list[str], log: location.Path, env: dict[str, str] | None) -> int:
    """Run ``command`` with its output appended to ``log``. A bucket's log is written to
    a local copy while the command runs (an object cannot grow), then uploaded."""
    local = _local_log(log)
    try:
        with open(local, "a") as out:
            out.write(f"$ {shlex.join(command)}\n")
            out.flush()
            return _CHILDREN.run(command, out, env)
    finally:
        if location.is_remote(log):
            with open(local, "rb") as f:
                log.write_bytes(f.read())


def _local_log(log: location.Path) -> str:
    """The local file a log is appended to: itself, or for a bucket's log a copy in this
    machine's cache (started from the bucket's, so a resumed run's log keeps its past)."""
    if not location.is_remote(log):
        return location.local(log)
    folder = location.cache_folder("logs", hashlib.sha256(str(log).encode()).hexdigest()[:24])
    local = os.path.join(folder, log.name)
    if not os.path.exists(local):
        with open(local, "wb") as f:
            f.write(log.read_bytes() if log.exists() else b"")
    return local


def _tail(log: location.Path, lines: int = 3) -> str:
    local = _local_log(log) if location.is_remote(log) else location.local(log)
    text = open(local, errors="replace").read() if os.path.isfile(local) else ""
    return " | ".join(t.strip() for t in text.strip().splitlines()[-lines:])


def execute(
    sweep: Sweep,
    spec: RunSpec,
    workdir: location.Path,
    env: dict[str, str] | None = None,
    recorded: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """Train (or resume) one run, score it, and return its row; a finished run's row is
    read back from its ``sweep_result.json``, or is ``recorded`` (its row in the sweep's
    ``results.jsonl``, where the run folder itself is gone: an experiment's record)."""
    folder = workdir / spec.folder
    done = folder / RESULT_FILE
    if done.is_file():
        return _json(done, dict)
    if recorded is not None and recorded.get("status") == "ok":
        return recorded
    if _CHILDREN.stopping:  # the sweep is being interrupted: start nothing new
        return {"run": spec.folder, "status": "failed", "error": "interrupted"}
    folder.mkdir(parents=True, exist_ok=True)
    command = sweep.command(spec, workdir)
    (folder / "command.txt").write_text(shlex.join(command) + "\n")
    start = time.perf_counter()
    row = {"run": spec.folder, "overrides": spec.overrides, "seed": spec.seed}
    if _run_logged(command, folder / "train.log", env):
        return {**row, "status": "failed", "error": _tail(folder / "train.log")}
    if _CHILDREN.stopping or "stopped by SIG" in _tail(folder / "train.log", 2):
        # A preempted run checkpoints and exits 0 without finishing: not a result.
        return {**row, "status": "failed", "error": "interrupted"}
    config = read_config(folder)  # with the run's copies of its extensions
    scores = {}
    if sweep.split and config.data.task != "lm":  # BLEU, or a generated task's accuracy
        evaluate = [
            sys.executable,
            "-m",
            "flaxformer_lite.main",
            "evaluate",
            f"--workdir={folder}",
            f"--split={sweep.split}",
            f"--limit={sweep.limit}",
            "--trust_extensions",  # its own runs: the code the sweep's config trained
            *sweep.decode_flags,
        ]
        if _run_logged(evaluate, folder / "evaluate.log", env):
            return {**row, "status": "failed", "error": _tail(folder / "evaluate.log")}
        scores = _json(folder / f"{sweep.split}_scores.json", dict)
    minutes = (time.perf_counter() - start) / 60
    attempts = folder / "sweep_minutes.json"  # wall time over interrupted attempts
    earlier = _json(attempts, list) if attempts.is_file() else []
    attempts.write_text(json.dumps([*earlier, minutes]))
    row.update(measure(folder, config))
    row["wall_minutes"] = sum(earlier) + minutes
    for key in ("bleu", "chrf", "accuracy", "accuracy_by_group"):
        if key in scores:
            row[f"{sweep.split}_{key}"] = scores[key]
    row["status"] = "ok"
    location.write_atomic(done, json.dumps(row, indent=2))
    _hparams(workdir, sweep, spec, row)
    return row


def measure(folder: location.Path, config: ExperimentConfig) -> dict[str, Any]:
    """Size, cost and the best validation metrics of a finished run's folder."""
    params = Run(folder, config).abstract_params
    d, t = config.data, config.train
    text = (folder / "metrics.jsonl").read_text()
    records = [_row(line, folder / "metrics.jsonl") for line in text.splitlines() if line.strip()]
    train = [r for r in records if r["split"] == "train"]
    valid = [r for r in records if r["split"] == "validation" and math.isfinite(r["nll"])]
    # The first window holds the compilation; the median ignores it once there are three.
    speeds = [r["tokens_per_sec"] for r in train]
    best = min(valid, key=lambda r: r["nll"]) if valid else {}
    out = {
        "parameters": int(sum(x.size for x in jax.tree.leaves(params))),
        "flops_per_step": train_step_flops(
            config.model, t.batch_size, d.max_length, d.max_length, d.task
        ),
        "tokens_per_sec": statistics.median(speeds) if speeds else None,
        "steps": max((r["step"] for r in train), default=0),
        "best_step": best.get("step"),
        "valid_nll": best.get("nll"),
        "valid_accuracy": best.get("accuracy"),
        "valid_perplexity": best.get("perplexity"),
    }
    if "bleu" in best:
        out["valid_greedy_bleu"] = best["bleu"]
    return out


def _hparams(workdir: location.Path, sweep: Sweep, spec: RunSpec, row: dict[str, Any]) -> None:
    """One TensorBoard HParams entry per finished run (written once, when it finishes)."""
    hparams = {a.name: _tb_value(spec.overrides[a.fields[0]]) for a in sweep.axes}
    hparams["seed"] = spec.seed
    metrics = {
        f"hparam/{k}": float(v)
        for k, v in row.items()
        if k in METRICS and isinstance(v, int | float) and v is not None
    }
    with _HPARAMS, summary_writer_class()(str(workdir / "tensorboard")) as writer:
        writer.add_hparams(hparams, metrics, name=spec.folder)


# One HParams writer at a time: --parallel runs finishing together each made the sweep's
# tensorboard/ folder (tensorboardX makes it unless it exists), and one of them failed.
_HPARAMS = threading.Lock()


def _tb_value(value: Any) -> Any:
    return value if isinstance(value, int | float | str | bool) else str(value)


def sweep_main(
    config: str, axes: list[str], seeds: int, overrides: dict, workdir: str, *,
    split: str, limit: int, parallel: int, decode_flags: tuple[str, ...], baseline: str = "",
) -> None:  # fmt: skip
    """``main sweep``: the grid of ``axes`` (``section.field=v1,v2``) over ``config`` with
    its ``overrides``, run in ``workdir``; a SweepError names the runs that failed.

    This process only validates, counts parameters and tabulates: it stays on the CPU,
    so that the runs it starts (in their own processes) get the accelerators. It reads
    its own runs' code without asking (:mod:`~flaxformer_lite.config.trust`)."""
    jax.config.update("jax_platforms", "cpu")
    trust.trust_all()
    spec = Sweep(
        config=config, axes=tuple(parse_axis(a) for a in axes), seeds=seeds,
        overrides=overrides, split=split, limit=limit, decode_flags=decode_flags,
        baseline=baseline,
    )  # fmt: skip
    rows = run_sweep(spec, workdir, parallel=parallel)
    failed = [r["run"] for r in rows if r.get("status") != "ok"]
    print(f"results: {workdir}/{RESULTS_MD}, {workdir}/{RESULTS_JSONL}, {workdir}/results.png")
    if failed:
        raise SweepError(
            f"{len(failed)} of {len(rows)} runs failed: {', '.join(failed)} (see their train.log)"
        )


def run_sweep(
    sweep: Sweep, workdir, parallel: int = 1, env: dict[str, str] | None = None
) -> list[dict[str, Any]]:
    """Run (or resume) every run of ``sweep`` in ``workdir``; write the reports; return
    the rows in grid order. Raises SweepError before anything runs if the spec is bad.

    ``env``: the runs' environment (default: this process's).
    """
    if parallel < 1:
        raise SweepError(f"--parallel={parallel} must be >= 1")
    workdir = location.path(workdir)
    runs = sweep.validate()
    _claim_folder(sweep, workdir)
    data = sweep.base().data
    if parallel > 1 and data.dataset in LOCAL_BUILDERS:
        build_local_dataset(data.dataset, data.data_dir)  # once, not by racing runs
    elif parallel > 1 and synthetic.parse(data.dataset) is not None:
        synthetic.build(data.dataset, data.data_dir)
    recorded = _recorded(workdir)
    finished = sum(_finished(workdir, r, recorded) for r in runs)
    print(
        f"sweep: {len(runs)} runs ({len(runs) // sweep.seeds} points x {sweep.seeds} seeds) "
        f"in {workdir}; {finished} finished before, {parallel} at a time",
        flush=True,
    )
    rows: dict[str, dict] = {}
    on_main_thread = threading.current_thread() is threading.main_thread()
    if on_main_thread:  # SIGTERM (a scheduler's preemption) ends the sweep like Ctrl-C
        previous = signal.signal(signal.SIGTERM, _interrupt)
    pool = concurrent.futures.ThreadPoolExecutor(parallel)
    try:
        futures = {
            pool.submit(execute, sweep, r, workdir, env, recorded.get(r.folder)): r for r in runs
        }
        for future in concurrent.futures.as_completed(futures):
            spec = futures[future]
            row = future.result()
            rows[spec.folder] = row
            print(f"[{len(rows)}/{len(runs)}] {_line(row)}", flush=True)
    except KeyboardInterrupt:
        pool.shutdown(wait=False, cancel_futures=True)  # no queued run starts
        _CHILDREN.stop()  # the running ones end (and resume from checkpoints later)
        pool.shutdown(wait=True)
        finished = sum(_finished(workdir, r, recorded) for r in runs)
        raise SweepInterrupted(
            f"sweep interrupted with {finished} of {len(runs)} runs finished; the same "
            "command resumes it"
        ) from None
    finally:
        pool.shutdown(wait=True)
        if on_main_thread:
            signal.signal(signal.SIGTERM, previous)
        _CHILDREN.stopping = False
    ordered = [rows[r.folder] for r in runs]
    location.write_atomic(workdir / RESULTS_JSONL, "".join(json.dumps(r) + "\n" for r in ordered))
    text = summarize(sweep, ordered)
    baseline, verdicts = None, None
    if sweep.baseline:
        points = [(r.folder.rpartition("/")[0], r.overrides) for r in runs]
        baseline = significance.find_baseline(points, sweep.baseline)
        section, verdicts = significance.report(ordered, baseline, sweep.split, workdir)
        text += section
    location.write_atomic(workdir / RESULTS_MD, text)
    significance.figure(ordered, baseline, sweep.split, workdir, verdicts)
    return ordered


def _recorded(workdir: location.Path) -> dict[str, dict[str, Any]]:
    """The finished rows of the sweep's ``results.jsonl``, by run folder: runs it need
    not repeat even where their folders are gone (an experiment keeps its results, not
    its run folders)."""
    path = workdir / RESULTS_JSONL
    if not path.is_file():
        return {}
    rows = [_row(line, path) for line in path.read_text().splitlines() if line.strip()]
    return {r["run"]: r for r in rows if r.get("status") == "ok"}


def _finished(workdir: location.Path, spec: RunSpec, recorded: dict[str, dict]) -> bool:
    return (workdir / spec.folder / RESULT_FILE).is_file() or spec.folder in recorded


def _interrupt(signum, frame):
    raise KeyboardInterrupt


def _line(row: dict[str, Any]) -> str:
    if row.get("status") != "ok":
        return f"{row['run']}: FAILED ({row.get('error', '')})"
    text = f"{row['run']}: {row['steps']} steps, {row['wall_minutes']:.1f} min"
    if row.get("valid_nll") is not None:
        text += f", valid nll {row['valid_nll']:.3f}"
    for key, value in row.items():
        if key.endswith("_bleu") and key != "valid_greedy_bleu":
            text += f", {key.replace('_', ' ')} {value:.2f}"
    return text
