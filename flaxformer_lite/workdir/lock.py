"""One training process per workdir: ``train.lock`` names the holder.

Two runs writing the same checkpoints, metrics and data position would corrupt each
other without a sign. The first run takes the lock and writes its PID, host, start
time and command into it; a second run finds the lock taken and stops with a message
naming the holder. A lock left behind by a run that died (SIGKILL, OOM, a lost
machine) is taken over, with a warning naming the run that left it.

A local folder: an exclusive ``flock`` on ``<workdir>/train.lock``, which the kernel
releases when its process dies, however it dies. The lock is advisory and local: on a
network filesystem whose ``flock`` does not reach across hosts, runs on different
hosts are not kept apart.

A bucket (``gs://``), which has no file locks: ``train.lock`` is an object created
with the precondition "no such object yet" (``ifGenerationMatch=0``), so of two runs
that try at once one succeeds. The holder rewrites it every :data:`BEAT` seconds,
each time on the condition that it is still the generation it wrote last (a run that
lost its lock to another says so). A lock is stale, and taken over, when its holder
is a process of this host that no longer exists (as the kernel's rule above), or when
its holder on another host has not rewritten it for :data:`LEASE` seconds (a
preempted or lost machine). The run's own clean exit deletes it.
"""

from __future__ import annotations

import fcntl
import json
import os
import socket
import sys
import threading
import time
from pathlib import Path

from flaxformer_lite.workdir import location

LOCK_FILE = "train.lock"
BEAT = float(os.environ.get("FLAXFORMER_LOCK_BEAT", 30))  # seconds between rewrites
LEASE = float(os.environ.get("FLAXFORMER_LOCK_LEASE", 120))  # silent this long: stale


class WorkdirBusyError(RuntimeError):
    """Another live process trains in this workdir."""


def _describe(holder: dict) -> str:
    started = holder.get("started")
    when = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(started)) if started else "?"
    return f"PID {holder.get('pid', '?')} on host {holder.get('host', '?')} (since {when})"


def _mine() -> dict:
    now = time.time()
    return {"pid": os.getpid(), "host": socket.gethostname(), "started": now, "beat": now,
            "command": " ".join(sys.argv)}  # fmt: skip


def _busy(workdir, holder: dict, extra: str = "") -> WorkdirBusyError:
    pid = holder.get("pid", "?")
    return WorkdirBusyError(
        f"{workdir} is in use by another training run: {_describe(holder)}{extra}; wait for "
        f"it to finish, stop it (kill -TERM {pid} saves a checkpoint first), or train in "
        "another --workdir"
    )


def _took_over(where, holder: dict) -> None:
    print(
        f"warning: took over {where} from {_describe(holder)}, a run that ended without "
        "releasing it (killed?); resuming from its newest checkpoint",
        flush=True,
    )


class WorkdirLock:
    """``with WorkdirLock(workdir):`` holds the workdir for this process (a no-op
    where ``enabled`` is False: the processes of a multi-process run other than 0)."""

    def __init__(self, workdir, enabled: bool = True):
        self.workdir = location.path(workdir)
        self.enabled = enabled
        self._held = None

    def __enter__(self) -> WorkdirLock:
        if self.enabled:
            kind = _ObjectLock if location.is_remote(self.workdir) else _FileLock
            self._held = kind(self.workdir)
        return self

    def __exit__(self, *exc) -> None:
        if self._held is not None:
            self._held.release()
            self._held = None


class _FileLock:
    def __init__(self, workdir):
        self.path = Path(location.local(workdir)) / LOCK_FILE
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            holder = _read(fd)
            os.close(fd)
            raise _busy(self.path.parent, holder) from None
        previous = _read(fd)
        if previous.get("pid"):
            _took_over(self.path, previous)
        os.ftruncate(fd, 0)
        os.pwrite(fd, (json.dumps(_mine()) + "\n").encode(), 0)
        os.fsync(fd)
        self.fd = fd

    def release(self) -> None:
        try:
            os.ftruncate(self.fd, 0)  # an empty lock file: released cleanly
        except OSError:
            pass  # a full or vanished disk: the kernel still drops the flock below
        os.close(self.fd)


def _read(fd: int) -> dict:
    try:
        text = os.pread(fd, 4096, 0).decode("utf-8", "replace").strip()
        holder = json.loads(text) if text else {}
        return holder if isinstance(holder, dict) else {}
    except (OSError, ValueError):
        return {}


def _alive_here(holder: dict) -> bool:
    """Whether the holder is a process of this host that still exists (another host's:
    unknown, so True)."""
    if holder.get("host") != socket.gethostname():
        return True
    try:
        os.kill(int(holder.get("pid", -1)), 0)
    except ProcessLookupError:
        return False
    except (OSError, ValueError):
        return True  # exists, owned by another user; or no pid recorded
    return True


class _ObjectLock:
    """The lock as an object with generation preconditions (the module's docstring)."""

    def __init__(self, workdir):
        from google.api_core import exceptions

        self.errors = exceptions
        bucket, key = location.bucket_of(workdir)
        self.where = f"{workdir}/{LOCK_FILE}"
        self.blob = location.client().bucket(bucket).blob(f"{key}/{LOCK_FILE}".lstrip("/"))
        self.mine = _mine()
        self.generation = self._take(workdir)
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._beat, name="workdir-lock", daemon=True)
        self.thread.start()

    def _write(self, generation: int) -> int:
        """Upload our record on the condition that the object's generation is
        ``generation`` (0: absent); its new generation."""
        self.blob.upload_from_string(
            json.dumps(self.mine), content_type="application/json",
            if_generation_match=generation,
        )  # fmt: skip
        return int(self.blob.generation)

    def _take(self, workdir) -> int:
        for _ in range(5):  # another run may take or free it between our calls
            try:
                return self._write(0)
            except self.errors.PreconditionFailed:
                pass
            holder, generation = self._holder()
            if generation == 0:
                continue  # released meanwhile: try to create it again
            silent = time.time() - float(holder.get("beat", holder.get("started", 0)) or 0)
            if _alive_here(holder) and silent < LEASE:
                expires = time.strftime("%H:%M:%S", time.localtime(time.time() + LEASE - silent))
                extra = (
                    f", last heard {silent:.0f} s ago (a lock unheard for {LEASE:.0f} s is "
                    f"stale: at {expires} if that run is gone)"
                    if holder.get("host") != socket.gethostname()
                    else ""
                )
                raise _busy(workdir, holder, extra)
            try:
                taken = self._write(generation)
            except self.errors.PreconditionFailed:
                continue  # another run took it first: look again
            _took_over(self.where, holder)
            return taken
        raise WorkdirBusyError(
            f"{self.where} keeps changing hands (other runs start in this --workdir); stop "
            "them, or train in another --workdir"
        )

    def _holder(self) -> tuple[dict, int]:
        try:
            self.blob.reload()
            text = self.blob.download_as_bytes(if_generation_match=self.blob.generation)
            record = json.loads(text.decode("utf-8", "replace") or "{}")
            return (record if isinstance(record, dict) else {}), int(self.blob.generation)
        except self.errors.NotFound:
            return {}, 0
        except (self.errors.PreconditionFailed, ValueError):
            return {}, int(self.blob.generation or 0)  # rewritten meanwhile, or unreadable

    def _beat(self) -> None:
        while not self.stop.wait(BEAT):
            self.mine["beat"] = time.time()
            try:
                self.generation = self._write(self.generation)
            except self.errors.PreconditionFailed:
                holder, _ = self._holder()
                print(
                    f"warning: {self.where} was taken over by {_describe(holder)}; this run no "
                    "longer holds its workdir (stop one of the two)",
                    file=sys.stderr,
                    flush=True,
                )
                return
            except Exception as e:  # a network blip: the next beat tries again
                print(f"warning: could not renew {self.where} ({e})", file=sys.stderr)

    def release(self) -> None:
        self.stop.set()
        self.thread.join(timeout=30)
        try:
            self.blob.delete(if_generation_match=self.generation)
        except (self.errors.NotFound, self.errors.PreconditionFailed):
            pass  # taken over meanwhile: the new holder's now
        except Exception as e:  # unreachable: a later run takes it over as stale
            print(f"warning: could not release {self.where} ({e})", file=sys.stderr)
