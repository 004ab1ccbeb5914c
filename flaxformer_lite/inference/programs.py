"""Compiled searches kept on disk, so that a new process runs them without tracing.

XLA's persistent compilation cache (``--compilation_cache``) saves a process the
compiling of a search, not the tracing: jax still traces the Python function and
lowers it to find the cache entry. For a translation's three searches that is ~1.5 s of
the 3 s a warm greedy translation of the demo's test split takes, so a fresh
``evaluate`` or a sweep's scoring ran 1.5x its warm time even with every program in
the cache. :func:`compiled` keeps each compiled search as a serialized executable
(``jax.experimental.serialize_executable``) in ``searches/`` of the compilation cache
folder, and a later process loads it directly.

The program is found by a key computed without tracing, so the key holds everything
the program depends on: the function's name; each argument's tree, shapes, dtypes and
placement; the static arguments' values (the model's full config); the source of
this package, of the user's modules and of every registered extension; the versions
of jax, jaxlib, flax and numpy; jax's tracing options; ``XLA_FLAGS``; and the CPU (its
model and instruction sets: a program compiled for another CPU may not run). Changing
any of them gives another key, so a stored program is only ever the same one; an entry
that fails to load is compiled again and replaced. A stored program is compiled by XLA
in the storing process, never taken from jax's own cache (an executable loaded from
there serializes without its kernels' code); one that fails to run anyway gives way to
``jax.jit``. Without a compilation cache folder, or with
``FLAXFORMER_LITE_STORED_SEARCHES=0``, nothing is stored, and programs are kept in
memory for the process only.

Arguments are split as the searches declare them: arrays are traced, anything else
(the model, sizes, options) is static, and a None is either, as the compiled program's
arguments say (jit traces an undeclared None). A function whose program expects other
arguments than either split gives (an unusual signature) is left to ``jax.jit``.
"""

from __future__ import annotations

import hashlib
import importlib.metadata
import json
import os
import sys
import threading
import time
import warnings
from pathlib import Path
from typing import Any

import jax

from flaxformer_lite.config import extensions
from flaxformer_lite.workdir import location, storage

FOLDER = "searches"  # inside the compilation cache folder
SWITCH = "FLAXFORMER_LITE_STORED_SEARCHES"  # "0": keep programs in memory only
LIMIT = 1 << 30  # bytes: the least recently used entries go past it
_PACKAGE = Path(__file__).resolve().parents[1]
_MEMORY: dict[str, Any] = {}  # key -> compiled program, for this process
_LEFT: set[str] = set()  # keys whose programs jax.jit keeps (not compiled again here)
_LOCK = threading.Lock()
_FILES: dict[str, tuple[int, int, str]] = {}  # path -> (mtime_ns, size, sha256)
_DIGEST: list = []  # [modules imported, when, the files' digest]
MEMORY_SIZE = 64  # programs kept in memory (the oldest go first)
# Programs this process compiled (and stored) and loaded from the folder.
STATS = {"compiled": 0, "loaded": 0}


def clear() -> None:
    """Forget the programs kept in memory (as ``jax.clear_caches`` does jit's)."""
    with _LOCK:
        _MEMORY.clear()
        _LEFT.clear()


def _is_array(x) -> bool:
    return isinstance(x, jax.Array) or (hasattr(x, "shape") and hasattr(x, "dtype"))


def split(args: tuple, kwargs: dict, empty: bool = False) -> tuple[tuple, dict, list]:
    """(traced positional arguments, traced keyword arguments, the static values):
    arrays and trees of arrays are traced, other values static; ``empty``: a value
    without leaves (None) is traced too (jit traces an undeclared None argument)."""

    def traced(x) -> bool:
        leaves = jax.tree.leaves(x)
        return (bool(leaves) or empty) and all(_is_array(v) for v in leaves)

    dyn_args = tuple(a for a in args if traced(a))
    dyn_kwargs = {k: v for k, v in kwargs.items() if traced(v)}
    statics = [("arg", i, a) for i, a in enumerate(args) if not traced(a)]
    statics += [("kw", k, v) for k, v in sorted(kwargs.items()) if not traced(v)]
    return dyn_args, dyn_kwargs, statics


def _file_digest(path: str) -> str:
    st = os.stat(path)
    seen = _FILES.get(path)
    if seen and seen[:2] == (st.st_mtime_ns, st.st_size):
        return seen[2]
    sha = hashlib.sha256(Path(path).read_bytes()).hexdigest()
    _FILES[path] = (st.st_mtime_ns, st.st_size, sha)
    return sha


def _installed(path: str) -> bool:
    """A file of the Python installation or an installed package (versioned below)."""
    roots = {sys.prefix, sys.base_prefix, sys.exec_prefix}
    return "site-packages" in path or any(path.startswith(r + os.sep) for r in roots)


def code_digest() -> str:
    """The source this process traces from: the package, the user's own modules (not
    installed ones) and the extensions' registrations; the libraries' versions. The
    files' part is read again when a module was imported or a second has passed."""
    origins = repr(sorted(extensions._ORIGINS.items(), key=repr))
    now, count = time.monotonic(), len(sys.modules)
    if _DIGEST and _DIGEST[0] == count and now - _DIGEST[1] < 1.0:
        return hashlib.sha256((_DIGEST[2] + origins).encode()).hexdigest()
    files = {str(p) for p in _PACKAGE.rglob("*.py")}
    for module in list(sys.modules.values()):
        file = getattr(module, "__file__", None)
        if file and file.endswith(".py") and not _installed(file) and os.path.isfile(file):
            files.add(os.path.abspath(file))
    h = hashlib.sha256()
    for path in sorted(files):
        h.update(f"{path}:{_file_digest(path)}\n".encode())
    for lib in ("jax", "jaxlib", "flax", "numpy"):
        try:
            h.update(f"{lib}={importlib.metadata.version(lib)}\n".encode())
        except importlib.metadata.PackageNotFoundError:
            h.update(f"{lib}=?\n".encode())
    _DIGEST[:] = [count, now, h.hexdigest()]
    return hashlib.sha256((_DIGEST[2] + origins).encode()).hexdigest()


def _cpu() -> str:
    """The CPU's model and instruction sets (Linux), or the platform's name."""
    try:
        lines = Path("/proc/cpuinfo").read_text().splitlines()
    except OSError:
        import platform

        return platform.processor() or platform.machine()
    wanted = ("model name", "flags", "Features", "CPU part")
    return "\n".join(sorted({ln for ln in lines if ln.split(":")[0].strip() in wanted}))


def _options() -> str:
    """jax's options that change a traced program (its own tracing cache's key)."""
    try:
        from jax._src import config

        values = config.trace_context()
    except (ImportError, AttributeError):  # pragma: no cover - another jax layout
        values = ()
    # an object without a value's repr (its address) is left out: it would never match
    return repr([v if " at 0x" not in repr(v) else type(v).__name__ for v in values])


def _leaf(x) -> str:
    if _is_array(x):
        sharding = getattr(x, "sharding", None)
        weak = getattr(x, "weak_type", False)
        return f"{tuple(x.shape)}:{x.dtype}:{weak}:{sharding}"
    return repr(x)


def _named(fn) -> str | None:
    """``module.name`` of a function its module holds under that name (not a lambda or
    a closure, whose name does not say which code and captured values it has)."""
    module, name = getattr(fn, "__module__", None), getattr(fn, "__qualname__", None)
    found = sys.modules.get(module) if module else None
    if not _has_source(found):
        return None
    for part in (name or "<").split("."):
        found = getattr(found, part, None)
    return f"{module}.{name}" if found is fn else None


def _has_source(module) -> bool:
    """A module whose code the key can hold: a file (hashed by :func:`code_digest` if
    it is not installed), or Python's builtins; not a notebook's or ``-c``'s code."""
    if module is None:
        return False
    return module.__name__ == "builtins" or bool(getattr(module, "__file__", None))


def program_key(fn, args: tuple, kwargs: dict) -> str | None:
    """The key of ``fn``'s program for these arguments, or None where it cannot be
    told without tracing: ``fn`` not a module's function by its name, or a static
    value without a faithful text (its repr names an address)."""
    named = _named(fn)
    if named is None:
        return None
    dyn_args, dyn_kwargs, statics = split(args, kwargs)
    text = repr([(kind, name, repr(v)) for kind, name, v in statics])
    if " at 0x" in text:
        return None
    for _, _, v in statics:  # a value's class (the model's) defined where no file holds it
        if not all(_has_source(sys.modules.get(t.__module__)) for t in type(v).__mro__):
            return None
    leaves, tree = jax.tree.flatten((dyn_args, dyn_kwargs))
    parts = [
        named,
        text,
        str(tree),
        "|".join(_leaf(x) for x in leaves),
        code_digest(),
        _options(),
        os.environ.get("XLA_FLAGS", ""),
        jax.default_backend(),
        ",".join(sorted({d.device_kind for d in jax.devices()})),
        _cpu(),
    ]
    return hashlib.sha256("\n".join(parts).encode()).hexdigest()


def folder() -> Path | None:
    """Where programs are stored: ``searches/`` of jax's compilation cache folder (a
    cache in a bucket: of this machine's cache, as an entry is this machine's), or
    None (no folder set, or ``FLAXFORMER_LITE_STORED_SEARCHES=0``: nothing stored)."""
    cache = jax.config.jax_compilation_cache_dir
    if not cache or os.environ.get(SWITCH, "1") == "0":
        return None
    if location.is_remote(cache):
        return Path(storage.cache_folder(FOLDER))
    return Path(os.path.expanduser(cache)) / FOLDER


def _device(executable) -> int | None:
    """The id of the one device a compiled program runs on, or None (several)."""
    shardings = jax.tree.leaves(executable.input_shardings)
    devices = {d.id for s in shardings for d in s.device_set}
    return devices.pop() if len(devices) == 1 else None


MAGIC = b"flaxformer_lite search 1\n"


def _load(path: Path):
    """An entry: MAGIC, a JSON header (device, the two trees' sizes), the argument and
    output trees (jax's proto form) and the executable as jax serialized it. Loading
    an executable runs code from the folder, as jax's own cache does: it is the user's."""
    from jax._src import tree_util
    from jax.experimental import serialize_executable

    data = path.read_bytes()
    if not data.startswith(MAGIC):
        raise ValueError("not a stored search")
    head_end = data.index(b"\n", len(MAGIC))
    head = json.loads(data[len(MAGIC) : head_end])
    at = head_end + 1
    trees = []
    for size in (head["in"], head["out"]):
        trees.append(tree_util.PyTreeDef.deserialize_using_proto(
            tree_util.default_registry, data[at : at + size]))  # fmt: skip
        at += size
    on = [d for d in jax.devices() if d.id == head["device"]]
    program = serialize_executable.deserialize_and_load(data[at:], *trees, execution_devices=on)
    os.utime(path)  # recently used: the last to go
    return program


def _store(path: Path, program, device: int) -> None:
    from jax.experimental import serialize_executable

    payload, in_tree, out_tree = serialize_executable.serialize(program)
    trees = [in_tree.serialize_using_proto(), out_tree.serialize_using_proto()]
    head = json.dumps({"device": device, "in": len(trees[0]), "out": len(trees[1])})
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(f".{os.getpid()}.{threading.get_ident()}.tmp")
    tmp.write_bytes(MAGIC + head.encode() + b"\n" + b"".join(trees) + payload)
    os.replace(tmp, path)  # whole or absent: a reader never sees half an entry
    _evict(path.parent)


def _evict(where: Path, limit: int = LIMIT) -> None:
    """The least recently used entries go until the folder holds ``limit`` bytes."""
    entries = []
    for p in where.glob("*.bin"):
        try:
            st = p.stat()
        except OSError:
            continue
        entries.append((st.st_mtime, st.st_size, p))
    total = sum(size for _, size, _ in entries)
    for _, size, p in sorted(entries):
        if total <= limit:
            break
        p.unlink(missing_ok=True)
        total -= size


def _fresh(fn, args: tuple, kwargs: dict):
    """``fn`` lowered and compiled by XLA now, not loaded from jax's persistent cache: an
    executable jax loaded from there serializes without its kernels' code (a process
    that loads it fails at its first run: "Function broadcast_compare_fusion not
    found", jaxlib 0.10). The switch is thread-local: other threads keep the cache."""
    try:
        from jax._src import config

        switch = config.enable_compilation_cache(False)
    except (ImportError, AttributeError, TypeError):  # pragma: no cover - another jax
        return None
    with switch:
        return fn.lower(*args, **kwargs).compile()


class Program:
    """``fn``'s compiled program for one set of argument shapes, called with the same
    arguments as ``fn``. One loaded from the folder (``path``) that fails to run is
    dropped, its entry deleted, and the call goes to ``fn`` itself (jax.jit): a search
    has no side effects, so running it again changes nothing."""

    def __init__(self, executable, fn, key: str, path: Path | None = None, empty=False):
        self.executable, self.fn, self.key, self.path = executable, fn, key, path
        self.empty = empty  # the split that matches the program's arguments

    def __call__(self, *args, **kwargs):
        if self.executable is None:
            return self.fn(*args, **kwargs)
        dyn_args, dyn_kwargs, _ = split(args, kwargs, self.empty)
        if self.path is None:  # compiled by this process
            return self.executable(*dyn_args, **dyn_kwargs)
        try:
            return self.executable(*dyn_args, **dyn_kwargs)
        except jax.errors.JaxRuntimeError as e:
            warnings.warn(f"stored search {self.path.name} failed to run ({e}); compiling "
                          "it again", stacklevel=2)  # fmt: skip
            self.path.unlink(missing_ok=True)
            with _LOCK:
                _MEMORY.pop(self.key, None)
            self.executable = None
            return self.fn(*args, **kwargs)


def _empty_traced(executable, args: tuple, kwargs: dict) -> bool | None:
    """Which split gives the program's arguments (None arguments static, or traced), or
    None if neither does."""
    for empty in (False, True):
        dyn_args, dyn_kwargs, _ = split(args, kwargs, empty)
        if executable.in_tree == jax.tree.structure((dyn_args, dyn_kwargs)):
            return empty
    return None


def compiled(fn, *args, **kwargs) -> Program | None:
    """``fn``'s (a ``jax.jit`` function) compiled program for these arguments: from this
    process's memory, from the folder (:func:`folder`), or lowered and compiled now and
    stored. None where the program cannot be kept so (a static value without a
    faithful text, a signature whose traced arguments are not the arrays); then
    compile as ``jax.jit`` does."""
    key = program_key(fn, args, kwargs)
    if key is None:
        return None
    with _LOCK:
        found, left = _MEMORY.get(key), key in _LEFT
    if found is not None or left:
        return found
    where = folder()
    path = where / f"{key}.bin" if where is not None else None
    executable = None
    if path is not None and path.is_file():
        try:
            executable = _load(path)
            STATS["loaded"] += 1
        except Exception as e:  # a torn, stale or foreign entry: compile it again
            warnings.warn(f"stored search {path.name} did not load ({e!r}); compiling it again",
                          stacklevel=2)  # fmt: skip
    empty = None if executable is None else _empty_traced(executable, args, kwargs)
    loaded = empty is not None  # (an entry whose arguments do not fit: compiled again)
    if not loaded:
        executable = _fresh(fn, args, kwargs) if path is not None else None
        executable = executable or fn.lower(*args, **kwargs).compile()
        STATS["compiled"] += 1
        empty = _empty_traced(executable, args, kwargs)
        # its traced arguments are not the arrays, or it runs over several devices
        device = None if empty is None else _device(executable)
        if device is None:
            with _LOCK:
                _LEFT.add(key)  # jax.jit keeps it; the next call goes there at once
            return None
        if path is not None:
            try:
                _store(path, executable, device)
            except Exception as e:  # a full disk or a read-only folder loses no result
                warnings.warn(f"could not store the search in {where} ({e!r})", stacklevel=2)
    program = Program(executable, fn, key, path if loaded else None, bool(empty))
    with _LOCK:
        _MEMORY[key] = program
        while len(_MEMORY) > MEMORY_SIZE:
            _MEMORY.pop(next(iter(_MEMORY)))
    return program
