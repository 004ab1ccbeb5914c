"""Where a run lives: a local folder or a ``gs://BUCKET/PATH`` prefix, as one path type.

Every layer asks :func:`path` for a run folder (``--workdir``, ``--out``, a sweep's
folder, ``data.data_dir``) and joins names with ``/``; nobody builds run paths with
``pathlib.Path``, which reads ``gs://b/x`` as the local folder ``gs:/b/x``.

Why ``etils.epath``: it is the path type orbax (checkpoints), JAX's persistent
compilation cache and TFDS already take, so one value travels to all three. For
``gs://`` it goes through fsspec's ``gcsfs`` (no TensorFlow); orbax's arrays go through
tensorstore's own ``gcs`` driver; TensorBoard's writer (tensorboardX) writes its event
files with ``google-cloud-storage``, which :mod:`~flaxformer_lite.workdir.lock` also
uses for the one-writer lock (an object created with a generation precondition).

What object storage changes, handled here:

- no rename: a file is written whole by one upload (:func:`write_atomic`: locally a
  temporary file and ``os.replace``), a folder is swapped in object by object
  (:func:`replace_folder`), and an appended log is re-uploaded whole
  (:class:`AppendFile`);
- nothing runs from the bucket: code or a model a library opens by file name is
  read into a local cache first (:func:`local_copy`);
- a bad URL, a missing bucket, no credentials, no permission and an unreachable
  server are each one line (:class:`StorageError`), found by :func:`check` before a
  command writes anything anywhere.

A local GCS server (an emulator) is named by the standard ``STORAGE_EMULATOR_HOST``
alone: :func:`configure` passes it on to tensorstore and gcsfs.
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import io
import os
import re
import tempfile
import threading
import time
from collections.abc import Iterator

from etils import epath

Path = epath.Path  # the type of every run path (local or remote)

REMOTE = ("gs",)  # schemes a run folder may use
_URL = re.compile(r"^([A-Za-z][A-Za-z0-9+.-]*):(/*)(.*)$")
_BUCKET = re.compile(r"^[a-z0-9][a-z0-9._-]{1,61}[a-z0-9]$")
TRIES = 3  # reaching the server: tries before an unreachable endpoint is reported


class StorageError(OSError):
    """A storage location that cannot be used; the message names it and the fix."""

    def __init__(self, message: str):
        super().__init__(message)

    def __str__(self) -> str:
        return self.args[0]


def path(where: str | os.PathLike, what: str = "--workdir") -> epath.Path:
    """``where`` as a run path: a local path as given, or a checked ``gs://BUCKET/PATH``
    (``what`` names the flag or field in the message of a malformed URL)."""
    if isinstance(where, epath.Path):
        return where
    text = os.fspath(where)
    match = _URL.match(text)
    if match is None or len(match.group(1)) == 1:  # no scheme (a drive letter is none)
        return epath.Path(text)
    scheme, slashes, rest = match.groups()
    scheme = scheme.lower()
    if scheme not in REMOTE:
        raise StorageError(
            f"{what}={text}: {scheme}:// is not a storage this codebase writes; use a local "
            "path or gs://BUCKET/PATH"
        )
    bucket = rest.split("/", 1)[0]
    if slashes != "//" or not bucket:
        raise StorageError(
            f"{what}={text} is not a bucket URL; write {scheme}://BUCKET/PATH (two slashes, "
            "then the bucket's name)"
        )
    if not _BUCKET.match(bucket):
        raise StorageError(
            f"{what}={text}: {bucket!r} is not a valid bucket name (3-63 lowercase letters, "
            f"digits, '-', '_' or '.'); write {scheme}://BUCKET/PATH"
        )
    configure()
    return epath.Path(f"{scheme}://{rest.rstrip('/')}")


def is_remote(p: str | os.PathLike) -> bool:
    """Whether ``p`` names object storage (``gs://``), not a local path."""
    text = os.fspath(p)
    return any(text.startswith(f"{s}://") for s in REMOTE)


def local(p: str | os.PathLike) -> str:
    """A local path's string, with ``~`` expanded; remote paths as they are."""
    text = os.fspath(p)
    return text if is_remote(text) else os.path.expanduser(text)


def bucket_of(p: str | os.PathLike) -> tuple[str, str]:
    """(bucket, object prefix) of a remote path."""
    rest = os.fspath(p).split("://", 1)[1]
    bucket, _, key = rest.partition("/")
    return bucket, key


# The emulator and the libraries --------------------------------------------------------

_CONFIGURED: dict = {}  # the server configured for, and the variables set for it
_LOCK = threading.Lock()


def emulator() -> str | None:
    """The GCS server named by ``STORAGE_EMULATOR_HOST`` (as a URL), or None."""
    host = os.environ.get("STORAGE_EMULATOR_HOST", "").strip()
    if host in ("", "default"):
        return None
    return host if host.startswith(("http://", "https://")) else f"http://{host}"


def endpoint() -> str:
    return emulator() or "https://storage.googleapis.com"


def configure() -> None:
    """Point tensorstore and gcsfs where ``STORAGE_EMULATOR_HOST`` points, before either
    opens a connection (again if it changed): tensorstore's gcs driver reads its own
    variables and needs a token, and gcsfs's bucket-type probe (a gRPC call to GCS's
    control plane) has no emulator. fsspec's listing cache is off: tensorstore writes
    checkpoints behind gcsfs's back, and a cached listing would hide them."""
    host = emulator()
    with _LOCK:
        if _CONFIGURED and _CONFIGURED["host"] == host:
            return
        for key, value in _CONFIGURED.get("set", {}).items():  # the last server's settings
            if os.environ.get(key) == value:
                del os.environ[key]
        wanted = {}
        if host is not None:
            wanted = {"TENSORSTORE_GCS_HTTP_URL": host, "GOOGLE_AUTH_TOKEN_FOR_TESTING": "emulator",
                      "GCSFS_EXPERIMENTAL_ZB_HNS_SUPPORT": "false"}  # fmt: skip
        set_now = {k: v for k, v in wanted.items() if k not in os.environ}
        os.environ.update(set_now)
        import fsspec.config

        options = fsspec.config.conf.setdefault("gs", {})
        options.setdefault("use_listings_cache", False)
        if host is not None:
            options.setdefault("token", "anon")
        elif options.get("token") == "anon" and _CONFIGURED.get("host"):
            del options["token"]
        _CONFIGURED.update(host=host, set=set_now)


def client():
    """A google-cloud-storage client for the server in use (the emulator's where one is
    named; else GCS with the machine's credentials), made once; or a StorageError."""
    configure()
    return _client(emulator())


@functools.lru_cache(maxsize=4)
def _client(host: str | None):
    try:
        from google.cloud import storage
    except ImportError:
        raise StorageError(
            "gs:// needs google-cloud-storage and gcsfs: pip install gcsfs (a dependency of "
            "flaxformer_lite: reinstall it)"
        ) from None
    if host is None:
        import google.auth
        from google.auth.exceptions import DefaultCredentialsError

        try:
            google.auth.default()
        except DefaultCredentialsError:
            raise StorageError(
                "no Google Cloud credentials for gs://: run `gcloud auth application-default "
                "login`, or set GOOGLE_APPLICATION_CREDENTIALS to a service account's key file "
                "(a TPU VM or GCE machine uses its own service account); for a local server "
                "set STORAGE_EMULATOR_HOST"
            ) from None
    return storage.Client()


def check(p: str | os.PathLike, what: str = "--workdir") -> epath.Path:
    """``p`` as a run path, and for a remote one: credentials, the server reached
    (:data:`TRIES` tries with backoff), the bucket there and listable. Called before a
    command writes anything, so a bad location leaves nothing behind anywhere."""
    where = path(p, what)
    if not is_remote(where):
        return where
    bucket, key = bucket_of(where)
    from google.api_core import exceptions

    gcs = client()
    error: Exception | None = None
    for attempt in range(TRIES):
        try:
            list(gcs.list_blobs(bucket, prefix=key, max_results=1, timeout=10, retry=None))
            return where
        except exceptions.NotFound:
            raise StorageError(
                f"{what}={where}: the bucket {bucket!r} does not exist at {endpoint()}; create "
                f"it (gcloud storage buckets create gs://{bucket}) or fix the name"
            ) from None
        except exceptions.Forbidden as e:
            raise StorageError(
                f"{what}={where}: no permission to read gs://{bucket} ({_reason(e)}); grant "
                "this account a storage role on the bucket (e.g. roles/storage.objectUser), or "
                "use a bucket it can write"
            ) from None
        except exceptions.Unauthorized as e:
            raise StorageError(
                f"{what}={where}: the server refused the credentials ({_reason(e)}); run "
                "`gcloud auth application-default login` again"
            ) from None
        except Exception as e:  # connection refused, a timeout, a reset: try again
            error = e
            if attempt + 1 < TRIES:
                time.sleep(0.5 * 2**attempt)
    raise StorageError(
        f"{what}={where}: cannot reach the storage server {endpoint()} after {TRIES} tries "
        f"({_reason(error)}); check the network"
        + (" and STORAGE_EMULATOR_HOST" if emulator() else "")
    )


def _reason(error: BaseException | None) -> str:
    """The cause in a few words: the connection's fate, or the server's own message
    (without the request line the client puts before it)."""
    seen = error
    while seen is not None:
        if isinstance(seen, ConnectionRefusedError) or "Connection refused" in str(seen):
            return "connection refused"
        if isinstance(seen, TimeoutError) or "timed out" in str(seen).lower():
            return "timed out"
        seen = seen.__cause__ or seen.__context__
    text = str(getattr(error, "message", None) or error or "").strip()
    text = re.sub(r"^[A-Z]+ \S+: ", "", text.splitlines()[0] if text else "")
    return (text or type(error).__name__)[:160]


# Files and folders --------------------------------------------------------------------


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
