"""A run's logs as a sweep writes them (``train.log``, ``evaluate.log``): appended by
the commands it starts, locally or in a bucket, and read back by their last lines.

Shared by the sweep's own process and the SLURM job of a run
(:mod:`~flaxformer_lite.sweep.job`), which imports nothing heavier than this.
"""

from __future__ import annotations

import hashlib
import os
import shlex
import subprocess
from collections.abc import Callable

from flaxformer_lite.workdir import location, storage

PREEMPTED = "stopped by SIG"  # what training prints when a signal stopped it early


def run_logged(
    command: list[str],
    log: location.Path,
    env: dict[str, str] | None = None,
    start: Callable[..., int] | None = None,
) -> int:
    """Run ``command`` with its output appended to ``log`` (``start(command, out, env)``
    runs it: a sweep's own keeps track of its children). A bucket's log is written to a
    local copy while the command runs (an object cannot grow), then uploaded."""
    local = local_log(log)
    try:
        with open(local, "a") as out:
            out.write(f"$ {shlex.join(command)}\n")
            out.flush()
            if start is not None:
                return start(command, out, env)
            return subprocess.call(command, stdout=out, stderr=subprocess.STDOUT, env=env)
    finally:
        if location.is_remote(log):
            with open(local, "rb") as f:
                log.write_bytes(f.read())


def append(log: location.Path, line: str) -> None:
    """Add one line of the sweep's own to ``log`` (uploaded where it is a bucket's)."""
    local = local_log(log)
    with open(local, "a") as out:
        out.write(line.rstrip("\n") + "\n")
    if location.is_remote(log):
        with open(local, "rb") as f:
            log.write_bytes(f.read())


def local_log(log: location.Path) -> str:
    """The local file a log is appended to: itself, or for a bucket's log a copy in this
    machine's cache (started from the bucket's, so a resumed run's log keeps its past)."""
    if not location.is_remote(log):
        return location.local(log)
    folder = storage.cache_folder("logs", hashlib.sha256(str(log).encode()).hexdigest()[:24])
    local = os.path.join(folder, log.name)
    if not os.path.exists(local):
        with open(local, "wb") as f:
            f.write(log.read_bytes() if log.exists() else b"")
    return local


def tail(log: location.Path, lines: int = 3) -> str:
    """The last ``lines`` lines of a log, joined by `` | `` ('' for none)."""
    if location.is_remote(log):
        text = log.read_bytes().decode("utf-8", "replace") if log.exists() else ""
    else:
        local = location.local(log)
        text = open(local, errors="replace").read() if os.path.isfile(local) else ""
    return " | ".join(t.strip() for t in text.strip().splitlines()[-lines:])
