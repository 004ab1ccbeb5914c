"""A researcher's own corpus as a dataset: ``data.dataset=files:PATH``.

  python -m flaxformer_lite.main --config=configs/ding_mini.py --workdir=runs/mine \\
      --config.data.dataset=files:corpus --config.data.source_lang=en \\
      --config.data.target_lang=de

PATH is a folder or one file:

- parallel text, line-aligned files per language (the OPUS/Moses layout):
  ``train.en`` + ``train.de``, ``validation`` (or ``valid``, ``dev``), ``test``;
- TSV, ``train.tsv`` (and the other splits) or PATH itself a ``.tsv`` file (train):
  the columns named by a header line that holds the languages, else the source
  language first and the target second;
- plain text for a language model (``data.task=lm``): ``train.txt`` (or
  ``train.<lang>``), a line per example, or running text with ``data.stream``.

Any file may be gzipped (``train.en.gz``). The corpus is written once as
array_record through a TFDS builder under ``data.data_dir/local_files/`` and read
with TFDS data sources, as the built-in corpora are; it is built again only when the
files' content changes (its fingerprint, a SHA-256 of their bytes and roles, names
the build). A split given by no file (validation, test) is carved off train by a
hash of each pair: the pairs of the smallest hashes, 1% of train (at least 100 and
at most 2,000, at most a tenth), the same on every machine; a note says how many.
"""

from __future__ import annotations

import dataclasses
import gzip
import hashlib
import json
import os
import shutil
import time
from collections.abc import Iterator, Sequence
from pathlib import Path

import numpy as np
import tensorflow_datasets as tfds

from flaxformer_lite.data import progress, shared, tfds_spill
from flaxformer_lite.workdir import location

PREFIX = "files:"
SPLITS = {"train": ("train",), "validation": ("validation", "valid", "dev"), "test": ("test",)}
CARVED_SHARE, CARVED_MIN, CARVED_MAX = 0.01, 100, 2000
KEY_RANGE = 2**128  # TFDS's example keys (shuffle.HKEY_SIZE bits)


class CorpusError(ValueError):
    """A user's corpus cannot be read as given; the message names the file and the fix."""


def is_files(dataset: str) -> bool:
    return dataset.startswith(PREFIX)


def check_not_a_bare_path(dataset: str) -> None:
    """A file or folder given as ``data.dataset`` without ``files:`` (the first thing a
    user types) is named with the fix, instead of reaching TFDS as a builder name."""
    if "://" in dataset:
        raise CorpusError(
            f"data.dataset={dataset}: a corpus of your own files (in a bucket too) is named "
            f"--config.data.dataset=files:{dataset}"
        )
    path = Path(dataset).expanduser()
    looks_like_path = dataset.startswith(("/", "./", "../", "~")) or dataset in (".", "..")
    if path.exists():
        kind = "a folder" if path.is_dir() else "a file"
        raise CorpusError(
            f"data.dataset={dataset} is {kind}; a corpus of your own files is named "
            f"--config.data.dataset=files:{dataset}"
        )
    if looks_like_path:
        raise CorpusError(
            f"data.dataset={dataset}: no such file or folder (a corpus of your own files "
            f"is named files:PATH, an existing PATH)"
        )


@dataclasses.dataclass(frozen=True)
class Source:
    """Where one split's text comes from: a file per feature (``kind`` 'lines'), or one
    file of all features (``kind`` 'tsv', with the column of each feature)."""

    kind: str
    paths: tuple[str, ...]
    columns: tuple[int, ...] = ()
    header: bool = False


def _find(folder: Path, stem: str, suffix: str) -> Path | None:
    for name in (f"{stem}{suffix}", f"{stem}{suffix}.gz"):
        if (folder / name).is_file():
            return folder / name
    return None


def _open(path: Path):
    return gzip.open(path, "rb") if path.suffix == ".gz" else open(path, "rb")


BOM = "\ufeff"  # what Windows tools put at the start of a UTF-8 file; never text


def _tsv_source(path: Path, features: Sequence[str]) -> Source:
    """The TSV file's columns for ``features``: by its header, else by position; how
    they were chosen is printed once per file, so that a header of other names
    (``src<TAB>tgt``), read as a pair, is seen before a run trains on it."""
    with _open(path) as f:
        first = f.readline()
    if not first:
        raise CorpusError(f"{path} is empty; give it a line per pair")
    line = first.decode("utf-8", errors="replace").rstrip("\r\n").removeprefix(BOM)
    cells = [cell.strip() for cell in line.split("\t")]
    if all(feature in cells for feature in features):
        source = Source("tsv", (str(path),), tuple(cells.index(f) for f in features), True)
        how = "by header: " + ", ".join(
            f"{f} = column {c + 1}" for f, c in zip(features, source.columns, strict=True)
        )
    elif len(cells) < len(features):
        raise CorpusError(
            f"{path} line 1 has {len(cells)} column(s); {len(features)} are needed "
            f"({', '.join(features)}), tab-separated"
        )
    else:
        source = Source("tsv", (str(path),), tuple(range(len(features))))
        how = f"by position: no header names {' and '.join(features)}; " + ", ".join(
            f"column {c + 1} = {f}" for c, f in enumerate(features)
        )
    if (str(path), source.columns) not in _TOLD:
        _TOLD.add((str(path), source.columns))
        print(f"files: {path}: columns {how}", flush=True)
    return source


_TOLD: set = set()  # the TSV files whose columns were printed in this process


def discover(path: str | Path, features: Sequence[str]) -> dict[str, Source]:
    """The splits the files at ``path`` give, for ``features`` (the source and target
    languages, or the one language of a language model); a corpus in a bucket
    (``gs://``) is read from its copy in this machine's cache, its messages naming the
    bucket's files."""
    if location.is_remote(path):
        with shared.corpus_copy(str(path), CorpusError) as copy:
            return discover(copy, features)
    path = Path(path)
    if not path.exists():
        raise CorpusError(f"data.dataset=files:{path}: no such file or folder")
    if path.is_file():
        if path.name.endswith((".tsv", ".tsv.gz")):
            return {"train": _tsv_source(path, features)}
        if len(features) == 1:
            return {"train": Source("lines", (str(path),))}
        raise CorpusError(
            f"data.dataset=files:{path} is one file of plain text; a translation corpus is "
            f"a folder of line-aligned files (train.{features[0]} + train.{features[1]}) or "
            "a .tsv file"
        )
    found = {}
    for split, stems in SPLITS.items():
        for stem in stems:
            per_feature = [_find(path, stem, f".{f}") for f in features]
            if all(per_feature):
                found[split] = Source("lines", tuple(str(p) for p in per_feature))
            elif any(per_feature):
                have = next(p for p in per_feature if p)
                missing = [
                    f"{stem}.{f}" for f, p in zip(features, per_feature, strict=True) if not p
                ]
                raise CorpusError(
                    f"{have} has no partner in {path}: {', '.join(missing)} is missing "
                    "(line-aligned files come one per language)"
                )
            elif tsv := _find(path, stem, ".tsv"):
                found[split] = _tsv_source(tsv, features)
            elif len(features) == 1 and (txt := _find(path, stem, ".txt")):
                found[split] = Source("lines", (str(txt),))
            if split in found:
                break
    if "train" not in found:
        wanted = " + ".join(f"train.{f}" for f in features)
        raise CorpusError(
            f"no training split in {path}: expected {wanted}, train.tsv"
            + (" or train.txt" if len(features) == 1 else "")
            + " (.gz too)"
        )
    return found


def _lines(path: str) -> Iterator[str]:
    """The lines of a file, decoded, with one clear error for bytes that are not UTF-8;
    a byte-order mark at the file's start is dropped (as ``utf-8-sig`` does)."""
    with _open(Path(path)) as f:
        for number, raw in enumerate(f, 1):
            try:
                line = raw.decode("utf-8").rstrip("\r\n")
                yield line.removeprefix(BOM) if number == 1 else line
            except UnicodeDecodeError as e:
                raise CorpusError(
                    f"{path} line {number} is not UTF-8 ({e.reason} at byte {e.start}); "
                    "convert the file (e.g. iconv -f latin1 -t utf-8)"
                ) from None


def _count_lines(path: str) -> int:
    """Lines in a file (a last line without a newline counts), read in blocks."""
    count, last = 0, b"\n"
    with _open(Path(path)) as f:
        for block in iter(lambda: f.read(1 << 22), b""):
            count += block.count(b"\n")
            last = block[-1:]
    return count + (last != b"\n")


def iter_source(source: Source) -> Iterator[tuple[str, ...]]:
    """The rows (a text per feature) of one split's files, checked as they are read:
    a file at a time, never the whole corpus in memory."""
    if source.kind == "tsv":
        (path,) = source.paths
        width = None
        rows = 0
        for number, line in enumerate(_lines(path), 1):
            cells = line.split("\t")
            width = width or len(cells)
            if number == 1 and source.header:
                continue
            if len(cells) != width:
                raise CorpusError(
                    f"{path} line {number} has {len(cells)} tab-separated column(s), the "
                    f"first line {width}; every line needs the same columns"
                )
            rows += 1
            yield tuple(cells[c] for c in source.columns)
    else:
        counts = [_count_lines(p) for p in source.paths]
        if len(set(counts)) > 1:
            sizes = ", ".join(f"{p} has {n:,}" for p, n in zip(source.paths, counts, strict=True))
            raise CorpusError(
                f"line-aligned files differ in length: {sizes} lines; they need one line "
                "per pair, in the same order"
            )
        rows = counts[0]
        yield from zip(*(_lines(p) for p in source.paths), strict=True)
    if not rows:
        raise CorpusError(f"{', '.join(source.paths)}: empty; give it a line per example")


def read_source(source: Source) -> list[tuple[str, ...]]:
    """The rows of one split's files, checked (:func:`iter_source`), as a list."""
    return list(iter_source(source))


def fingerprint(splits: dict[str, Source]) -> str:
    """A SHA-256 of the files' bytes and of how they are read (splits, columns); read
    once per process while the files keep their size and modification time."""
    stats = tuple(
        (p, os.stat(p).st_size, os.stat(p).st_mtime_ns) for s in splits.values() for p in s.paths
    )
    key = (json.dumps({k: dataclasses.asdict(v) for k, v in sorted(splits.items())}), stats)
    if key not in _FINGERPRINTS:
        _FINGERPRINTS[key] = _content_fingerprint(splits)
    return _FINGERPRINTS[key]


_FINGERPRINTS: dict = {}


def _content_fingerprint(splits: dict[str, Source]) -> str:
    digest = hashlib.sha256()
    for split, source in sorted(splits.items()):
        described = dataclasses.asdict(source) | {"split": split, "paths": None}
        digest.update(json.dumps(described, sort_keys=True).encode())
        for path in source.paths:
            with open(path, "rb") as f:
                for block in iter(lambda: f.read(1 << 20), b""):
                    digest.update(block)
    return digest.hexdigest()


def _pair_hashes(rows) -> np.ndarray:
    """A 64-bit BLAKE2b hash of each row (its texts joined by a tab)."""
    return np.fromiter(
        (
            int.from_bytes(hashlib.blake2b("\t".join(r).encode(), digest_size=8).digest(), "big")
            for r in rows
        ),
        dtype=np.uint64,
    )


def carve_indices(hashes: np.ndarray, missing: Sequence[str]) -> dict[str, np.ndarray]:
    """For each ``missing`` split (in order), the sorted indices of the train rows it
    takes: the smallest ``hashes`` first, ``CARVED_SHARE`` of train each (bounded)."""
    if not missing:
        return {}
    n = len(hashes)
    size = int(min(max(CARVED_MIN, n * CARVED_SHARE), CARVED_MAX, n // 10))
    if size < 1:
        raise CorpusError(
            f"{n} training pairs are too few to carve {' and '.join(missing)} off "
            "(at least 10 are needed); give those splits as files"
        )
    order = np.argsort(hashes, kind="stable")
    return {name: np.sort(order[i * size : (i + 1) * size]) for i, name in enumerate(missing)}


def carve(train: list, missing: Sequence[str]) -> tuple[list, dict[str, list]]:
    """``missing`` splits (in order) off ``train`` by the pairs' hashes
    (:func:`carve_indices`); the rest stays in order."""
    taken = carve_indices(_pair_hashes(train), missing)
    if not taken:
        return train, {}
    out = set(int(i) for chunk in taken.values() for i in chunk)
    rest = [row for i, row in enumerate(train) if i not in out]
    return rest, {name: [train[i] for i in chunk] for name, chunk in taken.items()}


@dataclasses.dataclass
class FilesConfig(tfds.core.BuilderConfig):
    """One corpus of files: its features and, per split, where the text comes from."""

    features: tuple[str, ...] = ()
    splits_json: str = "{}"


class LocalFiles(tfds.core.GeneratorBasedBuilder):
    """A user's corpus of text files, one builder config per content fingerprint."""

    VERSION = tfds.core.Version("1.0.0")
    RELEASE_NOTES = {"1.0.0": "Line-aligned files, TSV or plain text; missing splits carved."}

    def _info(self) -> tfds.core.DatasetInfo:
        features = self.builder_config.features
        return tfds.core.DatasetInfo(
            builder=self,
            description=__doc__,
            features=tfds.features.FeaturesDict({f: tfds.features.Text() for f in features}),
            disable_shuffling=True,  # file order: data.stream reads it as running text
        )

    def _split_generators(self, dl_manager):
        splits = {k: Source(**v) for k, v in json.loads(self.builder_config.splits_json).items()}
        missing = [name for name in ("validation", "test") if name not in splits]
        train = splits["train"]
        hashes = _pair_hashes(iter_source(train)) if missing else np.zeros(0, np.uint64)
        carved = carve_indices(hashes, missing)  # a first pass over train, if any is missing
        out = {name: self._generate_examples(source) for name, source in splits.items()}
        if carved:
            taken = np.sort(np.concatenate(list(carved.values())))
            kept = len(hashes) - len(taken)
            print(
                "files: "
                + ", ".join(
                    f"{name} is {len(i):,} pairs carved off train" for name, i in carved.items()
                )
                + f" by a hash of each pair ({kept:,} left for training)"
            )
            out["train"] = self._generate_examples(train, skip=taken)
            for name, indices in carved.items():
                out[name] = self._generate_examples(train, only=indices)
        return out

    def _generate_examples(self, source: Source, skip=None, only=None):
        """The rows of ``source`` in file order; ``skip`` or ``only`` (sorted indices).

        Row ``i``'s key is ``i`` spread over TFDS's key range: with shuffling off TFDS
        writes the examples in key order, through 1,000 buckets on disk chosen by the
        key's place in [0, 2^128) and sorted in memory one at a time. Keys 0..n-1 all
        fell into the first bucket, so the whole split was sorted in memory at once
        (2.4 GB for 4.5M pairs); spread, a bucket holds a thousandth of it."""
        features = self.builder_config.features
        wanted = None if only is None else set(only.tolist())
        dropped = set() if skip is None else set(skip.tolist())
        step = KEY_RANGE // (_count_lines(source.paths[0]) + 1)
        for i, row in enumerate(iter_source(source)):
            if i in dropped or (wanted is not None and i not in wanted):
                continue
            yield i * step, dict(zip(features, row, strict=True))


def corpus_fingerprint(dataset: str, features: Sequence[str]) -> str:
    """The content fingerprint of ``files:PATH`` read for ``features``."""
    return fingerprint(discover(dataset[len(PREFIX) :], features))


def build(
    dataset: str, features: Sequence[str], data_dir: str | Path, shown: str = ""
) -> tfds.core.DatasetBuilder:
    """The prepared builder of ``files:PATH`` for ``features`` (built if the content is new;
    ``shown``: the name to print, where PATH is a bucket's corpus's local copy)."""
    path = dataset[len(PREFIX) :]
    if location.is_remote(path):  # read from the local copy, its errors named as the bucket's
        with shared.corpus_copy(path, CorpusError) as copy:
            return build(PREFIX + copy, features, data_dir, shown=dataset)
    splits = discover(path, features)
    name = "fp" + fingerprint(splits)[:16]
    config = FilesConfig(
        name=name,
        features=tuple(features),
        splits_json=json.dumps({k: dataclasses.asdict(v) for k, v in splits.items()}),
    )
    shared_dir, data_dir = data_dir, shared.local_root(data_dir)  # a bucket's: its copy
    builder = LocalFiles(config=config, data_dir=str(data_dir), file_format="array_record")
    if not builder.is_prepared() and shared.fetch(shared_dir, builder.data_dir):
        builder = LocalFiles(config=config, data_dir=str(data_dir), file_format="array_record")
    if not builder.is_prepared():
        try:
            Path(data_dir).mkdir(parents=True, exist_ok=True)
        except OSError as e:
            raise CorpusError(
                f"cannot write data.data_dir={data_dir} ({e.strerror}); choose a writable "
                "folder for the built corpus"
            ) from None
        print(f"files: building {shown or dataset} ({', '.join(splits)}) into {builder.data_dir}")
        started = time.perf_counter()
        tfds_spill.install()  # past 1 GB TFDS spills through TensorFlow otherwise
        try:
            with progress.where_seen():
                builder.download_and_prepare()
        except BaseException:
            # Nothing complete was there (not prepared, and the folder is this content's
            # own): leave no empty or partial build behind.
            shutil.rmtree(Path(data_dir) / "local_files" / name, ignore_errors=True)
            raise
        print(f"files: built in {time.perf_counter() - started:.0f} s", flush=True)
    shared.publish(shared_dir, builder.data_dir)
    return builder


def data_source(dataset: str, split: str, features: Sequence[str], data_dir: str | Path):
    """A TFDS data source of one split of ``files:PATH``."""
    builder = build(dataset, features, data_dir)
    if split not in builder.info.splits:
        raise CorpusError(
            f"{dataset} has no split {split!r} (it has {', '.join(builder.info.splits)})"
        )
    return builder.as_data_source(split=split)


__all__ = [
    "CorpusError",
    "build",
    "carve",
    "corpus_fingerprint",
    "data_source",
    "discover",
    "is_files",
]
