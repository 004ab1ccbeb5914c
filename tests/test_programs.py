"""Compiled searches kept on disk (inference/programs.py): a later process runs them
without tracing, and a key that differs in anything the program depends on misses."""

import functools
import os
import subprocess
import sys
import textwrap
import warnings
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.experimental import serialize_executable
from jax.sharding import PartitionSpec as P

from flaxformer_lite.inference import programs
from flaxformer_lite.inference.ahead import Ahead, Call

ROOT = Path(__file__).resolve().parents[1]
TRACES = []  # one entry per trace of `scaled`


@functools.partial(jax.jit, static_argnames=("times", "shift"))
def scaled(x, *, times: int, shift=None, limit=None):
    TRACES.append(x.shape)
    out = jnp.cumsum(x) * times
    out = out if shift is None else out + shift
    return out if limit is None else jnp.minimum(out, limit)


@functools.partial(jax.jit, static_argnames=("times",))
def maybe(x, extra, *, times: int):
    TRACES.append(("maybe", x.shape))
    return x * times if extra is None else x * times + extra


@pytest.fixture
def store(tmp_path, monkeypatch):
    """An empty compilation cache folder and no program in memory."""
    monkeypatch.setattr(programs, "folder", lambda: tmp_path / programs.FOLDER)
    monkeypatch.setattr(programs, "_MEMORY", {})
    monkeypatch.setattr(programs, "_LEFT", set())
    TRACES.clear()
    yield tmp_path / programs.FOLDER


def _entries(where: Path) -> list[Path]:
    return sorted(where.glob("*.bin")) if where.is_dir() else []


def test_a_stored_program_loads_without_tracing_and_gives_the_same_result(store):
    x = jnp.arange(6, dtype=jnp.float32)
    first = programs.compiled(scaled, x, times=3, limit=jnp.float32(20.0))
    want = first(x, times=3, limit=jnp.float32(20.0))
    assert len(TRACES) == 1 and len(_entries(store)) == 1
    np.testing.assert_array_equal(want, np.minimum(np.cumsum(np.arange(6)) * 3, 20))
    programs._MEMORY.clear()  # as a new process: only the folder holds it
    again = programs.compiled(scaled, x, times=3, limit=jnp.float32(20.0))
    assert len(TRACES) == 1  # loaded, not traced
    np.testing.assert_array_equal(again(x + 1, times=3, limit=jnp.float32(20.0)),
                                  scaled(x + 1, times=3, limit=jnp.float32(20.0)))  # fmt: skip


def test_a_none_argument_that_jit_traces_is_kept_too(store):
    """``generate`` passes ``inputs=None`` positionally: jit traces it (an empty tree),
    so the program's arguments hold it, unlike a static argument's None."""
    x = jnp.arange(3.0)
    program = programs.compiled(maybe, x, None, times=2)
    np.testing.assert_array_equal(program(x, None, times=2), [0, 2, 4])
    programs._MEMORY.clear()
    again = programs.compiled(maybe, x, None, times=2)
    np.testing.assert_array_equal(again(x + 1, None, times=2), [2, 4, 6])
    assert TRACES == [("maybe", (3,))] and len(_entries(store)) == 1


def test_the_key_changes_with_what_the_program_depends_on(store, monkeypatch):
    x = jnp.ones(4)
    key = programs.program_key(scaled, (x,), {"times": 2})
    assert key == programs.program_key(scaled, (x + 5,), {"times": 2})  # values: not
    others = [
        programs.program_key(scaled, (x,), {"times": 3}),  # a static value
        programs.program_key(scaled, (jnp.ones(5),), {"times": 2}),  # a shape
        programs.program_key(scaled, (jnp.ones(4, jnp.int32),), {"times": 2}),  # a dtype
        programs.program_key(scaled, (x,), {"times": 2, "limit": jnp.float32(1)}),  # a tree
        programs.program_key(scaled, (x,), {"times": 2, "shift": 1.0}),  # a static added
    ]
    assert len({key, *others}) == 1 + len(others)
    monkeypatch.setenv("XLA_FLAGS", os.environ.get("XLA_FLAGS", "") + " --xla_cpu_foo=1")
    assert programs.program_key(scaled, (x,), {"times": 2}) != key
    monkeypatch.undo()
    monkeypatch.setattr(programs, "_DIGEST", [len(sys.modules), 1e18, "other source"])
    assert programs.program_key(scaled, (x,), {"times": 2}) != key  # the code


def test_a_changed_source_file_changes_the_digest(tmp_path, monkeypatch):
    mine = tmp_path / "lab_module.py"
    mine.write_text("VALUE = 1\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    import lab_module  # noqa: F401  (a user's own module: its source is in the key)

    try:
        monkeypatch.setattr(programs, "_DIGEST", [])
        before = programs.code_digest()
        mine.write_text("VALUE = 2  # changed\n")
        monkeypatch.setattr(programs, "_DIGEST", [])
        assert programs.code_digest() != before
    finally:
        sys.modules.pop("lab_module", None)


def test_lambdas_closures_and_addresses_are_left_to_jit(store):
    x = jnp.ones(3)
    assert programs.compiled(jax.jit(lambda v: v + 1), x) is None
    assert programs.compiled(scaled, x, times=object()) is None  # repr with an address
    assert _entries(store) == []


def test_a_program_over_several_devices_is_left_to_jit_once(store):
    mesh = jax.sharding.Mesh(np.array(jax.devices()[:2]), ("d",))
    x = jax.device_put(jnp.arange(8.0), jax.sharding.NamedSharding(mesh, P("d")))
    before = programs.STATS["compiled"]
    assert programs.compiled(scaled, x, times=2) is None
    assert programs.compiled(scaled, x, times=2) is None  # not compiled a second time
    assert programs.STATS["compiled"] == before + 1 and _entries(store) == []


def test_a_torn_entry_is_compiled_again_and_replaced(store):
    x = jnp.arange(3.0)
    programs.compiled(scaled, x, times=2)
    [entry] = _entries(store)
    entry.write_bytes(entry.read_bytes()[:100])  # half written
    programs._MEMORY.clear()
    with pytest.warns(UserWarning, match="did not load"):
        program = programs.compiled(scaled, x, times=2)
    np.testing.assert_array_equal(program(x, times=2), [0, 2, 6])
    programs._MEMORY.clear()
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # the replacement loads
        again = programs.compiled(scaled, x, times=2)
    np.testing.assert_array_equal(again(x, times=2), [0, 2, 6])


def test_a_stored_program_that_fails_to_run_gives_way_to_jit(store):
    """An executable serialized after a load (as one from jax's own cache would be)
    loses its kernels' code and fails at its first run: the call falls back to jit and
    the entry goes. Entries are compiled fresh, never from jax's cache, to avoid it."""
    x = jnp.arange(5, dtype=jnp.float32)
    once = serialize_executable.deserialize_and_load(
        *serialize_executable.serialize(scaled.lower(x, times=4).compile())
    )
    key = programs.program_key(scaled, (x,), {"times": 4})
    entry = store / f"{key}.bin"
    programs._store(entry, once, jax.devices()[0].id)  # `once` re-serialized, as jax's would be
    program = programs.compiled(scaled, x, times=4)
    with pytest.warns(UserWarning, match="failed to run"):
        out = program(x, times=4)
    np.testing.assert_array_equal(out, np.cumsum(np.arange(5)) * 4)
    assert not entry.exists()
    np.testing.assert_array_equal(program(x + 1, times=4), np.cumsum(np.arange(5) + 1) * 4)


def test_the_oldest_entries_go_past_the_limit(tmp_path):
    for i, name in enumerate("abcd"):
        (tmp_path / f"{name}.bin").write_bytes(b"x" * 100)
        os.utime(tmp_path / f"{name}.bin", (i, i))
    programs._evict(tmp_path, limit=250)
    assert [p.stem for p in _entries(tmp_path)] == ["c", "d"]


def test_ahead_runs_the_stored_programs(store):
    xs = [jnp.arange(n, dtype=jnp.float32) for n in (4, 4, 8)]
    calls = [Call(scaled, x, times=2) for x in xs]
    with Ahead(calls) as ahead:
        outs = list(ahead.results())
    assert len(TRACES) == 2 and len(_entries(store)) == 2
    for x, out in zip(xs, outs, strict=True):
        np.testing.assert_array_equal(out, np.cumsum(np.asarray(x)) * 2)
    programs._MEMORY.clear()
    with Ahead(calls) as ahead:
        assert [o.shape for o in ahead.results()] == [(4,), (4,), (8,)]
    assert len(TRACES) == 2  # the second translation loaded both


def test_a_new_process_loads_the_program_without_tracing(store):
    """Two processes of the same command: the first compiles and stores, the second
    loads (no trace) and gives the same output."""
    script = textwrap.dedent(f"""
        import jax, jax.numpy as jnp, numpy as np
        jax.config.update("jax_compilation_cache_dir", {str(store.parent)!r})
        from tests import test_programs as t
        from flaxformer_lite.inference import programs
        x = jnp.arange(5, dtype=jnp.float32)
        out = programs.compiled(t.scaled, x, times=4)(x, times=4)
        print(len(t.TRACES), np.asarray(out).tolist())
    """)
    env = dict(os.environ, **{programs.SWITCH: "1"})  # the suite turns them off
    runs = [
        subprocess.run(
            [sys.executable, "-c", script],
            cwd=ROOT,
            env=env,
            capture_output=True,
            text=True,
            timeout=120,
        )  # fmt: skip
        for _ in range(2)
    ]
    for done in runs:
        assert done.returncode == 0, done.stderr[-2000:]
    outputs = [done.stdout.strip().splitlines()[-1] for done in runs]
    assert outputs == ["1 [0.0, 4.0, 12.0, 24.0, 40.0]", "0 [0.0, 4.0, 12.0, 24.0, 40.0]"]
    assert len(_entries(store)) == 1
