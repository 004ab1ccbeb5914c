"""Several processes, one program: JAX's multi-controller runtime.

Every process runs the same command; ``jax.distributed.initialize`` connects
them (process 0 hosts the coordinator), after which ``jax.devices()`` lists the
devices of all processes and one ``jit`` step spans them. From the flags::

  python -m flaxformer_lite.main --config=... --workdir=gs://... \\
      --coordinator_address=10.0.0.1:1234 --num_processes=2 --process_id=0   # and =1

or, on a TPU VM slice, a SLURM job, Open MPI or Kubernetes, ``--distributed``
alone: JAX reads the cluster's own environment (JAX_COORDINATOR_ADDRESS is read
too). The training loop then lets each process read its own data shards,
process 0 write the tokenizer, logs and metrics, and every process write its
shards of a checkpoint (orbax, collectively).

A process that dies stops the others: a collective that fails, or a
:class:`Watchdog` that misses the dead process's heartbeat for
``heartbeat_timeout`` seconds, makes each survivor exit (status 1) with one line
naming the lost process, instead of waiting forever in a collective.
"""

from __future__ import annotations

import itertools
import json
import os
import sys
import threading
import time

import jax
import numpy as np


class DistributedError(RuntimeError):
    """The processes could not be connected; the message names the flag to fix."""


class PeerLostError(DistributedError):
    """Another process died or became unreachable during training. The process
    should exit at once (``os._exit``): JAX's own shutdown would wait for it."""


def initialize(
    coordinator_address: str | None = None,
    num_processes: int | None = None,
    process_id: int | None = None,
    *,
    auto: bool = False,
    heartbeat_timeout: int = 60,
    initialization_timeout: int = 300,
) -> bool:
    """Connect this process to the others; False when there is nothing to connect
    (no address, no count, ``auto`` off: a single-process run). Values not given
    come from ``JAX_COORDINATOR_ADDRESS``, ``JAX_NUM_PROCESSES``, ``JAX_PROCESS_ID``."""
    coordinator_address, num_processes, process_id = from_environment(
        coordinator_address, num_processes, process_id
    )
    explicit = (coordinator_address, num_processes, process_id)
    if not auto and all(v is None for v in explicit):
        return False
    if not auto and None in explicit:
        raise DistributedError(
            "a multi-process run needs --coordinator_address, --num_processes and "
            "--process_id together (or --distributed to detect a TPU/SLURM/MPI cluster); "
            f"got coordinator_address={coordinator_address!r}, "
            f"num_processes={num_processes!r}, process_id={process_id!r}"
        )
    if num_processes is not None and process_id is not None:
        if not 0 <= process_id < num_processes:
            raise DistributedError(
                f"--process_id={process_id} must be in [0, --num_processes={num_processes})"
            )
    WATCHDOG.timeout = heartbeat_timeout
    try:
        jax.distributed.initialize(
            coordinator_address,
            num_processes,
            process_id,
            initialization_timeout=initialization_timeout,
            heartbeat_timeout_seconds=2 * heartbeat_timeout + 10,  # after the Watchdog's
        )
    except (RuntimeError, ValueError) as e:
        raise DistributedError(
            f"could not join the processes at {coordinator_address or 'the detected cluster'} "
            f"({str(e).splitlines()[0][:300]}); check that every process got the same "
            "--coordinator_address and --num_processes and that process 0 is running"
        ) from e
    return True


def from_environment(
    coordinator_address: str | None, num_processes: int | None, process_id: int | None
) -> tuple[str | None, int | None, int | None]:
    """The arguments, each taken from its ``JAX_*`` variable when not given."""
    env = os.environ

    def number(name: str) -> int | None:
        value = env.get(name)
        if value is None:
            return None
        try:
            return int(value)
        except ValueError:
            raise DistributedError(f"{name}={value!r} must be an integer") from None

    return (
        coordinator_address or env.get("JAX_COORDINATOR_ADDRESS"),
        num_processes if num_processes is not None else number("JAX_NUM_PROCESSES"),
        process_id if process_id is not None else number("JAX_PROCESS_ID"),
    )


def _stop_for_lost_peer(cause: str) -> None:
    """Say in one line that a peer is gone, and exit at once: JAX's own shutdown would
    wait for the lost process, and its coordination service aborts with a native stack
    trace a little later."""
    print(
        f"error: process {jax.process_index()} of {jax.process_count()}: {cause}; this one "
        "stops too. Restart every process with the same command to resume from the last "
        "checkpoint",
        file=sys.stderr,
        flush=True,
    )
    sys.stdout.flush()
    os._exit(1)


class Watchdog:
    """Each process bumps a counter in JAX's key-value store every ``timeout / 10``
    seconds and watches the others' counters; a counter that stops moving for
    ``timeout`` seconds (a killed or hung process), or a store that stops answering
    (process 0, which hosts it, is gone), stops this process with one line.

    JAX's own heartbeat (set to twice as long by :func:`initialize`) would also stop
    it, but with an abort and a native stack trace; and a collective that waits for a
    dead peer may never return by itself. Started once training runs (startup may hold
    a process in native code for minutes: tokenizer training, compilation)."""

    def __init__(self, timeout: float):
        self.timeout = timeout
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def start(self) -> None:
        if jax.process_count() > 1 and self._thread is None:
            self._thread = threading.Thread(target=self._run, name="peer-watchdog", daemon=True)
            self._thread.start()

    def stop(self) -> None:
        self._stop.set()

    def _run(self) -> None:
        from jax._src import distributed as jax_distributed

        client = jax_distributed.global_state.client
        me = jax.process_index()
        peers = {p: (None, time.monotonic()) for p in range(jax.process_count()) if p != me}
        beat = 0
        while not self._stop.wait(max(0.2, self.timeout / 10)):
            try:
                beat += 1
                client.key_value_set(f"flaxformer/alive/{me}", str(beat), allow_overwrite=True)
            except Exception as e:  # noqa: BLE001 - any failure means the store is gone
                _stop_for_lost_peer(
                    f"process 0 (the coordinator) stopped answering ({str(e)[:200]})"
                )
            now = time.monotonic()
            for p, (last, since) in peers.items():
                try:
                    value = client.key_value_try_get(f"flaxformer/alive/{p}")
                except Exception:  # noqa: BLE001 - not written yet
                    value = None
                if value != last:
                    peers[p] = (value, now)
                elif now - since > self.timeout and not self._stop.is_set():
                    _stop_for_lost_peer(
                        f"process {p} sent no heartbeat for {self.timeout:g} s (killed, "
                        "preempted or hung)"
                    )


WATCHDOG = Watchdog(60.0)


def barrier(name: str) -> None:
    """Every process waits here until all have arrived (one process: returns)."""
    if jax.process_count() > 1:
        from jax.experimental import multihost_utils

        multihost_utils.sync_global_devices(name)


def all_agree(flag: bool) -> bool:
    """``flag`` as process 0 sees it, on every process (one process: ``flag``)."""
    if jax.process_count() == 1:
        return flag
    return _from_chief("1" if flag else "0", "decision") == "1"


def chief_value(x: float) -> float:
    """``x`` as process 0 computed it, on every process (one process: ``x``): a
    factor from the clock must be the same in every replica of the parameters."""
    if jax.process_count() == 1:
        return x
    return float(_from_chief(repr(float(np.float32(x))), "value"))


_CHIEF_KEYS = itertools.count()


def _from_chief(text: str, what: str) -> str:
    """Process 0's ``text`` on every process, through JAX's key-value store (every
    process calls this in the same order, so the n-th call of each meets the n-th
    key). Not a device collective: a process whose peer died must not sit in a wait
    that holds the interpreter, or the watchdog thread cannot stop it; a chief that
    stays silent past the heartbeat timeout is a lost peer."""
    from jax._src import distributed as jax_distributed

    client = jax_distributed.global_state.client
    key = f"flaxformer/chief/{next(_CHIEF_KEYS)}"
    if jax.process_index() == 0:
        client.key_value_set(key, text)
        return text
    try:
        return client.blocking_key_value_get(key, int(WATCHDOG.timeout * 1000))
    except Exception as e:  # noqa: BLE001 - a timeout or a closed store: the chief is gone
        _stop_for_lost_peer(
            f"process 0 sent no {what} for {WATCHDOG.timeout:g} s ({str(e).splitlines()[0][:200]})"
        )
        raise  # not reached: _stop_for_lost_peer exits


def gather_json(value) -> list:
    """``value`` (JSON-serialisable) of every process, in process order."""
    if jax.process_count() == 1:
        return [value]
    from jax.experimental import multihost_utils

    data = np.frombuffer(json.dumps(value).encode(), np.uint8)
    sizes = multihost_utils.process_allgather(np.int32(data.size))
    padded = np.zeros(int(np.max(sizes)), np.uint8)
    padded[: data.size] = data
    everyone = multihost_utils.process_allgather(padded)
    return [
        json.loads(bytes(row[: int(n)]).decode())
        for row, n in zip(np.asarray(everyone), np.asarray(sizes).reshape(-1), strict=True)
    ]


def merged_data_state(local: dict) -> dict:
    """The data iterators' states of all processes as one (their shards' positions
    merged), so that any process count dividing the shards resumes from it."""
    states = gather_json(local)
    if len(states) == 1:
        return states[0]
    shards: dict = {}
    for state in states:
        shards.update(state.get("shards", {}))
    return {"shards": shards}
