"""Compiling a translation's searches ahead, in a background thread (inference/ahead.py)."""

import threading
import time

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

from flaxformer_lite.inference.ahead import Ahead, Call, default_streams
from tests.fixtures import Compiles


class _Spy:
    """A jitted function that records which thread lowered it, for what shapes."""

    def __init__(self, fn):
        self.fn, self.lowered = fn, []

    def lower(self, x, **kw):
        self.lowered.append((threading.current_thread().name, x.shape))
        return self.fn.lower(x, **kw)

    def __call__(self, x, **kw):
        return self.fn(x, **kw)


def test_each_program_compiles_once_ahead_in_order_and_the_calls_reuse_it():
    @jax.jit
    def f(x, limit):
        return jnp.cumsum(x) * limit

    spy = _Spy(f)
    xs = [jnp.arange(n, dtype=jnp.float32) for n in (16, 16, 32, 16, 8)]
    calls = [Call(spy, x, limit=jnp.int32(i)) for i, x in enumerate(xs)]
    with Compiles() as compiles, Ahead(calls) as ahead:
        outs = [ahead.run(c) for c in calls]
    assert [shape for _, shape in spy.lowered] == [(16,), (32,), (8,)]  # order of first use
    assert all(name.startswith("compile-ahead") for name, _ in spy.lowered)
    # The calls found the programs compiled ahead: no compilation in the calling thread.
    # (Not jit's in-memory cache size: whether a call lands there is jax's dispatch
    # detail, and it read 0 in one CI worker after other tests had run.)
    assert len(compiles.threads) == 3
    assert all(n.startswith("compile-ahead") for n in compiles.threads)
    for i, (x, out) in enumerate(zip(xs, outs, strict=True)):
        np.testing.assert_array_equal(out, np.cumsum(np.asarray(x)) * i)


def test_a_compile_error_is_raised_where_the_call_runs():
    @jax.jit
    def bad(x):
        return x @ x  # (2, 3) @ (2, 3): no such product

    call = Call(bad, jnp.ones((2, 3)))
    with Ahead([call]) as ahead, pytest.raises(TypeError, match="dot_general"):
        ahead.run(call)


def test_a_plain_function_runs_without_compiling():
    call = Call(lambda x: x + 1, 1)
    with Ahead([call]) as ahead:
        assert ahead.run(call) == 2


def test_results_come_in_order_from_at_most_streams_calls_at_once():
    lock, running, most, threads = threading.Lock(), [0], [0], set()

    def slow(i):
        with lock:
            running[0] += 1
            most[0] = max(most[0], running[0])
            threads.add(threading.current_thread().name)
        time.sleep(0.02 * (5 - i))  # the first calls end last
        with lock:
            running[0] -= 1
        return np.full(2, i)

    calls = [Call(slow, i) for i in range(5)]
    with Ahead(calls, streams=2) as ahead:
        outs = list(ahead.results())
    assert [int(o[0]) for o in outs] == list(range(5))
    assert most[0] == 2 and len(threads) == 2
    assert all(name.startswith("decode-stream") for name in threads)
    with pytest.raises(ValueError, match="streams=0"):
        Ahead(calls, streams=0)


def test_two_streams_by_default_on_cpu_for_a_model_on_one_device():
    params = {"w": jnp.ones((8, 4)), "b": np.zeros(4)}
    assert default_streams(params) == 2
    if jax.device_count() >= 2:  # a model spread over devices runs one search at a time
        mesh = jax.sharding.Mesh(np.array(jax.devices()[:2]), ("x",))
        spread = jax.device_put(params["w"], jax.sharding.NamedSharding(mesh, P("x")))
        assert default_streams({**params, "w": spread}) == 1
