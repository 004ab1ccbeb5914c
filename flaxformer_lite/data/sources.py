"""Text of a dataset's splits: read with ``tfds.data_source`` (array_record, no TensorFlow).

The local corpora (``ding_de_en``, ``bible_en_es``) are built on first use from
their Debian packages (:mod:`~flaxformer_lite.data.builders`), ``files:PATH`` from a
user's own text files (:mod:`~flaxformer_lite.data.files`); any other name is a
TFDS dataset (e.g. ``wmt14_translate/de-en``), downloaded by TFDS on first use.
Also the selections made on texts before tokenization: fixed subsets
(``split:N``) and the known-word filter of auxiliary splits.
"""

from __future__ import annotations

import dataclasses
import re
from collections import Counter
from collections.abc import Sequence
from pathlib import Path

import numpy as np
import tensorflow_datasets as tfds

from flaxformer_lite.data import builders, files, progress, shared, tfds_spill


def open_split(dataset: str, split: str, features: Sequence[str], data_dir: str | Path):
    """The ``tfds.data_source`` of one split (built first for a local corpus), checked:
    not empty, and holding the given text features."""
    root = shared.local_root(data_dir)  # a bucket's data folder: its copy here
    if files.is_files(dataset):  # a user's own text files
        source = files.data_source(dataset, split, features, data_dir)
    elif dataset in builders.LOCAL_BUILDERS:
        builders.build_local_dataset(dataset, data_dir)
        source = tfds.data_source(dataset, split=split, data_dir=root)
    else:  # any TFDS name, e.g. wmt14_translate/de-en (downloads on first use)
        files.check_not_a_bare_path(dataset)
        tfds_spill.install()  # wmt14 is past the 1 GB TFDS spills through TensorFlow
        try:
            folder = tfds.builder(dataset, data_dir=root).data_dir
            shared.fetch(data_dir, folder)
            with progress.where_seen():
                source = tfds.data_source(dataset, split=split, data_dir=root, download=True)
            shared.publish(data_dir, folder)
        except tfds.core.registered.DatasetNotFoundError:
            raise ValueError(
                f"data.dataset={dataset!r} is neither a local corpus "
                f"({', '.join(builders.LOCAL_BUILDERS)}) nor a TFDS dataset; "
                "tfds.list_builders() lists those (e.g. wmt14_translate/de-en)"
            ) from None
    if len(source) == 0:
        raise ValueError(f"split {split!r} of {dataset} is empty")
    first = source[0]
    for feature in features:
        if feature not in first:
            raise ValueError(
                f"dataset {dataset} has no feature {feature!r} (it has {sorted(first)}); set "
                "data.source_lang / data.target_lang to features it has"
            )
    return source


def identity(source, split: str) -> dict:
    """What names a split's content for the token cache: the dataset's full name and
    version (a ``files:`` corpus's holds its content fingerprint), the split, its
    record count and its shard files' sizes."""
    info = source.dataset_info
    sizes = []
    try:
        sizes = [Path(str(p)).stat().st_size for p in info.splits[split].filepaths]
    except (KeyError, OSError, AttributeError):
        pass
    return {"name": info.full_name, "split": split, "examples": len(source), "sizes": sizes}


def read_rows(
    source, indices: Sequence[int], features: Sequence[str], where: str = ""
) -> list[tuple[str, ...]]:
    """The texts of ``features`` of records ``indices`` (batched reads)."""

    def text(value, index: int) -> str:
        if value is None:  # what array_record returns from a cut-off or damaged shard
            raise ValueError(
                f"record {index} of {where or 'a split'} cannot be read: an array_record "
                "shard is truncated or damaged; delete the dataset's folder under "
                "data.data_dir and rerun to build it again"
            )
        return value.decode("utf-8") if isinstance(value, bytes) else str(value)

    # Batched reads: one record at a time costs ~1.7 ms (11 min for the 399k phrase
    # pairs); __getitems__ reads a chunk in one call, ~50x faster.
    out: list[tuple[str, ...]] = []
    chunk = 4096
    indices = list(indices)
    for start in range(0, len(indices), chunk):
        part = [int(i) for i in indices[start : start + chunk]]
        records = (
            source.__getitems__(part)
            if hasattr(source, "__getitems__")
            else [source[i] for i in part]
        )
        out.extend(
            tuple(text(ex[f], i) for f in features) for i, ex in zip(part, records, strict=True)
        )
    return out


@dataclasses.dataclass(frozen=True)
class SplitRows:
    """``rows(start, stop)``: the texts of records ``start:stop`` of a split (picklable:
    the token cache's worker processes read their chunks with it)."""

    source: object
    features: tuple[str, ...]
    where: str = ""

    def __call__(self, start: int, stop: int) -> list[tuple[str, ...]]:
        return read_rows(self.source, range(start, stop), self.features, self.where)


def load_texts(
    dataset: str, split: str, features: Sequence[str], data_dir: str | Path
) -> list[tuple[str, ...]]:
    """Tuples of the given text features of one split, read with ``tfds.data_source``."""
    source = open_split(dataset, split, features, data_dir)
    where = f"the {split!r} split of {dataset} in {data_dir}"
    return read_rows(source, range(len(source)), features, where)


def load_text_pairs(
    dataset: str, split: str, source_lang: str, target_lang: str, data_dir: str | Path
) -> list[tuple[str, str]]:
    """(source, target) strings of one split."""
    return load_texts(dataset, split, (source_lang, target_lang), data_dir)


def fixed_subset_indices(n: int, limit: int | None) -> np.ndarray:
    """Which ``limit`` of ``n`` items a ``split:N`` keeps, in their order, the same on
    every machine and run; all of them if ``limit`` is None or larger."""
    if limit is None or limit >= n:
        return np.arange(n)
    return np.sort(np.random.default_rng(0).permutation(n)[:limit])


def fixed_subset(items: Sequence, limit: int | None) -> list:
    """``limit`` of ``items`` in their order (:func:`fixed_subset_indices`)."""
    return [items[i] for i in fixed_subset_indices(len(items), limit)]


_WORD = re.compile(r"\w+")


def word_counts(texts: Sequence[tuple[str, ...]]) -> list[Counter]:
    """Lower-cased word counts of each feature (source, target) of ``texts``."""
    counts = [Counter() for _ in range(len(texts[0]))] if texts else []
    for t in texts:
        for c, text in zip(counts, t, strict=True):
            c.update(w.lower() for w in _WORD.findall(text))
    return counts


def known_word_indices(
    texts: Sequence[tuple[str, ...]], counts: Sequence[Counter], min_count: int
) -> np.ndarray:
    """Which pairs have every word occurring >= ``min_count`` times (per feature) in
    ``counts``: of a large auxiliary set (dictionary phrases), the part about the
    main corpus's vocabulary."""

    def known(text: str, c: Counter) -> bool:
        words = _WORD.findall(text)
        return bool(words) and all(c[w.lower()] >= min_count for w in words)

    return np.array(
        [
            i
            for i, t in enumerate(texts)
            if all(known(x, c) for x, c in zip(t, counts, strict=True))
        ],
        np.int64,
    )


def known_word_pairs(
    texts: Sequence[tuple[str, ...]], counts: Sequence[Counter], min_count: int
) -> list[tuple[str, ...]]:
    """The pairs of :func:`known_word_indices`."""
    return [texts[i] for i in known_word_indices(texts, counts, min_count)]
