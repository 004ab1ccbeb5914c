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
import json
import signal
import subprocess
import threading
import time
from typing import Any

import jax

from flaxformer_lite.config import trust
from flaxformer_lite.config.experiment import ExperimentConfig
from flaxformer_lite.data import synthetic
from flaxformer_lite.data.builders import LOCAL_BUILDERS, build_local_dataset
from flaxformer_lite.sweep import logs, rows, significance, slurm
from flaxformer_lite.sweep.record import RESULTS_JSONL, SPEC_FILE
from flaxformer_lite.sweep.report import summarize
from flaxformer_lite.sweep.spec import RunSpec, Sweep, SweepError, parse_axis
from flaxformer_lite.workdir import location, storage

RESULTS_MD = "results.md"


def _claim_folder(sweep: Sweep, workdir: location.Path) -> None:
    spec_file = workdir / SPEC_FILE
    if spec_file.is_file():
        old = rows.read_json(spec_file, dict)
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
    storage.write_atomic(spec_file, json.dumps(sweep.to_json(), indent=2))


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
    return logs.run_logged(command, log, env, start=_CHILDREN.run)


_tail = logs.tail


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
    finished = rows.finished_row(workdir, spec, recorded)
    if finished is not None:
        return finished
    if _CHILDREN.stopping:  # the sweep is being interrupted: start nothing new
        return {"run": spec.folder, "status": "failed", "error": "interrupted"}
    folder = workdir / spec.folder
    command, score = rows.prepare(sweep, spec, workdir)
    start = time.perf_counter()
    if _run_logged(command, folder / "train.log", env):
        return rows.failed_row(spec, _tail(folder / "train.log"))
    if _CHILDREN.stopping or logs.PREEMPTED in _tail(folder / "train.log", 2):
        # A preempted run checkpoints and exits 0 without finishing: not a result.
        return rows.failed_row(spec, "interrupted")
    if score and _run_logged(score, folder / "evaluate.log", env):
        return rows.failed_row(spec, _tail(folder / "evaluate.log"))
    return rows.collect(sweep, spec, workdir, (time.perf_counter() - start) / 60)


def sweep_main(
    config: str, axes: list[str], seeds: int, overrides: dict, workdir: str, *,
    split: str, limit: int, parallel: int, decode_flags: tuple[str, ...], baseline: str = "",
    wait: bool = True, status: bool = False,
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
    results = run_sweep(spec, workdir, parallel=parallel, wait=wait, status=status)
    if results is None:  # jobs submitted and not waited for, or only a status
        return
    failed = [r for r in results if r.get("status") != "ok"]
    print(f"results: {workdir}/{RESULTS_MD}, {workdir}/{RESULTS_JSONL}, {workdir}/results.png")
    if failed:
        first = str(failed[0].get("error") or "no output").splitlines()[-1][-300:]
        raise SweepError(
            f"{len(failed)} of {len(results)} runs failed: {', '.join(r['run'] for r in failed)}"
            f" (the first: {first}; see their train.log)"
        )


def run_sweep(
    sweep: Sweep,
    workdir,
    parallel: int = 1,
    env: dict[str, str] | None = None,
    *,
    wait: bool = True,
    status: bool = False,
) -> list[dict[str, Any]] | None:
    """Run (or resume) every run of ``sweep`` in ``workdir``; write the reports; return
    the rows in grid order. Raises SweepError before anything runs if the spec is bad.

    ``env``: the runs' environment (default: this process's). With
    ``config.launch.launcher=slurm`` the runs are submitted as jobs
    (:mod:`~flaxformer_lite.sweep.slurm`): without ``wait`` this returns None once they
    are; ``status`` only says where each run is (None).
    """
    if parallel < 1:
        raise SweepError(f"--parallel={parallel} must be >= 1")
    workdir = location.path(workdir)
    runs = sweep.validate()
    launch = ExperimentConfig.from_config(sweep.base()).launch
    if launch.launcher == "slurm":
        slurm.check_tools()
    _claim_folder(sweep, workdir)
    if launch.launcher == "slurm":
        ordered = slurm.sweep_rows(sweep, runs, workdir, launch, wait=wait, status=status)
        if ordered is not None:
            report(sweep, runs, ordered, workdir)
        return ordered
    if status:
        recorded = rows.recorded(workdir)
        for r in runs:
            print(f"{r.folder}: {'done' if _finished(workdir, r, recorded) else 'not finished'}")
        return None
    data = sweep.base().data
    if parallel > 1 and data.dataset in LOCAL_BUILDERS:
        build_local_dataset(data.dataset, data.data_dir)  # once, not by racing runs
    elif parallel > 1 and synthetic.parse(data.dataset) is not None:
        synthetic.build(data.dataset, data.data_dir)
    recorded = rows.recorded(workdir)
    finished = sum(_finished(workdir, r, recorded) for r in runs)
    print(
        f"sweep: {len(runs)} runs ({len(runs) // sweep.seeds} points x {sweep.seeds} seeds) "
        f"in {workdir}; {finished} finished before, {parallel} at a time",
        flush=True,
    )
    by_run: dict[str, dict] = {}
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
            by_run[spec.folder] = row
            print(f"[{len(by_run)}/{len(runs)}] {_line(row)}", flush=True)
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
    ordered = [by_run[r.folder] for r in runs]
    report(sweep, runs, ordered, workdir)
    return ordered


def report(sweep: Sweep, runs: list[RunSpec], ordered: list[dict], workdir) -> None:
    """results.jsonl, results.md (with the baseline's significance) and results.png."""
    storage.write_atomic(workdir / RESULTS_JSONL, "".join(json.dumps(r) + "\n" for r in ordered))
    text = summarize(sweep, ordered)
    baseline, verdicts = None, None
    if sweep.baseline:
        points = [(r.folder.rpartition("/")[0], r.overrides) for r in runs]
        baseline = significance.find_baseline(points, sweep.baseline)
        section, verdicts = significance.report(ordered, baseline, sweep.split, workdir)
        text += section
    storage.write_atomic(workdir / RESULTS_MD, text)
    significance.figure(ordered, baseline, sweep.split, workdir, verdicts)


def _finished(workdir: location.Path, spec: RunSpec, recorded: dict[str, dict]) -> bool:
    return (workdir / spec.folder / rows.RESULT_FILE).is_file() or spec.folder in recorded


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
