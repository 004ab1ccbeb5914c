"""One training process per workdir: ``train.lock`` names the holder.

Two runs writing the same checkpoints, metrics and data position would corrupt each
other without a sign. The first run takes an exclusive ``flock`` on
``<workdir>/train.lock`` and writes its PID, host, start time and command into it;
a second run finds the lock taken and stops with a message naming the holder. The
kernel releases an ``flock`` when its process dies, however it dies (SIGKILL, OOM,
a lost machine), so a lock file left behind by a killed run is taken over, with a
warning naming the run that left it. The lock is advisory and local: on a network
filesystem whose ``flock`` does not reach across hosts, runs on different hosts
are not kept apart.
"""

from __future__ import annotations

import fcntl
import json
import os
import socket
import sys
import time
from pathlib import Path

LOCK_FILE = "train.lock"


class WorkdirBusyError(RuntimeError):
    """Another live process trains in this workdir."""


def _describe(holder: dict) -> str:
    started = holder.get("started")
    when = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(started)) if started else "?"
    return f"PID {holder.get('pid', '?')} on host {holder.get('host', '?')} (since {when})"


class WorkdirLock:
    """``with WorkdirLock(workdir):`` holds the workdir for this process (a no-op
    where ``enabled`` is False: the processes of a multi-process run other than 0)."""

    def __init__(self, workdir: str | Path, enabled: bool = True):
        self.path = Path(workdir) / LOCK_FILE
        self.enabled = enabled
        self._fd: int | None = None

    def __enter__(self) -> WorkdirLock:
        if not self.enabled:
            return self
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            holder = _read(fd)
            os.close(fd)
            pid = holder.get("pid", "?")
            raise WorkdirBusyError(
                f"{self.path.parent} is in use by another training run: {_describe(holder)}; "
                f"wait for it to finish, stop it (kill -TERM {pid} saves a checkpoint "
                "first), or train in another --workdir"
            ) from None
        previous = _read(fd)
        if previous.get("pid"):
            print(
                f"warning: took over {self.path} from {_describe(previous)}, a run that "
                "ended without releasing it (killed?); resuming from its newest checkpoint",
                flush=True,
            )
        mine = {
            "pid": os.getpid(),
            "host": socket.gethostname(),
            "started": time.time(),
            "command": " ".join(sys.argv),
        }
        os.ftruncate(fd, 0)
        os.pwrite(fd, (json.dumps(mine) + "\n").encode(), 0)
        os.fsync(fd)
        self._fd = fd
        return self

    def __exit__(self, *exc) -> None:
        if self._fd is None:
            return
        try:
            os.ftruncate(self._fd, 0)  # an empty lock file: released cleanly
        except OSError:
            pass  # a full or vanished disk: the kernel still drops the flock below
        os.close(self._fd)
        self._fd = None


def _read(fd: int) -> dict:
    try:
        text = os.pread(fd, 4096, 0).decode("utf-8", "replace").strip()
        return json.loads(text) if text else {}
    except (OSError, ValueError):
        return {}
