"""Files and folders at a run's location (a local folder or a bucket:
:mod:`~flaxformer_lite.workdir.location`), written so that a reader never sees half of one.

What object storage changes, handled here:

- no rename: a file is written whole by one upload (:func:`write_atomic`: locally a
  temporary file and ``os.replace``), a folder is swapped in object by object
  (:func:`replace_folder`), and an appended log is re-uploaded whole, from its own
  thread (:class:`AppendFile`);
- nothing runs from the bucket: code or a model a library opens by file name is
  read into a local cache first (:func:`local_copy`, :func:`cache_folder`), and a folder
  a library writes by file name is written locally, then uploaded
  (:func:`staged_folder`).
"""

from __future__ import annotations

import contextlib
import hashlib
import io
import os
import tempfile
import threading
from collections.abc import Iterator

from etils import epath

from flaxformer_lite.workdir.location import is_remote, local, path


def write_atomic(target: epath.Path, data: bytes | str) -> None:
    """``target`` holds ``data`` whole or keeps what it held: locally a temporary file
    renamed over it; in a bucket one upload (an object appears whole or not at all)."""
    raw = data.encode() if isinstance(data, str) else data
    if is_remote(target):
        target.write_bytes(raw)
        return
    target = epath.Path(local(target))
    tmp = target.with_name(f".{target.name}.tmp{os.getpid()}")
    tmp.write_bytes(raw)
    os.replace(tmp, target)


def remove_tree(folder: epath.Path) -> None:
    """Delete ``folder`` and everything under it (nothing if absent)."""
    with contextlib.suppress(FileNotFoundError):
        if folder.exists():
            folder.rmtree()


def absolute(p) -> epath.Path:
    """``p`` with a local path made absolute (orbax asks for absolute folders)."""
    p = path(p)
    return p if is_remote(p) else epath.Path(os.path.abspath(local(p)))


def replace_folder(staging: epath.Path, target: epath.Path, last: tuple[str, ...] = ()) -> None:
    """Put the complete folder ``staging`` in ``target``'s place. Locally an atomic
    rename; in a bucket (no rename) the old objects go, then the new are copied in
    (files named in ``last``, a completion marker, after the rest) and the staging
    ones deleted: a reader meanwhile finds the folder absent or incomplete, never a
    mix of old and new."""
    if not is_remote(target):
        old = target.with_name(f"{target.name}.replaced")
        remove_tree(old)
        if target.exists():
            os.replace(local(target), local(old))
        os.replace(local(staging), local(target))
        remove_tree(old)
        return
    remove_tree(target)
    copy_tree(staging, target, last)
    remove_tree(staging)


def move(source: epath.Path, dest: epath.Path) -> None:
    """Rename a file or folder (in a bucket: copied, then deleted)."""
    if not is_remote(source):
        os.replace(local(source), local(dest))
        return
    if source.is_dir():
        copy_tree(source, dest)
        remove_tree(source)
    else:
        dest.write_bytes(source.read_bytes())
        source.unlink()


def copy_tree(source: epath.Path, dest: epath.Path, last: tuple[str, ...] = ()) -> None:
    """Copy every file under ``source`` to the same place under ``dest`` (those named
    in ``last`` after all others)."""
    files, deferred = [], []
    for root, _, names in source.walk():
        relative = os.path.relpath(_bare(root), _bare(source))
        for name in names:
            (deferred if name in last else files).append((relative, name))
    for relative, name in files + deferred:
        within = name if relative == "." else f"{relative}/{name}"
        target = dest / within
        if not is_remote(target):  # a bucket has no folders to make
            target.parent.mkdir(parents=True, exist_ok=True)
        target.write_bytes((source / within).read_bytes())


def _bare(p) -> str:
    """A path's text without its scheme (gcsfs names what it lists ``bucket/key``)."""
    text = os.fspath(p)
    return text.split("://", 1)[1] if "://" in text else text


class AppendFile:
    """A log written a piece at a time (``metrics.jsonl``, TensorBoard's event files).

    Locally appended and flushed. In a bucket, where an object cannot grow, the whole
    content is kept here (its earlier content read once, at opening) and uploaded by a
    thread of its own after each :meth:`flush`, the newest content only, so that a
    training step never waits for the network; :meth:`wait` blocks until what was
    flushed is there (training calls it before each checkpoint, so a bucket's logs
    reach at least as far as its newest checkpoint), :meth:`close` until the end is.
    """

    def __init__(self, target: epath.Path, binary: bool = False):
        self.target, self.binary = target, binary
        self.remote = is_remote(target)
        self.closed = False
        if not self.remote:
            self.file = open(local(target), "ab" if binary else "a")  # noqa: SIM115
            return
        self.data = bytearray(target.read_bytes() if target.exists() else b"")
        self.flushed = self.uploaded = 0  # versions: asked for, and in the bucket
        self.error: BaseException | None = None
        self.changed = threading.Condition()
        self.thread: threading.Thread | None = None

    def write(self, data: str | bytes) -> None:
        if not self.remote:
            self.file.write(data)
            return
        with self.changed:
            self.data += data if isinstance(data, bytes) else data.encode()

    def flush(self) -> None:
        if not self.remote:
            self.file.flush()
            return
        with self.changed:
            if self.closed:
                return
            self.flushed += 1
            if self.thread is None:
                self.thread = threading.Thread(target=self._upload, daemon=True,
                                               name=f"upload {self.target.name}")  # fmt: skip
                self.thread.start()
            self.changed.notify_all()

    def wait(self) -> None:
        """Block until everything flushed so far is in the bucket (or raise its error)."""
        if not self.remote:
            return
        with self.changed:
            while self.uploaded < self.flushed and self.error is None:
                self.changed.wait()
            if self.error is not None:
                raise self.error

    def close(self) -> None:
        if not self.remote:
            if not self.file.closed:
                self.file.close()
            return
        if self.closed:
            return
        self.flush()
        try:
            self.wait()
        finally:
            with self.changed:
                self.closed = True
                self.changed.notify_all()

    def _upload(self) -> None:
        while True:
            with self.changed:
                while self.uploaded >= self.flushed and not self.closed:
                    self.changed.wait()
                if self.uploaded >= self.flushed:
                    return  # closed, nothing left
                version, data = self.flushed, bytes(self.data)
            try:
                self.target.write_bytes(data)
            except BaseException as e:  # reported by wait()/close(); the thread ends
                with self.changed:
                    self.error = e
                    self.changed.notify_all()
                return
            with self.changed:
                self.uploaded = version
                self.changed.notify_all()


def cache_folder(*parts: str) -> str:
    """A folder under this machine's cache (``~/.cache/flaxformer_lite``, or
    ``FLAXFORMER_CACHE``), created."""
    cache = os.environ.get("FLAXFORMER_CACHE", "~/.cache/flaxformer_lite")
    folder = os.path.join(os.path.expanduser(cache), *parts)
    os.makedirs(folder, exist_ok=True)
    return folder


def local_copy(p: epath.Path, data: bytes | None = None) -> str:
    """A local file holding ``p``'s bytes (``p`` itself where local): for what a
    library opens by file name. A remote file is cached by its content's SHA-256, so
    every process reads one copy and a changed object is read anew."""
    if not is_remote(p):
        return local(p)
    raw = p.read_bytes() if data is None else data
    sha = hashlib.sha256(raw).hexdigest()
    folder = cache_folder("objects", sha[:32])
    file = os.path.join(folder, p.name)
    if not os.path.exists(file):
        fd, tmp = tempfile.mkstemp(dir=folder)
        with os.fdopen(fd, "wb") as f:
            f.write(raw)
        os.replace(tmp, file)
    return file


@contextlib.contextmanager
def staged_folder(target: epath.Path) -> Iterator[str]:
    """A local folder to write what a library writes by file name (a profiler trace),
    copied to ``target`` when the block ends; ``target`` itself where local."""
    if not is_remote(target):
        os.makedirs(local(target), exist_ok=True)
        yield local(target)
        return
    with tempfile.TemporaryDirectory(prefix="flaxformer-stage-") as staging:
        yield staging
        copy_tree(epath.Path(staging), target)


def upload_folder(folder: str, target: epath.Path) -> None:
    """Copy the local ``folder``'s files under ``target``."""
    copy_tree(epath.Path(folder), target)


def save_figure(figure, target: epath.Path, **options) -> None:
    """A matplotlib figure saved to ``target`` (its format from the suffix), whole."""
    buffer = io.BytesIO()
    figure.savefig(buffer, format=target.suffix.lstrip(".") or "png", **options)
    write_atomic(target, buffer.getvalue())
