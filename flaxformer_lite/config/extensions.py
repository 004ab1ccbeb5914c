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

Importing an extension runs its code, as importing any module does: a run's copies
are imported only for their author on this machine (the original file at its recorded
path, unchanged), for code the command's config names, or on the user's word
(``--trust_extensions``, remembered by SHA-256: :mod:`~flaxformer_lite.config.trust`).
Registering a name twice is allowed only with the same code (the same file content); a
built-in name cannot be taken.

A name the config uses that a user's module registered by being imported (a config
file that does ``import my_ext``) is kept as if ``model.extensions`` named its file
(:func:`implicit`); a name registered where no file can be kept (``__main__``, a
notebook cell) is refused at training's start.
"""

from __future__ import annotations

import hashlib
import importlib
import importlib.util
import inspect
import json
import os
import re
import sys
import tokenize
from collections.abc import Callable
from pathlib import Path
from typing import Any

from etils import epath

from flaxformer_lite.config import trust
from flaxformer_lite.config.fields import ConfigError, json_of
from flaxformer_lite.sparse.grammar import spec

_PACKAGE = Path(__file__).resolve().parents[1]  # flaxformer_lite/: its names are built in
FOLDER = "extensions"
MANIFEST = "manifest.json"

_LOADED: dict[str, str] = {}  # entry -> SHA-256 of the code imported for it
_MODULES: dict[str, Any] = {}  # SHA-256 -> the module imported from that code
# (kind, name) -> (where: the entry or file, code, the factory's module)
_ORIGINS: dict[tuple[str, str], tuple[str, tuple, str]] = {}
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
    except (TypeError, OSError, SyntaxError, tokenize.TokenError):  # no file, or not its source
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
    _ORIGINS[(kind, name)] = (where, code, getattr(factory, "__module__", "?") or "?")
    return before is None


spec.CLAIM[0] = claim  # sparse patterns: the same rule (sparse/ imports nothing above it)


def origin(kind: str, name: str) -> str | None:
    """The extension (its entry or file) that registered ``name``, or None (built in)."""
    found = _ORIGINS.get((kind, name))
    return found[0] if found else None


# Names the config uses, and the files that registered them -----------------------------

# model fields whose values are registered names, with the registries' kinds
FIELD_KINDS = (("score_fn", "score function"), ("attention", "attention layer"),
               ("ffn", "feed-forward block"), ("norm", "normalisation"),
               ("positional", "position encoding"))  # fmt: skip


def used_names(model) -> list[tuple[str, str, str]]:
    """(kind, name, field) of each registered name a model config uses."""
    used = [(kind, getattr(model, field), field) for field, kind in FIELD_KINDS]
    for atom in re.split(r"[|&+;]", getattr(model, "attention_pattern", "") or ""):
        name = atom.partition(":")[0].strip()
        if name:
            used.append(("sparse pattern", name, "attention_pattern"))
    return used


def implicit(model) -> list[tuple[str, str]]:
    """(file, what it registers that ``model`` uses) of each user file whose names the
    config uses without ``model.extensions`` naming it: a module a config file imported
    itself. Training keeps them as if named. A name registered where no file can be
    kept (``__main__``, a notebook cell) is an ExtensionError naming the fix."""
    named = set(entries(getattr(model, "extensions", "")))
    found: dict[str, list[str]] = {}
    for kind, name, field in used_names(model):
        record = _ORIGINS.get((kind, name))
        if record is None or record[0] in named:
            continue  # built in, or the config names its file
        where, _, module = record
        file = where if os.path.isfile(where) else _file_of(where)
        if module == "__main__" or file is None:
            main = "__main__ (the script or notebook cell that ran)"
            place = main if module == "__main__" else where
            raise ExtensionError(
                f"model.{field}={getattr(model, field)!r}: {kind} {name!r} was registered in "
                f"{place}, which a run cannot keep; put it in a file and name that file in "
                "model.extensions (--config.model.extensions=lab/my_ext.py)"
            )
        path = os.path.abspath(file)
        if not Path(path).is_relative_to(_PACKAGE):
            found.setdefault(_shown(path), []).append(f"{kind} {name!r}")
            # imported already, as a module of its own: named from now on, not run again
            _LOADED.setdefault(_shown(path), digest(Path(path)))
    return [(file, ", ".join(names)) for file, names in found.items()]


def _file_of(entry: str) -> str | None:
    """The file of an entry imported through model.extensions (a module's name), if any."""
    try:
        return str(source(entry))
    except ExtensionError:
        return None


def _shown(path: str) -> str:
    """A path relative to the working folder where it lies below it, else absolute."""
    relative = os.path.relpath(path)
    return path if relative.startswith("..") else relative


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
        records = json_of(path.read_text(), list, str(path))
    except ConfigError as e:
        raise ExtensionError(f"{e}; restore it") from None
    for r in records:
        fields = ("entry", "copy", "sha256")
        if not isinstance(r, dict) or not all(isinstance(r.get(k), str) for k in fields):
            raise ExtensionError(
                f"{path} holds a record that is not {{entry, copy, sha256}} strings ({r!r:.80}); "
                "restore it"
            )
    return records


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
            records.append({"entry": entry, "path": str(path.resolve()), "sha256": sha})
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
        # "source": where the author's file is, so that the author goes on without a flag
        records.append({"entry": r["entry"], "copy": copy, "sha256": r["sha256"],
                        "source": r["path"]})  # fmt: skip
    if records:
        _write_atomic(workdir / FOLDER / MANIFEST, json.dumps(records, indent=2).encode())


def load_kept(
    workdir, local_file: Callable[[epath.Path, bytes], str] | None = None
) -> list[dict[str, str]]:
    """Import the run's copies of its extensions (checked against their SHA-256) under
    the entries its config names; returns the manifest's records. A copy is imported
    only where trusted (the module's docstring); otherwise nothing is imported and one
    ExtensionError names each file, its SHA-256, what it would register and the flag.
    ``local_file(copy, code)`` gives a local file of a copy in a bucket (Python imports
    files only)."""
    workdir = _folder(workdir)
    records = _manifest(workdir)
    pending, strangers = [], []
    for r in records:
        copy = _copy_path(workdir, r)
        if _LOADED.get(r["entry"]) == r["sha256"]:
            continue  # this code is imported already (the command's own config named it)
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
        if not (_authors(r) or r["sha256"] in trust.trusted() or trust.trusting_all()):
            strangers.append((r, copy, code))
        pending.append((r, copy, code))
    if strangers:
        raise ExtensionError(
            f"--workdir={workdir} carries code that runs when the run is read, not files of "
            "this machine: "
            + "; ".join(
                f"{copy} (SHA-256 {r['sha256']}, registers {', '.join(trust.declared(code))})"
                for r, copy, code in strangers
            )
            + ". Read it, then rerun with --trust_extensions (remembered for this code in "
            f"{trust.record_path()})"
        )
    if trust.trusting_all():
        trust.remember([r for r, _, _ in pending if not _authors(r)], workdir)
    for r, copy, code in pending:
        _warn_if_changed(r, copy)
        remote = "://" in os.fspath(copy)
        _import(r["entry"], Path(local_file(copy, code)) if remote else Path(copy), r["sha256"])
    return records


def _copy_path(workdir: epath.Path, record: dict) -> epath.Path:
    """The file a manifest record names, which must be a plain file directly in the
    run's ``extensions/`` (a name with a folder, ``..``, an absolute path or a link that
    leads out of it is refused: a manifest is data, it never points elsewhere)."""
    name = record.get("copy")
    folder = workdir / FOLDER
    bad = (
        not isinstance(name, str)
        or not name.endswith(".py")
        or name != os.path.basename(name)
        or name in (".", "..")
        or "\0" in name
    )
    copy = None if bad else folder / name
    if copy is not None and "://" not in os.fspath(copy) and os.path.islink(copy):
        bad = True
    if bad:
        raise ExtensionError(
            f"{folder / MANIFEST} names the copy {name!r}, not a file of that folder; the run's "
            "folder was altered: restore it, or train again"
        )
    return copy


def _authors(record: dict) -> bool:
    """Whether the original of a copy is on this machine, unchanged, where the run
    recorded it (or, for a run kept before the path was recorded, where its entry leads
    from here): the run's own author reading their run."""
    where = record.get("source")
    try:
        path = Path(where) if where else source(record["entry"])
        return path.is_file() and digest(path) == record["sha256"]
    except (ExtensionError, OSError):
        return False


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
