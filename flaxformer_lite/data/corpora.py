"""Parsers for the local corpora (pure Python; no TFDS, no JAX).

* Ding (Debian package ``trans-de-en``, file ``usr/share/trans/de-en``): one
  entry a line, ``DE | DE ... :: EN | EN ...``; the ``|`` parts align one to
  one, ``;`` separates synonyms inside a part, and ``{m}`` ``[coll.]``
  ``<variant>`` ``/Abbr./`` ``~see-also`` annotations are dropped. A *sentence*
  pair is one whose two sides end in . ? or ! and whose English side has at
  least 3 words (about 20k pairs); the other pairs are dictionary *phrases*
  (about 390k), an optional extra training set.
* SWORD ztext modules (``sword-text-kjv``, ``sword-text-sparv``):
  ``{ot,nt}.bzs`` holds 12-byte block records (offset, size, uncompressed size;
  little-endian uint32), ``{ot,nt}.bzv`` 10-byte verse records (block,
  offset in the uncompressed block: uint32; size: uint16), ``{ot,nt}.bzz`` the
  zlib blocks. Entries follow the versification in order: module header, then
  per book an intro entry, per chapter an intro entry and its verses; the
  intros carry OSIS ``sID`` markers (``osisID="Gen"``, ``osisID="Gen.1"``),
  which name the verses here. OSIS markup is stripped, notes are dropped.

Splits are deterministic (hashes of the text, fixed book lists), so every
machine builds the same train/validation/test sets.
"""

from __future__ import annotations

import dataclasses
import hashlib
import html
import re
import struct
import zlib
from collections.abc import Iterable
from pathlib import Path

# Ding ---------------------------------------------------------------------------

_DING_ANNOTATIONS = re.compile(r"\s*(\{[^}]*\}|\[[^\]]*\]|<[^>]*>|/[^/\s][^/]*/(?=\s|$|[;,])|~\S+)")
_SPACES = re.compile(r"\s+")
SENTENCE_END = (".", "?", "!")


@dataclasses.dataclass
class DingCorpus:
    """The Ding file split into sentence pairs and dictionary phrases, with counts."""

    sentences: list[tuple[str, str]]  # (de, en), unique, in file order
    phrases: list[tuple[str, str]]  # (de, en) dictionary pairs that are not sentences
    lines: int = 0
    skipped_malformed: int = 0  # no ' :: ' separator, or an empty side
    skipped_misaligned: int = 0  # different numbers of '|' parts on the two sides
    skipped_encoding: int = 0  # not UTF-8


class CorpusError(ValueError):
    """A corpus file that holds nothing usable; the message names the file and the fix."""


def clean_ding_text(text: str) -> str:
    """Drop Ding annotations ({m}, [coll.], <variant>, /Abbr./, ~see) and squeeze spaces."""
    return _SPACES.sub(" ", _DING_ANNOTATIONS.sub("", text)).strip()


def is_sentence_pair(de: str, en: str) -> bool:
    return de.endswith(SENTENCE_END) and en.endswith(SENTENCE_END) and len(en.split()) >= 3


def parse_ding_line(line: str) -> list[tuple[str, str]] | None:
    """All (de, en) pairs of one entry line; ``None`` if the line is malformed.

    Synonyms pair up one to one when both sides list the same number of them;
    otherwise only the first synonyms pair (the rest cannot be aligned).
    """
    if " :: " not in line:
        return None
    de_side, en_side = line.split(" :: ", 1)
    de_parts, en_parts = de_side.split(" | "), en_side.split(" | ")
    if len(de_parts) != len(en_parts):
        return []
    pairs = []
    for de_part, en_part in zip(de_parts, en_parts, strict=True):
        de_syn = [clean_ding_text(s) for s in de_part.split("; ")]
        en_syn = [clean_ding_text(s) for s in en_part.split("; ")]
        if len(de_syn) != len(en_syn):
            de_syn, en_syn = de_syn[:1], en_syn[:1]
        pairs.extend((d, e) for d, e in zip(de_syn, en_syn, strict=True) if d and e)
    return pairs


def read_ding(path: str | Path) -> DingCorpus:
    """Parse the Ding file: sentence pairs and phrase pairs, each unique."""
    corpus = DingCorpus([], [])
    seen: set[tuple[str, str]] = set()
    with open(path, "rb") as f:
        for raw in f:
            corpus.lines += 1
            try:
                line = raw.decode("utf-8").rstrip("\n")
            except UnicodeDecodeError:
                corpus.skipped_encoding += 1
                continue
            if not line.strip() or line.startswith("#"):
                corpus.lines -= 1
                continue
            pairs = parse_ding_line(line)
            if pairs is None:
                corpus.skipped_malformed += 1
                continue
            if not pairs:
                corpus.skipped_misaligned += 1
                continue
            for pair in pairs:
                if pair in seen:
                    continue
                seen.add(pair)
                (corpus.sentences if is_sentence_pair(*pair) else corpus.phrases).append(pair)
    counts = (
        f"{corpus.lines} entry lines: {corpus.skipped_malformed} without ' :: ', "
        f"{corpus.skipped_misaligned} misaligned, {corpus.skipped_encoding} not UTF-8"
    )
    if corpus.skipped_encoding > corpus.lines / 2:
        raise CorpusError(
            f"{path} is not UTF-8 ({counts}); convert it (iconv -f latin1 -t utf-8) or "
            "fetch the package again (python -m flaxformer_lite.data.prepare)"
        )
    if not corpus.sentences:
        raise CorpusError(
            f"{path} holds no sentence pairs ({counts}); it should be Ding's "
            "'Deutsch :: English' lines: fetch it again (python -m flaxformer_lite.data.prepare)"
        )
    return corpus


def _stable_fraction(text: str) -> float:
    """A machine-independent pseudo-random number in [0, 1) for ``text``."""
    digest = hashlib.sha256(text.encode("utf-8")).digest()
    return int.from_bytes(digest[:8], "big") / 2**64


def split_ding(
    corpus: DingCorpus, num_test: int = 1000, num_validation: int = 500
) -> dict[str, list[tuple[str, str]]]:
    """Deterministic splits: ``test``/``validation`` sentences, ``train`` sentences,
    ``train_phrases`` (dictionary pairs).

    Pairs are ordered by a hash of their English side; the first ``num_test``
    English sentences (with all their German translations) are test, the next
    ``num_validation`` validation. Nothing in train or train_phrases shares a
    German or English side with a held-out sentence.
    """
    by_en: dict[str, list[tuple[str, str]]] = {}
    for de, en in corpus.sentences:
        by_en.setdefault(en, []).append((de, en))
    order = sorted(by_en, key=lambda en: (_stable_fraction(en), en))
    if len(order) <= num_test + num_validation:
        raise ValueError(
            f"the Ding corpus has only {len(order)} distinct English sentences; need more than "
            f"num_test + num_validation = {num_test + num_validation}"
        )
    test = [p for en in order[:num_test] for p in by_en[en]]
    validation = [p for en in order[num_test : num_test + num_validation] for p in by_en[en]]
    held_de = {de for de, _ in test + validation}
    held_en = {en for _, en in test + validation}

    def clean(pairs: Iterable[tuple[str, str]]) -> list[tuple[str, str]]:
        return [(de, en) for de, en in pairs if de not in held_de and en not in held_en]

    train = clean(p for en in order[num_test + num_validation :] for p in by_en[en])
    return {
        "train": train,
        "validation": validation,
        "test": test,
        "train_phrases": clean(corpus.phrases),
    }


# SWORD ----------------------------------------------------------------------------

_NOTE = re.compile(r"<note\b[^>]*?(?:/>|>.*?</note>)", re.S)
_TITLE = re.compile(r"<title\b[^>]*?(?:/>|>.*?</title>)", re.S)
_TAG = re.compile(r"<[^>]+>")
_SPACE_BEFORE_PUNCT = re.compile(r"\s+([,.;:!?])")
_BOOK = re.compile(
    r'<div\b[^>]*\bosisID="([^"]+)"[^>]*\bsID=[^>]*type="book"|'
    r'<div\b[^>]*type="book"[^>]*\bosisID="([^"]+)"[^>]*\bsID='
)
_CHAPTER = re.compile(
    r'<chapter\b[^>]*\bosisID="([^".]+)\.(\d+)"[^>]*\bsID=|'
    r'<chapter\b[^>]*\bsID=[^>]*\bosisID="([^".]+)\.(\d+)"'
)


def strip_osis(text: str) -> str:
    """Plain text of an OSIS verse: notes and headings dropped, tags removed."""
    text = _TITLE.sub("", _NOTE.sub("", text))
    text = html.unescape(_TAG.sub("", text)).replace("¶", " ")
    return _SPACE_BEFORE_PUNCT.sub(r"\1", _SPACES.sub(" ", text)).strip()


def _read_testament(directory: Path, testament: str) -> list[str]:
    """Raw entries of one testament, in versification order ('' for empty ones)."""
    try:
        bzs = (directory / f"{testament}.bzs").read_bytes()
        bzv = (directory / f"{testament}.bzv").read_bytes()
        bzz = (directory / f"{testament}.bzz").read_bytes()
    except FileNotFoundError:
        return []
    if len(bzs) % 12 or len(bzv) % 10:
        raise ValueError(
            f"{directory}/{testament}.bzs/.bzv have sizes {len(bzs)}/{len(bzv)}, not multiples "
            "of 12/10 bytes: not a SWORD ztext module, or a truncated one"
        )
    blocks = [struct.unpack_from("<III", bzs, i) for i in range(0, len(bzs), 12)]
    cache: dict[int, bytes] = {}
    entries = []
    for i in range(0, len(bzv), 10):
        block, offset, size = struct.unpack_from("<IIH", bzv, i)
        if size == 0:
            entries.append("")
            continue
        if block >= len(blocks):
            raise ValueError(
                f"{directory}/{testament}.bzv points at block {block} of {len(blocks)}"
            )
        if block not in cache:
            start, length, _ = blocks[block]
            try:
                cache[block] = zlib.decompress(bzz[start : start + length])
            except zlib.error as e:
                raise ValueError(
                    f"{directory}/{testament}.bzz block {block} is corrupt: {e}"
                ) from e
        entries.append(cache[block][offset : offset + size].decode("utf-8", errors="replace"))
    return entries


def read_sword_module(directory: str | Path) -> dict[str, str]:
    """``{'Gen.1.1': 'In the beginning ...', ...}`` for a SWORD ztext module folder."""
    directory = Path(directory)
    verses: dict[str, str] = {}
    found = False
    for testament in ("ot", "nt"):
        entries = _read_testament(directory, testament)
        found = found or bool(entries)
        book, chapter, verse = None, None, 0
        for raw in entries:
            if m := _BOOK.search(raw):
                book, chapter = m.group(1) or m.group(2), None
                continue
            if m := _CHAPTER.search(raw):
                book = m.group(1) or m.group(3)
                chapter, verse = int(m.group(2) or m.group(4)), 0
                continue
            if book is None or chapter is None:
                continue  # module / testament header
            verse += 1
            text = strip_osis(raw)
            if text:
                verses[f"{book}.{chapter}.{verse}"] = text
    if not found:
        raise FileNotFoundError(
            f"no SWORD ztext files (ot.bzs/ot.bzv/ot.bzz or nt.*) in {directory}; run "
            "`make prepare` or pass the folder of the extracted module"
        )
    return verses


BIBLE_TEST_BOOKS = ("Ruth", "Jonah", "Titus", "Phlm", "Jude")
BIBLE_VALIDATION_BOOKS = ("Obad", "Hag", "2John", "3John")


def split_bible(
    english: dict[str, str], spanish: dict[str, str]
) -> dict[str, list[tuple[str, str, str]]]:
    """Verse-aligned (osis_id, en, es) triples split by whole books."""
    splits: dict[str, list[tuple[str, str, str]]] = {"train": [], "validation": [], "test": []}
    for osis_id, en in english.items():
        es = spanish.get(osis_id)
        if not es:
            continue
        book = osis_id.split(".", 1)[0]
        if book in BIBLE_TEST_BOOKS:
            splits["test"].append((osis_id, en, es))
        elif book in BIBLE_VALIDATION_BOOKS:
            splits["validation"].append((osis_id, en, es))
        else:
            splits["train"].append((osis_id, en, es))
    return splits
