"""TFDS builders for the local corpora, written as array_record (no TensorFlow).

  builder = build_local_dataset("ding_de_en", data_dir="data/tfds")
  source = tfds.data_source("ding_de_en", split="train", data_dir="data/tfds")

``ding_de_en``: features ``de``, ``en``; splits ``train`` (~18.7k sentence
pairs), ``validation`` (~500), ``test`` (~1000), ``train_phrases`` (~399k
dictionary pairs, optional extra training data; no held-out sentence side in
it). ``bible_en_es``: features ``osis_id``, ``en``, ``es``; splits by whole
books (test: Ruth, Jonah, Titus, Philemon, Jude; validation: Obadiah, Haggai,
2 John, 3 John; train: the other 57 books).

The raw files come from :mod:`flaxformer_lite.data.prepare` (the TFDS
``manual_dir`` is its ``raw_dir``). Any other TFDS name (e.g.
``wmt14_translate/de-en``) goes through TFDS's own builder instead.
"""

from __future__ import annotations

import os
from pathlib import Path

import tensorflow_datasets as tfds

from flaxformer_lite.data import corpora, progress, shared, tfds_spill
from flaxformer_lite.data.prepare import PACKAGES, locate_dataset

_INSTRUCTIONS = "Run `make prepare` (python -m flaxformer_lite.data.prepare) first."


def _manual_path(manual_dir, package: str) -> Path:
    path = Path(manual_dir) / PACKAGES[package].relpath
    if not path.exists():
        raise FileNotFoundError(f"{path} is missing (package {package}). {_INSTRUCTIONS}")
    return path


class DingDeEn(tfds.core.GeneratorBasedBuilder):
    """German-English sentence pairs of the Ding dictionary (Debian trans-de-en)."""

    VERSION = tfds.core.Version("1.0.0")
    RELEASE_NOTES = {"1.0.0": "Sentence pairs, 1000 test / 500 validation by English hash."}
    MANUAL_DOWNLOAD_INSTRUCTIONS = _INSTRUCTIONS

    def _info(self) -> tfds.core.DatasetInfo:
        return tfds.core.DatasetInfo(
            builder=self,
            description=__doc__,
            features=tfds.features.FeaturesDict(
                {"de": tfds.features.Text(), "en": tfds.features.Text()}
            ),
            supervised_keys=("en", "de"),
            homepage="https://dict.tu-chemnitz.de/",
        )

    def _split_generators(self, dl_manager):
        corpus = corpora.read_ding(_manual_path(dl_manager.manual_dir, "trans-de-en"))
        print(
            f"ding_de_en: {corpus.lines} entry lines, {len(corpus.sentences)} sentence pairs, "
            f"{len(corpus.phrases)} phrase pairs; skipped {corpus.skipped_malformed} malformed "
            f"and {corpus.skipped_misaligned} misaligned lines"
            + (f", {corpus.skipped_encoding} not UTF-8" if corpus.skipped_encoding else "")
        )
        splits = corpora.split_ding(corpus)
        return {name: self._generate_examples(pairs) for name, pairs in splits.items()}

    def _generate_examples(self, pairs):
        for i, (de, en) in enumerate(pairs):
            yield i, {"de": de, "en": en}


class BibleEnEs(tfds.core.GeneratorBasedBuilder):
    """King James Version aligned verse by verse with Reina-Valera 1909."""

    VERSION = tfds.core.Version("1.1.0")
    RELEASE_NOTES = {
        "1.0.0": "KJV versification; whole books held out.",
        "1.1.0": "Verses stay in reading order (no shuffling), for running-text LMs.",
    }
    MANUAL_DOWNLOAD_INSTRUCTIONS = _INSTRUCTIONS

    def _info(self) -> tfds.core.DatasetInfo:
        return tfds.core.DatasetInfo(
            builder=self,
            description=__doc__,
            features=tfds.features.FeaturesDict(
                {
                    "osis_id": tfds.features.Text(),
                    "en": tfds.features.Text(),
                    "es": tfds.features.Text(),
                }
            ),
            supervised_keys=("en", "es"),
            disable_shuffling=True,  # reading order: data.stream LMs read it as running text
        )

    def _split_generators(self, dl_manager):
        english = corpora.read_sword_module(_manual_path(dl_manager.manual_dir, "sword-text-kjv"))
        spanish = corpora.read_sword_module(_manual_path(dl_manager.manual_dir, "sword-text-sparv"))
        splits = corpora.split_bible(english, spanish)
        print(
            f"bible_en_es: {len(english)} English and {len(spanish)} Spanish verses; "
            + ", ".join(f"{k} {len(v)}" for k, v in splits.items())
        )
        for name in [n for n, verses in splits.items() if not verses]:
            print(f"bible_en_es: split {name!r} has no verses (its books are missing); skipped")
            del splits[name]
        return {name: self._generate_examples(verses) for name, verses in splits.items()}

    def _generate_examples(self, verses):
        for osis_id, en, es in verses:
            yield osis_id, {"osis_id": osis_id, "en": en, "es": es}


LOCAL_BUILDERS = {"ding_de_en": DingDeEn, "bible_en_es": BibleEnEs}


def default_data_dir() -> Path:
    return Path(os.environ.get("FLAXFORMER_DATA_DIR", "data/tfds"))


def build_local_dataset(
    name: str,
    data_dir: str | Path | None = None,
    raw_dir: str | Path | None = None,
    sources: dict | None = None,
) -> tfds.core.DatasetBuilder:
    """Prepare (fetch raw files if needed) and write a local dataset as array_record;
    with ``data_dir`` in a bucket, in its local copy, taken from or given to the bucket
    (:mod:`~flaxformer_lite.data.shared`)."""
    shared_dir = data_dir if data_dir is not None else default_data_dir()
    data_dir = Path(shared.local_root(shared_dir))
    builder = LOCAL_BUILDERS[name](data_dir=str(data_dir), file_format="array_record")
    if not builder.is_prepared() and shared.fetch(shared_dir, builder.data_dir):
        builder = LOCAL_BUILDERS[name](data_dir=str(data_dir), file_format="array_record")
    if not builder.is_prepared():
        paths = locate_dataset(name, raw_dir, sources)
        # TFDS reads from one manual_dir: link each located package into it.
        manual = data_dir / "manual" / name
        for package, path in paths.items():
            link = manual / PACKAGES[package].relpath
            link.parent.mkdir(parents=True, exist_ok=True)
            if link.is_symlink() or link.exists():
                link.unlink()
            link.symlink_to(Path(path).resolve())
        tfds_spill.install()
        with progress.where_seen():
            builder.download_and_prepare(
                download_config=tfds.download.DownloadConfig(manual_dir=str(manual))
            )
    shared.publish(shared_dir, builder.data_dir)
    return builder
