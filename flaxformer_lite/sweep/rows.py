"""A sweep run's row: what a finished run's folder says (size, cost, best validation
metrics, test scores), written to its ``sweep_result.json`` and the sweep's HParams,
and what any launcher prepares in a run's folder before it runs (``command.txt``,
``score.txt``). Shared by the local launcher (:mod:`~flaxformer_lite.sweep.runner`)
and SLURM's (:mod:`~flaxformer_lite.sweep.slurm`), so the report does not know which
one ran a run."""

from __future__ import annotations

import json
import math
import shlex
import statistics
import threading
from typing import Any

import jax

from flaxformer_lite.config.experiment import ExperimentConfig
from flaxformer_lite.config.fields import ConfigError, json_of
from flaxformer_lite.inference.run import Run
from flaxformer_lite.sweep.record import RESULTS_JSONL
from flaxformer_lite.sweep.report import METRICS
from flaxformer_lite.sweep.spec import RunSpec, Sweep, SweepError
from flaxformer_lite.training.flops import train_step_flops
from flaxformer_lite.training.logging import summary_writer_class
from flaxformer_lite.workdir import location, storage
from flaxformer_lite.workdir.folder import read_config

RESULT_FILE = "sweep_result.json"  # in a run's folder: the run is finished
SCORE_FILE = "score.txt"  # in a run's folder: the command that scores it


def read_json(path, shape: type):
    """A sweep's or run's JSON file, read as data of its one shape (else a SweepError
    naming the file and the fix)."""
    try:
        return json_of(path.read_text(), shape, str(path))
    except ConfigError as e:
        raise SweepError(f"{e}; restore it, or delete it to run that part again") from None


def read_row(line: str, path) -> dict[str, Any]:
    """One line of a JSON-lines file, a dict (else a SweepError naming the file)."""
    try:
        return json_of(line, dict, f"a line of {path}")
    except ConfigError as e:
        raise SweepError(f"{e}; restore the file") from None


def finished_row(workdir, spec: RunSpec, recorded: dict | None) -> dict[str, Any] | None:
    """The row of a run the sweep finished before (its ``sweep_result.json``, or its
    ``recorded`` row of results.jsonl), else None."""
    done = workdir / spec.folder / RESULT_FILE
    if done.is_file():
        return read_json(done, dict)
    if recorded is not None and recorded.get("status") == "ok":
        return recorded
    return None


def failed_row(spec: RunSpec, error: str) -> dict[str, Any]:
    return {"run": spec.folder, "overrides": spec.overrides, "seed": spec.seed,
            "status": "failed", "error": error}  # fmt: skip


def prepare(sweep: Sweep, spec: RunSpec, workdir) -> tuple[list[str], list[str] | None]:
    """The run's folder with its ``command.txt`` (train) and, where it is scored,
    ``score.txt`` (evaluate): what any launcher runs, and what a user repeats by hand."""
    folder = workdir / spec.folder
    folder.mkdir(parents=True, exist_ok=True)
    command = sweep.command(spec, workdir)
    storage.write_atomic(folder / "command.txt", shlex.join(command) + "\n")
    task = sweep.base().data.task
    score = sweep.score_command(spec, workdir) if sweep.split and task != "lm" else None
    if score:  # BLEU, or a generated task's accuracy
        storage.write_atomic(folder / SCORE_FILE, shlex.join(score) + "\n")
    return command, score


def collect(sweep: Sweep, spec: RunSpec, workdir, minutes: float | None) -> dict[str, Any]:
    """The row of a trained (and scored) run, from its folder, written to its
    ``sweep_result.json`` and the sweep's HParams; ``minutes``: this attempt's wall time
    (None: the launcher's job recorded it in ``sweep_minutes.json`` itself)."""
    folder = workdir / spec.folder
    config = read_config(folder)  # with the run's copies of its extensions
    scores = {}
    if sweep.split and config.data.task != "lm":
        scores = read_json(folder / f"{sweep.split}_scores.json", dict)
    attempts = folder / "sweep_minutes.json"  # wall time over interrupted attempts
    spent = read_json(attempts, list) if attempts.is_file() else []
    if minutes is not None:
        spent.append(minutes)
        storage.write_atomic(attempts, json.dumps(spent))
    row = {"run": spec.folder, "overrides": spec.overrides, "seed": spec.seed}
    row.update(measure(folder, config))
    row["wall_minutes"] = sum(spent)
    for key in ("bleu", "chrf", "accuracy", "accuracy_by_group"):
        if key in scores:
            row[f"{sweep.split}_{key}"] = scores[key]
    row["status"] = "ok"
    storage.write_atomic(folder / RESULT_FILE, json.dumps(row, indent=2))
    _hparams(workdir, sweep, spec, row)
    return row


def measure(folder: location.Path, config: ExperimentConfig) -> dict[str, Any]:
    """Size, cost and the best validation metrics of a finished run's folder."""
    params = Run(folder, config).abstract_params
    d, t = config.data, config.train
    text = (folder / "metrics.jsonl").read_text()
    records = [
        read_row(line, folder / "metrics.jsonl") for line in text.splitlines() if line.strip()
    ]
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


def recorded(workdir: location.Path) -> dict[str, dict[str, Any]]:
    """The finished rows of the sweep's ``results.jsonl``, by run folder: runs it need
    not repeat even where their folders are gone (an experiment keeps its results, not
    its run folders)."""
    path = workdir / RESULTS_JSONL
    if not path.is_file():
        return {}
    rows = [read_row(line, path) for line in path.read_text().splitlines() if line.strip()]
    return {r["run"]: r for r in rows if r.get("status") == "ok"}
