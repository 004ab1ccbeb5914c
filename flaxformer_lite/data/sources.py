"""Text of a dataset's splits: read with ``tfds.data_source`` (array_record, no TensorFlow).

The local corpora (``ding_de_en``, ``bible_en_es``) are built on first use from
their Debian packages (:mod:`~flaxformer_lite.data.builders`), ``files:PATH`` from a
user's own text files (:mod:`~flaxformer_lite.data.files`); any other name is a
TFDS dataset (e.g. ``wmt14_translate/de-en``), downloaded by TFDS on first use.
Also the selections made on texts before tokenization: fixed subsets
(``split:N``) and the known-word filter of auxiliary splits.
"""

from __future__ import annotations

import re
from collections import Counter
from collections.abc import Sequence
from pathlib import Path

import numpy as np
import tensorflow_datasets as tfds

from flaxformer_lite.data import builders, files


def load_texts(
    dataset: str, split: str, features: Sequence[str], data_dir: str | Path
) -> list[tuple[str, ...]]:
    """Tuples of the given text features of one split, read with ``tfds.data_source``."""
    if files.is_files(dataset):  # a user's own text files
        source = files.data_source(dataset, split, features, data_dir)
    elif dataset in builders.LOCAL_BUILDERS:
        builders.build_local_dataset(dataset, data_dir)
        source = tfds.data_source(dataset, split=split, data_dir=str(data_dir))
    else:  # any TFDS name, e.g. wmt14_translate/de-en (downloads on first use)
        try:
            source = tfds.data_source(dataset, split=split, data_dir=str(data_dir), download=True)
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

    def text(value, index: int) -> str:
        if value is None:  # what array_record returns from a cut-off or damaged shard
            raise ValueError(
                f"record {index} of the {split!r} split of {dataset} in {data_dir} cannot be "
                "read: an array_record shard is truncated or damaged; delete "
                f"{Path(data_dir) / dataset.split('/')[0]} and rerun to build it again"
            )
        return value.decode("utf-8") if isinstance(value, bytes) else str(value)

    # Batched reads: one record at a time costs ~1.7 ms (11 min for the 399k phrase
    # pairs); __getitems__ reads a chunk in one call, ~50x faster.
    out: list[tuple[str, ...]] = []
    chunk = 4096
    for start in range(0, len(source), chunk):
        indices = list(range(start, min(start + chunk, len(source))))
        records = (
            source.__getitems__(indices)
            if hasattr(source, "__getitems__")
            else [source[i] for i in indices]
        )
        out.extend(
            tuple(text(ex[f], i) for f in features) for i, ex in zip(indices, records, strict=True)
        )
    return out


def load_text_pairs(
    dataset: str, split: str, source_lang: str, target_lang: str, data_dir: str | Path
) -> list[tuple[str, str]]:
    """(source, target) strings of one split."""
    return load_texts(dataset, split, (source_lang, target_lang), data_dir)


def fixed_subset(items: Sequence, limit: int | None) -> list:
    """``limit`` of ``items`` in their order, the same on every machine and run
    (``split:N`` in ``data.train_splits``); all of them if ``limit`` is None or larger."""
    if limit is None or limit >= len(items):
        return list(items)
    keep = np.sort(np.random.default_rng(0).permutation(len(items))[:limit])
    return [items[i] for i in keep]


_WORD = re.compile(r"\w+")


def word_counts(texts: Sequence[tuple[str, ...]]) -> list[Counter]:
    """Lower-cased word counts of each feature (source, target) of ``texts``."""
    counts = [Counter() for _ in range(len(texts[0]))] if texts else []
    for t in texts:
        for c, text in zip(counts, t, strict=True):
            c.update(w.lower() for w in _WORD.findall(text))
    return counts


def known_word_pairs(
    texts: Sequence[tuple[str, ...]], counts: Sequence[Counter], min_count: int
) -> list[tuple[str, ...]]:
    """The pairs each of whose words occurs >= ``min_count`` times (per feature) in
    ``counts``: of a large auxiliary set (dictionary phrases), the part about the
    main corpus's vocabulary."""

    def known(text: str, c: Counter) -> bool:
        words = _WORD.findall(text)
        return bool(words) and all(c[w.lower()] >= min_count for w in words)

    return [t for t in texts if all(known(x, c) for x, c in zip(t, counts, strict=True))]
