"""A data folder in a bucket (``data.data_dir=gs://BUCKET/tfds``) and a corpus there
(``data.dataset=files:gs://BUCKET/corpus``): kept once, read by every host.

array_record (the format TFDS writes here) and the token cache's memory maps read
local files only, so a bucket's data folder stands for a local one in this machine's
cache (``~/.cache/flaxformer_lite/data/<a hash of the URL>``). A dataset prepared in
the bucket is copied here on first use (:func:`fetch`); one prepared here (a Debian
corpus, a ``files:`` corpus, a generated task, a token cache) is copied there once
complete (:func:`publish`), so that the next host, or a fresh machine, finds it. A
folder counts as complete when its marker is there: TFDS writes ``dataset_info.json``
last, the token cache ``meta.json``; both are copied last.

A corpus of files in a bucket is copied the same way before it is read
(:func:`local_corpus`); its content fingerprint, which names its build, does not
depend on where the files are.
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import json
import os
from collections.abc import Iterator

from flaxformer_lite.workdir import location, storage

TFDS_MARKER = "dataset_info.json"


def local_root(data_dir) -> str:
    """The local folder that stands for ``data_dir`` (itself, where local)."""
    if not location.is_remote(data_dir):
        return location.local(data_dir)
    return _cached_root(str(location.path(data_dir, "data.data_dir")))


@functools.lru_cache(maxsize=8)
def _cached_root(url: str) -> str:
    location.check(url, "data.data_dir")  # once per process: a bad bucket in one line
    return storage.cache_folder("data", hashlib.sha256(url.encode()).hexdigest()[:16])


def _relative(data_dir, folder: str) -> str:
    return os.path.relpath(os.path.abspath(folder), os.path.abspath(local_root(data_dir)))


def fetch(data_dir, folder: str, marker: str = TFDS_MARKER) -> bool:
    """Copy ``folder`` (a local path under :func:`local_root`) from the bucket, where
    the bucket holds it complete and this machine does not; whether it did."""
    if not location.is_remote(data_dir) or os.path.exists(os.path.join(folder, marker)):
        return False
    remote = location.path(data_dir) / _relative(data_dir, folder)
    if not (remote / marker).exists():
        return False
    storage.copy_tree(remote, location.path(folder), last=(marker,))
    return True


def publish(data_dir, folder: str, marker: str = TFDS_MARKER) -> bool:
    """Copy the complete local ``folder`` to the bucket, where it is not yet; whether
    it did."""
    if not location.is_remote(data_dir) or not os.path.exists(os.path.join(folder, marker)):
        return False
    remote = location.path(data_dir) / _relative(data_dir, folder)
    if (remote / marker).exists():
        return False
    storage.copy_tree(location.path(folder), remote, last=(marker,))
    return True


@contextlib.contextmanager
def corpus_copy(url: str, error: type[Exception]) -> Iterator[str]:
    """:func:`local_corpus` of ``url``, with the messages of ``error`` raised meanwhile
    naming the bucket's files rather than their copies."""
    copy = local_corpus(url)
    try:
        yield copy
    except error as e:
        raise error(str(e).replace(copy, url.rstrip("/"))) from None


STAMPS = ".stamps.json"  # a local copy's record of each file's size and time there


def local_corpus(url: str) -> str:
    """A copy of the corpus file or (flat) folder at ``url`` in this machine's cache; a
    file is fetched again only where its size or time in the bucket changed."""
    remote = location.check(url, "data.dataset=files")
    folder = storage.cache_folder("corpora", hashlib.sha256(url.encode()).hexdigest()[:16])
    if not remote.exists():
        raise FileNotFoundError(f"data.dataset=files:{url}: no such file or folder")
    if not remote.is_dir():
        _copy_if_changed(remote, folder)
        return os.path.join(folder, remote.name)
    for entry in remote.iterdir():
        if not entry.is_dir():
            _copy_if_changed(entry, folder)
    return folder


def _copy_if_changed(remote, folder: str) -> None:
    stamps_file = os.path.join(folder, STAMPS)
    stamps = json.load(open(stamps_file)) if os.path.exists(stamps_file) else {}
    stat = remote.stat()
    stamp = [stat.length, stat.mtime]
    target = os.path.join(folder, remote.name)
    if stamps.get(remote.name) == stamp and os.path.exists(target):
        return
    storage.write_atomic(location.path(target), remote.read_bytes())
    stamps[remote.name] = stamp
    storage.write_atomic(location.path(stamps_file), json.dumps(stamps))
