"""Compiling the next searches while the first ones run.

A test set's translation calls one jitted search per source width (three or four on a
typical split), and each compiles on its first call: ~0.7 s of tracing and ~2 s of
XLA compilation for beam 4 on 2 CPU cores, in the main thread, between batches. While
a search runs, its small matmuls keep ~1.6 of 2 cores busy, and tracing is Python on
one core. :class:`Ahead` lowers and compiles every distinct search of a translation in
one background thread, in the order the batches need them, so that the wider batches'
programs are ready (or nearly) when the narrow batches are done. A jitted function
called after ``lower(...).compile()`` of the same arguments reuses that executable, so
the calls themselves do not change, and a search already compiled costs a cache look-up.
A module's search function is kept as its compiled program
(:mod:`~flaxformer_lite.inference.programs`), which a later process loads from the
compilation cache folder without tracing it again.

It also runs the searches in ``streams`` threads at once (:meth:`Ahead.results`). One
search of a batch leaves a core idle a third of the time (its steps are chains of
small operations); two at once kept both cores busy and translated the demo's test
split 1.2-1.3x faster, greedy and beam 4 alike, as CTranslate2's ``inter_threads``
does. A search's output depends only on its own batch, so the streams change no output.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from itertools import islice
from typing import Any

import jax

from flaxformer_lite.inference import programs


def default_streams(params) -> int:
    """Batches decoded at once where ``decode.streams`` is 0: two on CPU for a model on
    one device, else one (an accelerator runs its programs one after the other, and
    the searches of a model spread over devices would run collectives side by side)."""
    if jax.default_backend() != "cpu":
        return 1
    placed = [x.sharding.device_set for x in jax.tree.leaves(params) if isinstance(x, jax.Array)]
    return 2 if all(len(devices) == 1 for devices in placed) else 1


class Call:
    """A jitted function with its arguments, to compile ahead and run later."""

    def __init__(self, fn: Callable, *args, **kwargs):
        self.fn, self.args, self.kwargs = fn, args, kwargs

    def key(self) -> tuple:
        """What its compiled program depends on: the function, the arguments' tree and
        each leaf's shape and dtype (or, for a static argument, its value)."""
        leaves, tree = jax.tree.flatten((self.args, self.kwargs))
        kinds = tuple(
            (tuple(x.shape), str(x.dtype)) if hasattr(x, "shape") and hasattr(x, "dtype") else x
            for x in leaves
        )
        return self.fn, tree, kinds

    def compile(self) -> programs.Program | None:
        """Its compiled program (:func:`~flaxformer_lite.inference.programs.compiled`:
        kept in memory and on disk, loaded without tracing by a later process), or None
        where jax.jit keeps it (compiled here) or the function is not jitted."""
        if not hasattr(self.fn, "lower"):
            return None
        program = programs.compiled(self.fn, *self.args, **self.kwargs)
        if program is None:
            self.fn.lower(*self.args, **self.kwargs).compile()
        return program

    def __call__(self, program: programs.Program | None = None) -> Any:
        if program is not None:
            return program(*self.args, **self.kwargs)
        return self.fn(*self.args, **self.kwargs)


class Ahead:
    """Runs ``calls`` (:meth:`run` one, :meth:`results` all of them in order, in
    ``streams`` threads), each distinct program compiled first in a background thread,
    one at a time (XLA's compiler already uses every core), in order of first use.
    Use as a context manager: leaving it waits for the compile and the calls still
    under way and drops the ones not started."""

    def __init__(self, calls: Sequence[Call], streams: int = 1):
        if not isinstance(streams, int) or streams < 1:
            raise ValueError(f"streams={streams!r}: need an integer >= 1")
        self._calls, self._streams = list(calls), streams
        self._runners = ThreadPoolExecutor(max_workers=streams, thread_name_prefix="decode-stream")
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="compile-ahead")
        self._ready: dict[tuple, Future] = {}
        for call in calls:
            key = call.key()
            if key not in self._ready:
                self._ready[key] = self._pool.submit(call.compile)

    def run(self, call: Call) -> Any:
        """``call()``, once its program is compiled (a compile error is raised here)."""
        ready = self._ready.get(call.key())
        return call(ready.result() if ready is not None else None)

    def _fetched(self, call: Call) -> Any:
        return jax.device_get(self.run(call))

    def results(self) -> Iterator[Any]:
        """Each call's result, on the host (numpy), in the calls' order; ``streams``
        calls run at once, and at most twice that many wait done or under way."""
        calls = iter(self._calls)
        start = self._runners.submit
        waiting = deque(start(self._fetched, c) for c in islice(calls, 2 * self._streams))
        while waiting:
            out = waiting.popleft().result()
            waiting.extend(start(self._fetched, c) for c in islice(calls, 1))
            yield out

    def __enter__(self) -> Ahead:
        return self

    def __exit__(self, *exc) -> None:
        self._runners.shutdown(wait=True, cancel_futures=True)
        self._pool.shutdown(wait=True, cancel_futures=True)
