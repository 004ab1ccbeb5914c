"""Sweeps: a cross product of config overrides, times seeds, each an ordinary run.

  python -m flaxformer_lite.main sweep --config=configs/ende_small.py:debug \\
      --sweep=model.num_heads=1,2 --sweep=model.positional=sinusoidal,learned \\
      --seeds=3 --workdir=runs/sweeps/heads [--parallel=2] [--config.train.num_steps=20]

Every point of the grid and every seed is a run in its own folder,
``<workdir>/<point>/seed<N>``, started as the command in its ``command.txt`` (the
``train`` command with the base overrides, the point's overrides and
``train.seed``), so any run can be repeated, inspected, translated or averaged
by itself. Translation runs are then scored with ``main evaluate`` on
``--split`` (BLEU and chrF; ``--limit`` sentences, 0 = all).

Re-running the same command resumes: a run whose ``sweep_result.json`` exists
is skipped, an interrupted one is started again with the same command, which
resumes from its newest checkpoint. SIGTERM (a scheduler's preemption) or
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
import dataclasses
import itertools
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
import typing
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import jax
from tensorboardX import SummaryWriter

from flaxformer_lite.config.experiment import SECTIONS, ExperimentConfig, load_config
from flaxformer_lite.config.fields import ConfigError, type_name
from flaxformer_lite.config.model import ModelConfig
from flaxformer_lite.data.builders import LOCAL_BUILDERS, build_local_dataset
from flaxformer_lite.inference.run import Run
from flaxformer_lite.training.flops import train_step_flops

SPEC_FILE = "sweep.json"
RESULT_FILE = "sweep_result.json"  # in a run's folder: the run is finished
RESULTS_JSONL = "results.jsonl"
RESULTS_MD = "results.md"
_ALL_SECTIONS = {"model": ModelConfig, **SECTIONS}


class SweepError(ValueError):
    """A sweep spec or folder is unusable; the message names the value and the fix."""


# The spec -----------------------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class Axis:
    """One swept field (``model.num_heads``) and its values, typed as the field. Fields
    joined by ``+`` (``model.num_encoder_layers+model.num_decoder_layers``) take the
    same value together."""

    field: str
    values: tuple

    @property
    def fields(self) -> tuple[str, ...]:
        return tuple(self.field.split("+"))

    @property
    def name(self) -> str:
        return "+".join(f.partition(".")[2] for f in self.fields)


def _field(key: str) -> dataclasses.Field:
    section, _, name = key.partition(".")
    kind = _ALL_SECTIONS.get(section)
    fields = {f.name: f for f in dataclasses.fields(kind)} if kind else {}
    if name not in fields:
        raise SweepError(
            f"--sweep: unknown config field {key!r}; fields look like model.num_heads "
            "(python -m flaxformer_lite.main fields lists them)"
        )
    return fields[name]


def _kind(key: str) -> Any:
    """The value type of a field, ``X | None`` read as X (None cannot be swept)."""
    field = _field(key)
    if field.metadata.get("parse") is not None:
        return str  # held as text in the ml_collections layer
    section = _ALL_SECTIONS[key.partition(".")[0]]
    kind = typing.get_type_hints(section)[field.name]
    args = [k for k in typing.get_args(kind) if k is not type(None)]
    return args[0] if len(args) == 1 else kind


def coerce(key: str, raw: Any) -> Any:
    """``raw`` (text from the command line, or a JSON value) as a value of field ``key``."""
    kind = _kind(key)
    bad = SweepError(f"--sweep {key}: {raw!r} is not a {type_name(kind)}")
    if isinstance(raw, str):
        text = raw.strip()
        if kind is str:
            return text
        if kind is bool:
            if text.lower() in ("true", "1", "yes"):
                return True
            if text.lower() in ("false", "0", "no"):
                return False
            raise bad
        try:
            return kind(text) if kind is not int else int(text, 10)
        except (TypeError, ValueError):
            raise bad from None
    if kind is float and isinstance(raw, int) and not isinstance(raw, bool):
        return float(raw)
    if kind in (int, float) and isinstance(raw, bool):
        raise bad
    if not isinstance(raw, kind):
        raise bad
    return raw


def parse_axis(spec: str) -> Axis:
    """``section.field=v1,v2`` (or ``section.field=[JSON list]``) as an :class:`Axis`;
    ``section.a+section.b=v1,v2`` sets both fields to each value."""
    key, sep, text = spec.partition("=")
    key = "+".join(part.strip() for part in key.split("+"))
    if not sep or not key:
        raise SweepError(
            f"--sweep {spec!r} has no '='; write it as section.field=value1,value2, "
            "e.g. --sweep=model.num_heads=1,4,8"
        )
    fields = key.split("+")
    for field in fields:
        _field(field)
    text = text.strip()
    if text.startswith("["):
        try:
            raw = json.loads(text)
        except json.JSONDecodeError as e:
            raise SweepError(f"--sweep {key}: {text!r} is not a JSON list ({e.msg})") from None
    else:
        raw = text.split(",") if text else []
    if not raw:
        raise SweepError(f"--sweep {key}: the list of values is empty; give at least one")
    if any(isinstance(v, str) and not v.strip() for v in raw):
        raise SweepError(f"--sweep {key}={text}: an empty value; separate values by single commas")
    if any(v is None for v in raw):
        raise SweepError(
            f"--sweep {key}: None cannot be swept from the command line; leave it "
            "out of the list and set it in the config file instead"
        )
    values = tuple(coerce(fields[0], v) for v in raw)
    for field in fields[1:]:  # linked fields take the same values
        if _kind(field) is not _kind(fields[0]):
            raise SweepError(
                f"--sweep {key}: linked fields must have one type; {fields[0]} is a "
                f"{type_name(_kind(fields[0]))}, {field} a {type_name(_kind(field))}"
            )
    if len(set(values)) != len(values):
        raise SweepError(f"--sweep {key}={text}: a value appears twice")
    return Axis(key, values)


def _format(value: Any) -> str:
    """A value as the command line writes it (``--config.x=<this>``)."""
    return str(value)


@dataclasses.dataclass(frozen=True)
class RunSpec:
    """One run of a sweep: a point of the grid and a seed."""

    point: tuple[tuple[str, Any], ...]  # ((field, value), ...) in axis order
    seed: int
    folder: str  # relative to the sweep folder: <point>/seed<N>

    @property
    def overrides(self) -> dict[str, Any]:
        return dict(self.point)


@dataclasses.dataclass(frozen=True)
class Sweep:
    """A sweep over ``axes`` x ``seeds`` of the config ``config`` (``path[:arg]``)
    with the base ``overrides`` ({"train.num_steps": 20}) applied to every run."""

    config: str
    axes: tuple[Axis, ...] = ()
    seeds: int = 3
    overrides: dict[str, Any] = dataclasses.field(default_factory=dict)
    split: str = "test"  # scored with BLEU after training (translation); '' = none
    limit: int = 0  # sentences of that split (0 = all)
    decode_flags: tuple[str, ...] = ()  # extra evaluate flags, e.g. ("--beam_size=1",)

    def __post_init__(self):
        if self.seeds < 1:
            raise SweepError(f"--seeds={self.seeds} must be >= 1")
        fields = [f for a in self.axes for f in a.fields]
        twice = sorted({f for f in fields if fields.count(f) > 1})
        if twice:
            raise SweepError(f"--sweep names {twice} more than once; give each field one list")
        both = sorted(set(fields) & set(self.overrides))
        if both:
            raise SweepError(
                f"{both} is both swept and set by --config.{both[0]}=...; drop one of the two"
            )
        if "train.seed" in fields:
            raise SweepError("train.seed is not swept with --sweep; use --seeds=N")

    @property
    def config_path(self) -> str:
        return self.config.partition(":")[0]

    @property
    def config_arg(self) -> str | None:
        return self.config.partition(":")[2] or None

    def base(self):
        """The ml_collections config of every run before the point and the seed."""
        try:
            return load_config(self.config_path, self.config_arg, self.overrides)
        except ConfigError as e:
            raise SweepError(f"the base config: {e}") from None

    def runs(self) -> list[RunSpec]:
        first_seed = int(self.base().train.seed)
        names = [a.name for a in self.axes]
        out = []
        for values in itertools.product(*(a.values for a in self.axes)):
            point = tuple((f, v) for a, v in zip(self.axes, values, strict=True) for f in a.fields)
            labels = [
                f"{a.field if names.count(a.name) > 1 else a.name}={_format(v)}"
                for a, v in zip(self.axes, values, strict=True)
            ]
            name = ",".join(labels).replace("/", "_") or "base"
            for i in range(self.seeds):
                seed = first_seed + i
                out.append(RunSpec(point, seed, f"{name}/seed{seed}"))
        return out

    def validate(self) -> list[RunSpec]:
        """Every run's config checked (types, ranges, cross-field rules) before any runs."""
        runs = self.runs()
        for spec in runs[:: self.seeds]:
            try:
                load_config(self.config_path, self.config_arg, {**self.overrides, **spec.overrides})
            except ConfigError as e:
                shown = ", ".join(f"{k}={v!r}" for k, v in spec.point)
                raise SweepError(f"--sweep point {shown}: {e}") from None
        return runs

    def command(self, spec: RunSpec, workdir: Path) -> list[str]:
        """The ``train`` command of one run (what its ``command.txt`` says)."""
        values = {**self.overrides, **spec.overrides, "train.seed": spec.seed}
        return [
            sys.executable,
            "-m",
            "flaxformer_lite.main",
            f"--config={self.config}",
            *(f"--config.{k}={_format(v)}" for k, v in values.items()),
            f"--workdir={workdir / spec.folder}",
        ]

    def to_json(self) -> dict[str, Any]:
        return {
            "config": self.config,
            "overrides": self.overrides,
            "axes": {a.field: list(a.values) for a in self.axes},
            "seeds": self.seeds,
            "split": self.split,
            "limit": self.limit,
        }


# Running ------------------------------------------------------------------------------
def _claim_folder(sweep: Sweep, workdir: Path) -> None:
    spec_file = workdir / SPEC_FILE
    if spec_file.is_file():
        old = json.loads(spec_file.read_text())
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
    _write_atomic(spec_file, json.dumps(sweep.to_json(), indent=2))


def _write_atomic(path: Path, text: str) -> None:
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(text)
    os.replace(tmp, path)


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


def _run_logged(command: list[str], log: Path, env: dict[str, str] | None) -> int:
    with open(log, "a") as out:
        out.write(f"$ {shlex.join(command)}\n")
        out.flush()
        return _CHILDREN.run(command, out, env)


def _tail(log: Path, lines: int = 3) -> str:
    text = log.read_text(errors="replace").strip().splitlines() if log.is_file() else []
    return " | ".join(t.strip() for t in text[-lines:])


def execute(
    sweep: Sweep, spec: RunSpec, workdir: Path, env: dict[str, str] | None = None
) -> dict[str, Any]:
    """Train (or resume) one run, score it, and return its row; a finished run's row is
    read back from its ``sweep_result.json``."""
    folder = workdir / spec.folder
    done = folder / RESULT_FILE
    if done.is_file():
        return json.loads(done.read_text())
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
    config = ExperimentConfig.from_config(json.loads((folder / "config.json").read_text()))
    scores = {}
    if sweep.split and config.data.task == "translation":
        evaluate = [
            sys.executable,
            "-m",
            "flaxformer_lite.main",
            "evaluate",
            f"--workdir={folder}",
            f"--split={sweep.split}",
            f"--limit={sweep.limit}",
            *sweep.decode_flags,
        ]
        if _run_logged(evaluate, folder / "evaluate.log", env):
            return {**row, "status": "failed", "error": _tail(folder / "evaluate.log")}
        scores = json.loads((folder / f"{sweep.split}_scores.json").read_text())
    minutes = (time.perf_counter() - start) / 60
    attempts = folder / "sweep_minutes.json"  # wall time over interrupted attempts
    earlier = json.loads(attempts.read_text()) if attempts.is_file() else []
    attempts.write_text(json.dumps([*earlier, minutes]))
    row.update(measure(folder, config))
    row["wall_minutes"] = sum(earlier) + minutes
    if scores:
        row[f"{sweep.split}_bleu"] = scores["bleu"]
        row[f"{sweep.split}_chrf"] = scores["chrf"]
    row["status"] = "ok"
    _write_atomic(done, json.dumps(row, indent=2))
    _hparams(workdir, sweep, spec, row)
    return row


def measure(folder: Path, config: ExperimentConfig) -> dict[str, Any]:
    """Size, cost and the best validation metrics of a finished run's folder."""
    params = Run(folder, config).abstract_params
    d, t = config.data, config.train
    records = [json.loads(line) for line in open(folder / "metrics.jsonl")]
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


def _hparams(workdir: Path, sweep: Sweep, spec: RunSpec, row: dict[str, Any]) -> None:
    """One TensorBoard HParams entry per finished run (written once, when it finishes)."""
    hparams = {a.name: _tb_value(spec.overrides[a.fields[0]]) for a in sweep.axes}
    hparams["seed"] = spec.seed
    metrics = {
        f"hparam/{k}": float(v)
        for k, v in row.items()
        if k in METRICS and isinstance(v, int | float) and v is not None
    }
    with SummaryWriter(str(workdir / "tensorboard")) as writer:
        writer.add_hparams(hparams, metrics, name=spec.folder)


def _tb_value(value: Any) -> Any:
    return value if isinstance(value, int | float | str | bool) else str(value)


# Reports ------------------------------------------------------------------------------
# The columns of results.md: row key, heading, format.
METRICS = {
    "parameters": ("params", "{:,.0f}"),
    "flops_per_step": ("GFLOP/step", "{:.3g}"),
    "tokens_per_sec": ("tokens/s", "{:,.0f}"),
    "wall_minutes": ("wall min", "{:.2f}"),
    "steps": ("steps", "{:.0f}"),
    "valid_nll": ("valid nll", "{:.3f}"),
    "valid_perplexity": ("valid ppl", "{:.2f}"),
    "valid_accuracy": ("valid acc", "{:.4f}"),
    "test_bleu": ("test BLEU", "{:.2f}"),
    "test_chrf": ("test chrF", "{:.2f}"),
}
_SCALE = {"flops_per_step": 1e-9}
_NOISY = {"valid_nll", "valid_perplexity", "valid_accuracy", "test_bleu", "test_chrf"}


def mean_std(values: Sequence[float]) -> tuple[float, float | None]:
    """Mean and the sample standard deviation (None for a single value)."""
    mean = statistics.fmean(values)
    return mean, (statistics.stdev(values) if len(values) > 1 else None)


def summarize(sweep: Sweep, rows: list[dict[str, Any]]) -> str:
    """``results.md``: one line per point, mean ± std over its finished seeds."""
    by_point: dict[str, list[dict]] = {}
    for row in rows:
        by_point.setdefault(row["run"].rpartition("/")[0], []).append(row)
    split_keys = {f"{sweep.split}_bleu": "BLEU", f"{sweep.split}_chrf": "chrF"}
    columns = [k for k in METRICS if any(k in r for r in rows)]
    columns += [k for k in split_keys if k not in columns and any(k in r for r in rows)]
    head = [
        "point",
        "seeds",
        *(METRICS.get(k, (f"{sweep.split} {split_keys.get(k)}",))[0] for k in columns),
    ]
    lines = [
        f"# Sweep of `{sweep.config}`",
        "",
        f"Base overrides: {json.dumps(sweep.overrides) if sweep.overrides else 'none'}; "
        f"{sweep.seeds} seed(s) per point; mean ± sample std over the finished seeds.",
        "",
        "| " + " | ".join(head) + " |",
        "|" + "---|" * len(head),
    ]
    for point, group in by_point.items():
        ok = [r for r in group if r.get("status") == "ok"]
        cells = [point, f"{len(ok)}/{len(group)}"]
        for key in columns:
            values = [r[key] * _SCALE.get(key, 1) for r in ok if r.get(key) is not None]
            fmt = METRICS.get(key, ("", "{:.2f}"))[1]
            if not values:
                cells.append("—")
                continue
            mean, std = mean_std(values)
            spread = f" ± {fmt.format(std)}" if std is not None and (std or key in _NOISY) else ""
            cells.append(fmt.format(mean) + spread)
        lines.append("| " + " | ".join(cells) + " |")
    failed = [r for r in rows if r.get("status") != "ok"]
    for r in failed:
        lines.append(f"\nfailed: `{r['run']}`: {r.get('error', '')}")
    return "\n".join(lines) + "\n"


def run_sweep(
    sweep: Sweep, workdir: str | Path, parallel: int = 1, env: dict[str, str] | None = None
) -> list[dict[str, Any]]:
    """Run (or resume) every run of ``sweep`` in ``workdir``; write the reports; return
    the rows in grid order. Raises SweepError before anything runs if the spec is bad.

    ``env``: the runs' environment (default: this process's).
    """
    if parallel < 1:
        raise SweepError(f"--parallel={parallel} must be >= 1")
    workdir = Path(workdir)
    runs = sweep.validate()
    _claim_folder(sweep, workdir)
    data = sweep.base().data
    if parallel > 1 and data.dataset in LOCAL_BUILDERS:
        build_local_dataset(data.dataset, data.data_dir)  # once, not by racing runs
    finished = sum((workdir / r.folder / RESULT_FILE).is_file() for r in runs)
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
        futures = {pool.submit(execute, sweep, r, workdir, env): r for r in runs}
        for future in concurrent.futures.as_completed(futures):
            spec = futures[future]
            row = future.result()
            rows[spec.folder] = row
            print(f"[{len(rows)}/{len(runs)}] {_line(row)}", flush=True)
    except KeyboardInterrupt:
        pool.shutdown(wait=False, cancel_futures=True)  # no queued run starts
        _CHILDREN.stop()  # the running ones end (and resume from checkpoints later)
        pool.shutdown(wait=True)
        finished = sum((workdir / r.folder / RESULT_FILE).is_file() for r in runs)
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
    _write_atomic(workdir / RESULTS_JSONL, "".join(json.dumps(r) + "\n" for r in ordered))
    _write_atomic(workdir / RESULTS_MD, summarize(sweep, ordered))
    return ordered


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


__all__ = [
    "Axis",
    "RunSpec",
    "Sweep",
    "SweepError",
    "SweepInterrupted",
    "coerce",
    "mean_std",
    "parse_axis",
    "run_sweep",
    "summarize",
]
