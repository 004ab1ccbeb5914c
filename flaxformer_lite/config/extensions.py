"""Extensions named by configuration and kept with the run (``model.extensions``).

An extension is a Python file (``lab/my_ext.py``, relative to the folder a command
runs from, or absolute) or an importable single-file module (``my_lab.ext``) that
registers names: score functions, sparse patterns, feed-forward blocks,
normalisations, position encodings (``register_score_fn``, ``register_pattern``,
``register_ffn``, ``register_norm``, ``register_positional``). Naming it in
``model.extensions`` (comma-separated) makes every command import it before it checks a
config, in every process: the training command and its workers, a sweep's runs and
their scoring, and every command that reads a run folder.

Training keeps a copy of each in the run folder (``extensions/``, with their SHA-256
in ``extensions/manifest.json``, as it keeps ``tokenizer.model``). A command that
reads the run imports the run's copies, not the lab folder's files, so the run still
translates, evaluates, averages, draws and exports after the lab folder moves or
changes; a note says when the original changed since. A resumed run whose extension
file changed is refused, naming the file and the fix.

Importing an extension runs its code, as importing any module does: only what the
config or the run's own folder names is imported. Registering a name twice is allowed
only with the same code (the same file content); a built-in name cannot be taken.
"""

from __future__ import annotations

import hashlib
import importlib
import importlib.util
import inspect
import json
import os
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

from etils import epath

from flaxformer_lite.config.fields import ConfigError
from flaxformer_lite.sparse import spec

_PACKAGE = Path(__file__).resolve().parents[1]  # flaxformer_lite/: its names are built in
FOLDER = "extensions"
MANIFEST = "manifest.json"

_LOADED: dict[str, str] = {}  # entry -> SHA-256 of the code imported for it
_MODULES: dict[str, Any] = {}  # SHA-256 -> the module imported from that code
_ORIGINS: dict[tuple[str, str], tuple[str, tuple]] = {}  # (kind, name) -> (where, code)
_LOADING: list[str] = []  # the entry being imported (names its registrations)


class ExtensionError(ConfigError):
    """An extension that cannot be found, imported or trusted; the message says why."""


def entries(text: str | list | tuple | None) -> list[str]:
    items = text if isinstance(text, list | tuple) else (text or "").split(",")
    return [str(e).strip() for e in items if str(e).strip()]


def _is_file(entry: str) -> bool:
    return entry.endswith(".py") or "/" in entry or os.sep in entry


def digest(path: Path) -> str:
    return hashlib.sha256(Path(path).read_bytes()).hexdigest()


def source(entry: str) -> Path:
    """The file an entry names (a path, or a module's file), or an ExtensionError."""
    if _is_file(entry):
        path = Path(entry).expanduser()
        if not path.is_file():
            raise ExtensionError(
                f"model.extensions: {entry!r} not found (a path is read from the folder the "
                f"command runs in, {os.getcwd()}); fix the path or drop it from model.extensions"
            )
        return path
    try:
        spec = importlib.util.find_spec(entry)
    except (ImportError, ValueError):
        spec = None
    if spec is None or not spec.origin or not spec.origin.endswith(".py"):
        raise ExtensionError(
            f"model.extensions: no module file for {entry!r}; name a .py file, or put the "
            "module's folder on PYTHONPATH"
        )
    return Path(spec.origin)


def _import(entry: str, path: Path, sha: str) -> None:
    if sha in _MODULES:  # the same code under another entry or path: imported once
        _LOADED[entry] = sha
        return
    name = f"flaxformer_extension_{Path(path).stem}_{sha[:12]}"
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    _LOADING.append(entry)
    try:
        spec.loader.exec_module(module)
    except ExtensionError:
        raise
    except Exception as e:
        del sys.modules[name]
        raise ExtensionError(
            f"model.extensions: importing {entry} failed: {type(e).__name__}: {e}"
        ) from e
    finally:
        _LOADING.pop()
    _MODULES[sha] = module
    _LOADED[entry] = sha


def load(text: str | None) -> None:
    """Import each entry of ``model.extensions`` not imported yet (an entry a run's copy
    already stands for stays that copy)."""
    for entry in entries(text):
        if entry not in _LOADED:
            path = source(entry)
            _import(entry, path, digest(path))


def claim(kind: str, name: str, factory: Any, taken: bool) -> bool:
    """Whether ``register_*`` should (re)register ``name``: yes if new; no (already there)
    if the same code registered it before (the same function of a file of the same
    content: a run's copy and its original); an error for a built-in name or other code."""
    try:
        file = inspect.getsourcefile(factory) or "?"
        code = (digest(Path(file)), factory.__qualname__, inspect.getsourcelines(factory)[1])
    except (TypeError, OSError):
        file, code = "?", ("?", id(factory))
    where = _LOADING[-1] if _LOADING else file
    before = _ORIGINS.get((kind, name))
    if (taken and before is None) or (before and Path(before[0]).is_relative_to(_PACKAGE)):
        raise ValueError(f"{kind} {name!r} is taken (built in); register yours under another name")
    if before is not None and before[1] != code:
        raise ValueError(
            f"{kind} {name!r} is already registered by other code ({before[0]}, then "
            f"{where}); rename one, or import one version"
        )
    _ORIGINS[(kind, name)] = (where, code)
    return before is None


spec.CLAIM[0] = claim  # sparse patterns: the same rule (sparse/ imports nothing above it)


def origin(kind: str, name: str) -> str | None:
    """The extension (its entry or file) that registered ``name``, or None (built in)."""
    found = _ORIGINS.get((kind, name))
    return found[0] if found else None


# The run folder's copies ----------------------------------------------------------------


def _folder(workdir) -> epath.Path:
    """A run folder as a path: local, or a bucket's (``gs://``, which ``pathlib`` cannot
    hold; :mod:`flaxformer_lite.workdir.location` checks such URLs before they come here)."""
    return workdir if isinstance(workdir, epath.Path) else epath.Path(os.fspath(workdir))


def _manifest(workdir) -> list[dict[str, str]]:
    path = _folder(workdir) / FOLDER / MANIFEST
    if not path.is_file():
        return []
    try:
        return json.loads(path.read_text())
    except json.JSONDecodeError as e:
        raise ExtensionError(f"{path} is not valid JSON ({e}); restore it") from e


def _write_atomic(path: epath.Path, data: bytes) -> None:
    if "://" in os.fspath(path):  # a bucket: one upload is whole or absent
        path.write_bytes(data)
        return
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_bytes(data)
    tmp.replace(path)


def verify(text: str | None, workdir) -> list[dict[str, str]]:
    """The records of ``model.extensions``' files against what ``workdir`` kept (a
    resumed run): each must be code the run was trained with, else an ExtensionError
    naming the file and the fix. Checked before the run's copies are read, so that a
    changed file is named as such (not as a name registered twice)."""
    workdir = _folder(workdir)
    kept = _manifest(workdir)
    by_sha = {r["sha256"]: r for r in kept}
    records = []
    for entry in entries(text):
        path = source(entry)
        sha = digest(path)
        if not kept:
            records.append({"entry": entry, "path": str(path), "sha256": sha})
        elif sha in by_sha:
            records.append({**by_sha[sha], "entry": entry})
        else:
            same = next((r for r in kept if r["entry"] == entry), None) or kept[0]
            raise ExtensionError(
                f"{entry} changed since --workdir={workdir} was trained with it (SHA-256 "
                f"{sha[:12]} now, the run kept {same['sha256'][:12]}); restore the run's code "
                f"(its copy: {workdir / FOLDER / same['copy']}), or train the changed code in "
                "a new --workdir"
            )
    return records


def keep(text: str | None, workdir) -> None:
    """Copy each extension into ``workdir/extensions`` with its SHA-256 (training, at the
    start). A resumed run checks that its extensions are the code it was trained with."""
    workdir = _folder(workdir)
    if _manifest(workdir):
        verify(text, workdir)
        return
    records, names = [], set()
    for r in verify(text, workdir):
        copy = f"{Path(r['path']).stem}.py"
        while copy in names:
            copy = f"{Path(r['path']).stem}_{len(names)}.py"
        names.add(copy)
        (workdir / FOLDER).mkdir(parents=True, exist_ok=True)
        _write_atomic(workdir / FOLDER / copy, Path(r["path"]).read_bytes())
        records.append({"entry": r["entry"], "copy": copy, "sha256": r["sha256"]})
    if records:
        _write_atomic(workdir / FOLDER / MANIFEST, json.dumps(records, indent=2).encode())


def load_kept(
    workdir, local_file: Callable[[epath.Path, bytes], str] | None = None
) -> list[dict[str, str]]:
    """Import the run's copies of its extensions (checked against their SHA-256) under
    the entries its config names; returns the manifest's records. ``local_file(copy,
    code)`` gives a local file of a copy in a bucket (Python imports files only)."""
    workdir = _folder(workdir)
    records = _manifest(workdir)
    for r in records:
        copy = workdir / FOLDER / r["copy"]
        if _LOADED.get(r["entry"]) == r["sha256"] and copy.is_file():
            continue  # imported before (a sweep reads many runs of one extension)
        code = copy.read_bytes() if copy.is_file() else None
        if code is None or hashlib.sha256(code).hexdigest() != r["sha256"]:
            raise ExtensionError(
                f"{copy} is missing or differs from what the run kept (SHA-256 "
                f"{r['sha256'][:12]}); restore it from {r['entry']} at the run's version"
            )
        if _LOADED.get(r["entry"], r["sha256"]) != r["sha256"]:
            raise ExtensionError(
                f"{r['entry']} was imported here in another version than --workdir={workdir} "
                f"kept (its copy: {copy}); run this command apart, or restore the file"
            )
        _warn_if_changed(r, copy)
        remote = "://" in os.fspath(copy)
        _import(r["entry"], Path(local_file(copy, code)) if remote else Path(copy), r["sha256"])
    return records


def _warn_if_changed(record: dict[str, str], copy) -> None:
    try:
        live = source(record["entry"])
    except ExtensionError:
        return  # moved or gone: the run's copy is all there is
    if digest(live) != record["sha256"]:
        print(
            f"note: {record['entry']} changed since the run kept it; using the run's copy ({copy})",
            file=sys.stderr,
        )
