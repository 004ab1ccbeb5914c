"""A GCS server on the loopback for the tests (and for trying a bucket by hand).

    python tests/gcs_server.py --port=9023 --bucket=my-bucket [--forbidden=locked-bucket]
    export STORAGE_EMULATOR_HOST=http://127.0.0.1:9023

It is PyPI's ``gcp-storage-emulator`` (GCS's JSON API, in memory) with what the real
service does that the emulator leaves out and the run folder relies on:

- generation preconditions: an upload, delete or read with ``ifGenerationMatch=N``
  (``0``: the object must not exist) or ``ifGenerationNotMatch`` fails with 412 when
  the object's generation says otherwise (the one-writer lock is such an object), and
  a read whose ``ifGenerationNotMatch`` holds the current generation answers 304;
- the generation of what a read returns, in ``x-goog-generation`` (tensorstore's
  checkpoint reads rely on it);
- many clients at once: each connection in its own thread (tensorstore opens dozens),
  requests served one at a time against the store;
- ``--forbidden`` buckets answer every request with 403, as GCS does for an account
  with no role on a bucket.
"""

from __future__ import annotations

import argparse
import logging
import subprocess
import sys
import threading
from functools import partial
from http import HTTPStatus, server
from urllib.parse import unquote, urlparse

from gcp_storage_emulator import server as emulator
from gcp_storage_emulator.exceptions import NotFound
from gcp_storage_emulator.handlers import buckets, objects
from gcp_storage_emulator.storage import Storage

_SERVE = threading.Lock()


def _error(response, status: HTTPStatus, reason: str, message: str) -> None:
    response.status = status
    response.json(
        {"error": {"code": status.value, "message": message,
                   "errors": [{"reason": reason, "message": message}]}}
    )  # fmt: skip


def _generation(storage, bucket: str, name: str) -> int:
    """The object's generation, 0 where it does not exist."""
    try:
        return int(storage.get_file_obj(bucket, name).get("generation") or 0)
    except NotFound:
        return 0


def _object_name(request) -> str | None:
    if "name" in request.query:
        return request.query["name"][0]
    if request.params and request.params.get("object_id"):
        return request.params["object_id"]
    data = request.data
    if isinstance(data, dict):
        meta = data.get("meta") if "meta" in data else data
        if isinstance(meta, dict):
            return meta.get("name")
    return None


def _preconditions_hold(request, response, storage) -> bool:
    """False (and a 412) where ``ifGenerationMatch`` / ``ifGenerationNotMatch`` fail."""
    match = request.query.get("ifGenerationMatch")
    not_match = request.query.get("ifGenerationNotMatch")
    if not match and not not_match:
        return True
    bucket, name = request.params.get("bucket_name"), _object_name(request)
    if not bucket or not name:
        return True
    current = _generation(storage, bucket, name)
    if (match and int(match[0]) != current) or (not_match and int(not_match[0]) == current):
        _error(
            response, HTTPStatus.PRECONDITION_FAILED, "conditionNotMet",
            "At least one of the pre-conditions you specified did not hold.",
        )  # fmt: skip
        return False
    return True


def _guarded(handler):
    def run(request, response, storage, *args, **kwargs):
        if not _preconditions_hold(request, response, storage):
            return None
        return handler(request, response, storage, *args, **kwargs)

    return run


def _downloading(handler):
    """A media download with GCS's generation headers (tensorstore reads the object's
    generation from ``x-goog-generation``) and its conditional reads: 304 where
    ``ifGenerationNotMatch`` names the current generation (a cache still valid)."""

    def run(request, response, storage, *args, **kwargs):
        bucket, name = request.params.get("bucket_name"), request.params.get("object_id")
        current = _generation(storage, bucket, name)
        not_match = request.query.get("ifGenerationNotMatch")
        if current and not_match and int(not_match[0]) == current:
            response.status = HTTPStatus.NOT_MODIFIED
            response["x-goog-generation"] = str(current)
            return None
        if not _preconditions_hold(request, response, storage):
            return None
        if current:
            obj = storage.get_file_obj(bucket, name)
            response["x-goog-generation"] = str(current)
            response["x-goog-metageneration"] = str(obj.get("metageneration", 1))
            response["x-goog-stored-content-length"] = str(obj.get("size", 0))
        return handler(request, response, storage, *args, **kwargs)

    return run


def _with_preconditions() -> None:
    """Uploads, deletes and downloads honour generation preconditions, on every route
    that names them."""
    replaced = {objects.insert: _guarded(objects.insert), objects.delete: _guarded(objects.delete),
                objects.xml_upload: _guarded(objects.xml_upload),
                objects.download: _downloading(objects.download)}  # fmt: skip
    emulator.HANDLERS = tuple(
        (regex, {m: replaced.get(h, h) for m, h in handlers.items()})
        for regex, handlers in emulator.HANDLERS
    )
    objects.insert = replaced[objects.insert]  # the router's fallback for bare uploads
    objects.download = replaced[objects.download]  # objects.get's call for alt=media


class Router(emulator.Router):
    forbidden: frozenset[str] = frozenset()

    def handle(self, method):
        bucket = _bucket_of(self._request_handler.path)
        if bucket in self.forbidden:
            response = emulator.Response(self._request_handler)
            _error(
                response, HTTPStatus.FORBIDDEN, "forbidden",
                f"caller does not have storage.objects.list access to the Google Cloud "
                f"Storage bucket. Permission 'storage.objects.list' denied on resource "
                f"(or it may not exist). ({bucket})",
            )  # fmt: skip
            response.close()
            return
        with _SERVE:
            super().handle(method)


def _bucket_of(raw_path: str) -> str | None:
    parts = [unquote(p) for p in urlparse(raw_path).path.split("/") if p]
    if "b" in parts:
        i = parts.index("b")
        return parts[i + 1] if i + 1 < len(parts) else None
    return parts[0] if parts else None


class Handler(emulator.RequestHandler):
    def _route(self, method):
        Router(self).handle(method)

    def do_GET(self):
        self._route(emulator.GET)

    def do_POST(self):
        self._route(emulator.POST)

    def do_DELETE(self):
        self._route(emulator.DELETE)

    def do_PUT(self):
        self._route(emulator.PUT)

    def do_PATCH(self):
        self._route(emulator.PATCH)


class _Server(server.ThreadingHTTPServer):
    daemon_threads = True
    request_queue_size = 128

    def handle_error(self, request, client_address):
        """A client that went away mid-request (a run killed by a test) is not an error."""
        if isinstance(sys.exc_info()[1], ConnectionError):
            return
        super().handle_error(request, client_address)


def serve(host: str, port: int, buckets_: list[str], forbidden: list[str]) -> None:
    _with_preconditions()
    Router.forbidden = frozenset(forbidden)
    storage = Storage(use_memory_fs=True)
    for name in [*buckets_, *forbidden]:
        buckets.create_bucket(name, storage)
    httpd = _Server((host, port), partial(Handler, storage))
    print(f"serving http://{host}:{httpd.server_address[1]}", flush=True)
    httpd.serve_forever()


def start(buckets_: list[str], forbidden: list[str] = ()) -> tuple[subprocess.Popen, str]:
    """The server in a process of its own on a free port of the loopback (the caller
    stops it): (its process, its URL for STORAGE_EMULATOR_HOST)."""
    command = [sys.executable, __file__, "--port=0"]
    command += [f"--bucket={b}" for b in buckets_] + [f"--forbidden={b}" for b in forbidden]
    process = subprocess.Popen(command, stdout=subprocess.PIPE, text=True)
    line = process.stdout.readline().strip()  # "serving http://127.0.0.1:PORT"
    if not line.startswith("serving "):
        process.kill()
        raise RuntimeError(f"the GCS server did not start: {line!r}")
    return process, line.split()[-1]


def main(argv: list[str]) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=9023)
    parser.add_argument("--bucket", action="append", default=[], help="create this bucket")
    parser.add_argument("--forbidden", action="append", default=[], help="a bucket that 403s")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.CRITICAL)
    serve(args.host, args.port, args.bucket, args.forbidden)


if __name__ == "__main__":
    main(sys.argv[1:])
