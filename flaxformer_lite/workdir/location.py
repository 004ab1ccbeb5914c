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

Files and folders at such a location (written whole, replaced, appended, copied to a
local cache) are :mod:`~flaxformer_lite.workdir.storage`'s. Here:

- a bad URL, a missing bucket, no credentials, no permission and an unreachable
  server are each one line (:class:`StorageError`), found by :func:`check` before a
  command writes anything anywhere.

A local GCS server (an emulator) is named by the standard ``STORAGE_EMULATOR_HOST``
alone: :func:`configure` passes it on to tensorstore and gcsfs.
"""

from __future__ import annotations

import functools
import os
import re
import threading
import time

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
