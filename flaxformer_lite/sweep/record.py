"""An experiment's record: what its reports read is committed, its run folders are not.

An experiment runs one or more sweeps into ``experiments/<name>/runs/<sweep>/``
(git-ignored: logs, configs, checkpoints). Its record is two files beside its README:

* ``results.jsonl``: every run of every sweep, the sweep's own row (overrides, seed,
  size, speed, best validation, test scores) plus the ``sweep`` it belongs to;
* ``curves.jsonl``: per run, its learning curves in columns: ``validation`` (step,
  loss, nll, perplexity, accuracy and BLEU where measured, at every evaluation) and
  ``train`` (step and loss at every logged step), the last value where a resumed
  run logged a step twice;
* ``sweeps.json``: each sweep's spec (its ``sweep.json``: config file and overrides).

:func:`collect` writes them from the sweep folders after sweeps ran; :func:`restore`
writes each sweep's rows back into ``runs/<sweep>/results.jsonl``, from which the
sweep resumes without repeating the runs the record holds (their folders may be
gone); :func:`rows` and :func:`curves` are what reports read.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

RESULTS_JSONL = "results.jsonl"  # a sweep folder's rows; the record's, with "sweep"
CURVES = "curves.jsonl"
SPECS = "sweeps.json"
SPEC_FILE = "sweep.json"  # a sweep folder's spec (config file and overrides)
VALIDATION_KEYS = ("step", "loss", "nll", "perplexity", "accuracy", "bleu")
TRAIN_KEYS = ("step", "loss")


def _jsonl(path: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def _write_jsonl(path: Path, rows: list[dict[str, Any]]) -> None:
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text("".join(json.dumps(r) + "\n" for r in rows))
    tmp.replace(path)


def _columns(records: list[dict], keys: tuple[str, ...]) -> dict[str, list]:
    """Records -> columns of ``keys`` (a key no record has is left out), one entry per
    step: the last record of a step wins (a resumed run repeats steps)."""
    by_step = {int(r["step"]): r for r in records}
    ordered = [by_step[s] for s in sorted(by_step)]
    present = [k for k in keys if any(k in r for r in ordered)]
    return {k: [r.get(k) for r in ordered] for k in present}


def _sweeps(runs: Path) -> list[Path]:
    return sorted(p.parent for p in runs.glob(f"*/{RESULTS_JSONL}"))


def collect(runs: Path, record: Path) -> None:
    """Write ``record/results.jsonl`` and ``record/curves.jsonl`` from the sweep
    folders under ``runs``. A run whose folder is gone keeps the curve the record
    already had."""
    old = {(c["sweep"], c["run"]): c for c in curves(record)} if (record / CURVES).exists() else {}
    rows, lines, specs = [], [], {}
    for sweep in _sweeps(runs):
        specs[sweep.name] = json.loads((sweep / SPEC_FILE).read_text())
        for row in _jsonl(sweep / RESULTS_JSONL):
            rows.append({"sweep": sweep.name, **row})
            metrics = sweep / row["run"] / "metrics.jsonl"
            if metrics.is_file():
                records = _jsonl(metrics)
                lines.append(
                    {
                        "sweep": sweep.name,
                        "run": row["run"],
                        "validation": _columns(
                            [r for r in records if r.get("split") == "validation"],
                            VALIDATION_KEYS,
                        ),
                        "train": _columns(
                            [r for r in records if r.get("split") == "train"], TRAIN_KEYS
                        ),
                    }
                )
            elif (sweep.name, row["run"]) in old:
                lines.append(old[(sweep.name, row["run"])])
    record.mkdir(parents=True, exist_ok=True)
    _write_jsonl(record / RESULTS_JSONL, rows)
    _write_jsonl(record / CURVES, lines)
    (record / SPECS).write_text(json.dumps(specs, indent=2) + "\n")


def restore(record: Path, runs: Path) -> None:
    """Write each sweep of the record back as ``runs/<sweep>/{sweep.json,results.jsonl}``
    where the sweep folder has no results yet, so that the sweep, run again with the
    same flags, skips the runs the record holds."""
    specs = json.loads((record / SPECS).read_text())
    by_sweep: dict[str, list[dict]] = {}
    for row in rows(record):
        sweep = row.pop("sweep")
        by_sweep.setdefault(sweep, []).append(row)
    for sweep, sweep_rows in by_sweep.items():
        folder = runs / sweep
        if (folder / RESULTS_JSONL).exists():
            continue
        folder.mkdir(parents=True, exist_ok=True)
        if not (folder / SPEC_FILE).exists():
            (folder / SPEC_FILE).write_text(json.dumps(specs[sweep], indent=2))
        _write_jsonl(folder / RESULTS_JSONL, sweep_rows)


def rows(record: Path) -> list[dict[str, Any]]:
    """The record's runs: each sweep row with its ``sweep``."""
    return _jsonl(record / RESULTS_JSONL)


def curves(record: Path) -> list[dict[str, Any]]:
    """The record's learning curves: ``{"sweep", "run", "validation": {...},
    "train": {...}}`` per run, columns by key."""
    return _jsonl(record / CURVES)
