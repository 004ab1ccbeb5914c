"""Token ids on disk: each split tokenized once per (corpus, tokenizer), memory-mapped.

A store is a folder, one pair of flat files per feature (the layout of fairseq's
mmap indexed dataset): ``{feature}.ids``, every example's ids (EOS included) back to
back, and ``{feature}.ends``, int64, where each example ends in it (both read
memory-mapped: a process holds no per-example array of them); plus
``meta.json``, which says what was tokenized (the dataset's identity, the split, the
features, how the texts were turned, the tokenizer's SHA-256) and how many ids each
file holds. Ids are uint16 where the vocabulary fits, else int32.

A store is built in a folder of its own (``NAME.tmp-HOST-PID``) and renamed into place
once complete, so a build killed at any point leaves nothing that is read: the next
run removes the leftover and builds again. A store is read only if its ``meta.json``
names the same key and tokenizer and its files have the sizes it records; a store of
another tokenizer is never read (its key differs, and a mismatch found anyway is
rebuilt). The cache lives under ``data.data_dir/token_cache``, shared by every run on
that corpus with that tokenizer: a resume, a sweep's next seed, every process of a
multi-process run.

Tokenization runs in chunks (sentencepiece encodes a chunk on all cores), so a
build's memory is a chunk's texts, not the corpus.
"""

from __future__ import annotations

import collections
import concurrent.futures
import concurrent.futures.process
import dataclasses
import hashlib
import itertools
import json
import multiprocessing
import os
import pickle
import shutil
import socket
import time
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path

import numpy as np
from absl import logging as absl_logging

from flaxformer_lite.data.tokenizer import EOS_ID, Tokenizer

VERSION = 1
CACHE_DIR = "token_cache"
CHUNK = 32_768  # texts per sentencepiece call
META = "meta.json"


class TokenCacheError(ValueError):
    """The token cache cannot be written or read; the message names the folder and the fix."""


@dataclasses.dataclass(frozen=True)
class View:
    """How a split's rows become the texts tokenized: ``swap`` reverses the columns
    (target -> source, ``data.reverse_tag``), ``prefix`` goes before the first
    (a data tag, e.g. ``"<dict> "``)."""

    swap: bool = False
    prefix: str = ""

    def apply(self, row: tuple[str, ...]) -> tuple[str, ...]:
        cols = row[::-1] if self.swap else row
        return (self.prefix + cols[0], *cols[1:]) if self.prefix else tuple(cols)


class Store:
    """Examples as token ids in flat arrays: ``ids[key]`` back to back and ``ends[key]``
    (where each example ends: example ``i`` is ``ids[ends[i-1]:ends[i]]``, from 0 for
    the first). Both may be memory-mapped: pages shared by every process on the host."""

    def __init__(self, keys: Sequence[str], ids: dict, ends: dict, name: str = "memory"):
        self.keys = tuple(keys)
        self.ids, self.ends, self.name = ids, ends, name
        self.n = len(ends[self.keys[0]])

    def __len__(self) -> int:
        return self.n

    def bounds(self, key: str, rows: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """(start, stop) in ``ids[key]`` of examples ``rows``."""
        ends = self.ends[key]
        stop = np.asarray(ends[rows], np.int64)
        start = np.where(rows > 0, ends[np.maximum(rows - 1, 0)], 0).astype(np.int64)
        return start, stop

    def lengths(self, key: str | None = None) -> np.ndarray:
        """Token counts (int32): of ``key``, else ``[n, keys]``; read in slices, so that
        a memory-mapped store's offsets are never copied whole."""
        if key is None:
            return np.stack([self.lengths(k) for k in self.keys], axis=1)
        ends, out, step = self.ends[key], np.empty(self.n, np.int32), 1 << 20
        previous = 0
        for a in range(0, self.n, step):
            chunk = np.asarray(ends[a : a + step], np.int64)
            out[a : a + len(chunk)] = np.diff(chunk, prepend=previous)
            previous = int(chunk[-1])
        return out

    def example(self, i: int) -> dict[str, np.ndarray]:
        out = {}
        for k in self.keys:
            start, stop = self.bounds(k, np.array([i]))
            out[k] = np.asarray(self.ids[k][int(start[0]) : int(stop[0])], np.int32)
        return out

    @classmethod
    def from_examples(cls, examples: Sequence[dict[str, np.ndarray]]) -> Store:
        """An in-memory store of ``examples`` (dicts of id arrays, the same keys each)."""
        keys = tuple(examples[0])
        ids, ends = {}, {}
        for k in keys:
            lengths = np.fromiter((len(e[k]) for e in examples), np.int64, len(examples))
            ends[k] = np.cumsum(lengths)
            ids[k] = np.concatenate([np.asarray(e[k], np.int32) for e in examples])
        return cls(keys, ids, ends)

    @classmethod
    def from_lists(cls, keys: Sequence[str], columns: Sequence[list[list[int]]]) -> Store:
        """A store of per-feature lists of id lists (each ending in EOS)."""
        ids, ends = {}, {}
        for k, column in zip(keys, columns, strict=True):
            lengths = np.fromiter(map(len, column), np.int64, len(column))
            ends[k] = np.cumsum(lengths)
            total = int(ends[k][-1]) if len(column) else 0
            ids[k] = np.fromiter(itertools.chain.from_iterable(column), np.int32, total)
        return cls(keys, ids, ends)


def _encode(tokenizer: Tokenizer, texts: list[str], column: int = 0) -> list[list[int]]:
    """Ids (+EOS) of ``texts``, the ``column``-th feature (0: source, 1: target)."""
    if not hasattr(tokenizer, "ids"):  # a stand-in tokenizer (tests): its own encode
        return [list(map(int, tokenizer.encode(t))) for t in texts]
    ids = tokenizer.side(column).ids(texts)
    for x in ids:
        x.append(EOS_ID)
    return ids


def tokenize_rows(
    rows: Iterable[tuple[str, ...]], keys: Sequence[str], tokenizer: Tokenizer
) -> Store:
    """An in-memory store of ``rows`` (a text per key), for small splits and tests."""
    rows = list(rows)
    columns = [_encode(tokenizer, list(c), i) for i, c in enumerate(zip(*rows, strict=True))]
    if not rows:
        return Store(
            keys, {k: np.zeros(0, np.int32) for k in keys}, {k: np.zeros(0, np.int64) for k in keys}
        )
    return Store.from_lists(keys, columns)


def _encode_chunk(rows, start, stop, keys, view, tokenizer, dtype) -> list[tuple]:
    """(flat ids, lengths) per key of rows ``start:stop``."""
    texts = [view.apply(r) for r in rows(start, stop)]
    out = []
    for i, column in enumerate(zip(*texts, strict=True)):
        encoded = _encode(tokenizer, list(column), i)
        lengths = np.fromiter(map(len, encoded), np.int64, len(encoded))
        flat = np.fromiter(itertools.chain.from_iterable(encoded), dtype, lengths.sum())
        out.append((flat, lengths))
    return out if texts else [(np.zeros(0, dtype), np.zeros(0, np.int64)) for _ in keys]


_WORKER: dict = {}


def _worker_init(tokenizer_path: str, verbosity: int) -> None:
    """A worker's tokenizer, and its parent's absl verbosity: a spawned process starts
    at WARNING, and TFDS warns of its custom builder config each time a chunk's reader
    opens the corpus (a line per chunk that the command line had silenced)."""
    os.environ.setdefault("JAX_PLATFORMS", "cpu")
    absl_logging.set_verbosity(verbosity)
    _WORKER["tokenizer"] = Tokenizer.load(tokenizer_path)


def _worker_chunk(args) -> list[tuple]:
    rows, start, stop, keys, view, dtype = args
    return _encode_chunk(rows, start, stop, keys, view, _WORKER["tokenizer"], dtype)


def _chunks(rows, count, keys, view, tokenizer, dtype, workers):
    """Each chunk's (flat ids, lengths) per key, in order."""
    spans = [(a, min(a + CHUNK, count)) for a in range(0, count, CHUNK)]
    parallel = workers > 1 and len(spans) >= 4 and getattr(tokenizer, "path", None)
    if parallel:
        try:
            pickle.dumps(rows)
        except (pickle.PicklingError, TypeError, AttributeError):
            parallel = False
    done = 0  # spans yielded so far
    if parallel:
        try:
            for chunk in _parallel_chunks(rows, spans, keys, view, tokenizer, dtype, workers):
                yield chunk
                done += 1
        except (RuntimeError, OSError, concurrent.futures.process.BrokenProcessPool) as e:
            # e.g. a script without `if __name__ == "__main__":`, which spawned workers
            # run again: the rest in this process
            print(f"token cache: worker processes failed ({e}); tokenizing in this process")
    for a, b in spans[done:]:
        yield _encode_chunk(rows, a, b, keys, view, tokenizer, dtype)


def _parallel_chunks(rows, spans, keys, view, tokenizer, dtype, workers):
    # spawn, not fork: the parent may hold JAX's threads
    context = multiprocessing.get_context("spawn")
    with concurrent.futures.ProcessPoolExecutor(
        workers,
        mp_context=context,
        initializer=_worker_init,
        initargs=(str(tokenizer.path), absl_logging.get_verbosity()),
    ) as pool:
        pending = collections.deque()
        for a, b in spans:  # at most 2 chunks a worker in flight: bounded memory
            pending.append(pool.submit(_worker_chunk, (rows, a, b, keys, view, dtype)))
            if len(pending) >= 2 * workers:
                yield pending.popleft().result()
        while pending:
            yield pending.popleft().result()


def file_sha256(path: str | Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def cache_key(
    identity: dict, split: str, keys: Sequence[str], view: View, tokenizer_sha: str
) -> str:
    described = {
        "version": VERSION,
        "dataset": identity,
        "split": split,
        "keys": list(keys),
        "view": dataclasses.asdict(view),
        "tokenizer": tokenizer_sha,
    }
    return hashlib.sha256(json.dumps(described, sort_keys=True).encode()).hexdigest()


def _dtype(vocab_size: int) -> np.dtype:
    return np.dtype(np.uint16) if vocab_size <= 2**16 else np.dtype(np.int32)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


_HOST = socket.gethostname().replace("-", "_")
STALE_SECONDS = 24 * 3600


def _abandoned(folder: Path) -> bool:
    """A build folder whose writer is gone: a dead process of this host, or untouched
    for a day (another host's, on a shared data_dir, whose processes cannot be asked)."""
    host, _, pid = folder.name.rpartition(".tmp-")[2].rpartition("-")
    if host == _HOST and pid.isdigit():
        return not _alive(int(pid))
    try:
        return time.time() - folder.stat().st_mtime > STALE_SECONDS
    except OSError:
        return False


def open_store(folder: Path, key: str, tokenizer_sha: str) -> Store | None:
    """The complete store in ``folder`` built for ``key`` and this tokenizer, else None."""
    meta_path = folder / META
    if not meta_path.is_file():
        return None
    try:
        meta = json.loads(meta_path.read_text())
    except (OSError, ValueError):
        return None
    if meta.get("key") != key or meta.get("tokenizer") != tokenizer_sha:
        return None
    dtype = np.dtype(meta["dtype"])
    ids, ends = {}, {}
    for k in meta["keys"]:
        id_path, end_path = folder / f"{k}.ids", folder / f"{k}.ends"
        count, n = meta["ids"][k], meta["examples"]
        if (
            not id_path.is_file()
            or not end_path.is_file()
            or id_path.stat().st_size != count * dtype.itemsize
            or end_path.stat().st_size != n * 8
        ):
            return None
        ids[k] = np.memmap(id_path, dtype, "r", shape=(count,)) if count else np.zeros(0, dtype)
        ends[k] = np.memmap(end_path, np.int64, "r", shape=(n,)) if n else np.zeros(0, np.int64)
    return Store(meta["keys"], ids, ends, name=str(folder))


def cached_store(
    root: Path,
    name: str,
    key: str,
    *,
    rows: Callable[[int, int], list[tuple[str, ...]]],
    count: int,
    keys: Sequence[str],
    view: View,
    tokenizer: Tokenizer,
    tokenizer_sha: str,
    describe: dict,
    workers: int = 1,
) -> Store:
    """The store of ``count`` rows (``rows(start, stop)`` reads them) seen through
    ``view``, read from ``root/name`` if it was built for ``key``, else built there:
    by ``workers`` processes where ``rows`` can be pickled and there are chunks enough
    (reading the records is most of the work), else in this process."""
    folder = root / name
    store = open_store(folder, key, tokenizer_sha)
    if store is not None:
        return store
    try:
        root.mkdir(parents=True, exist_ok=True)
        for old in root.glob(f"{name}.tmp-*"):  # a build killed before its rename
            if _abandoned(old):
                shutil.rmtree(old, ignore_errors=True)
        tmp = root / f"{name}.tmp-{_HOST}-{os.getpid()}"
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir()
    except OSError as e:
        raise TokenCacheError(
            f"cannot write the token cache in {root} ({e.strerror}); make data.data_dir "
            "writable or point --config.data.data_dir at a writable folder"
        ) from None
    if folder.exists():
        print(f"token cache: {folder} is incomplete or of another tokenizer; building it again")
    started = time.perf_counter()
    dtype = _dtype(tokenizer.vocab_size)
    totals = dict.fromkeys(keys, 0)
    try:
        files = {k: (open(tmp / f"{k}.ids", "wb"), open(tmp / f"{k}.ends", "wb")) for k in keys}
        try:
            for chunk in _chunks(rows, count, keys, view, tokenizer, dtype, workers):
                for k, (flat, lengths) in zip(keys, chunk, strict=True):
                    ends = totals[k] + np.cumsum(lengths, dtype=np.int64)
                    totals[k] = int(ends[-1]) if len(ends) else totals[k]
                    id_file, end_file = files[k]
                    id_file.write(flat.tobytes())
                    end_file.write(ends.tobytes())
        finally:
            for id_file, end_file in files.values():
                id_file.close()
                end_file.close()
        meta = {
            "key": key,
            "tokenizer": tokenizer_sha,
            "keys": list(keys),
            "examples": count,
            "ids": totals,
            "dtype": dtype.name,
            "view": dataclasses.asdict(view),
            **describe,
        }
        meta_tmp = tmp / (META + ".tmp")
        meta_tmp.write_text(json.dumps(meta, indent=1))
        os.replace(meta_tmp, tmp / META)
        if folder.exists():
            if open_store(folder, key, tokenizer_sha) is not None:  # another process's
                shutil.rmtree(tmp, ignore_errors=True)
                return open_store(folder, key, tokenizer_sha)
            shutil.rmtree(folder, ignore_errors=True)  # incomplete or another tokenizer's
        os.replace(tmp, folder)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    tokens = sum(totals.values())
    print(
        f"token cache: {count:,} examples, {tokens:,} tokens of {describe.get('split', name)} "
        f"in {time.perf_counter() - started:.0f} s -> {folder}",
        flush=True,
    )
    store = open_store(folder, key, tokenizer_sha)
    assert store is not None, folder
    return store
