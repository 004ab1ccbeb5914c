"""Corpus parsers on fixture files in the real formats, and on the real packages if present."""

import os
from pathlib import Path

import pytest

from flaxformer_lite.data import corpora
from tests import fixtures


def test_ding_cleaning_and_alignment(tmp_path):
    corpus = corpora.read_ding(fixtures.write_ding(tmp_path / "de-en"))
    assert corpus.lines == 9
    assert corpus.skipped_malformed == 1 and corpus.skipped_misaligned == 1
    assert ("Wo ist der Bahnhof?", "Where is the station?") in corpus.sentences
    assert ("Komm her!", "Come here!") in corpus.phrases  # under 3 English words
    assert ("Er kommt morgen.", "He comes tomorrow.") in corpus.sentences
    assert ("Sie kam gestern.", "She came yesterday.") in corpus.sentences
    # {m} [cook.] <variant> /abbr/ dropped; synonyms pair one to one; | parts align.
    assert ("Aal", "eel") in corpus.phrases and ("Aale", "eels") in corpus.phrases
    assert ("Gebäude", "building") in corpus.phrases and ("Häuser", "houses") in corpus.phrases
    assert ("das ist kaputt", "it is broken") in corpus.phrases
    assert ("Satz", "sentence") in corpus.phrases and ("Nummer", "number") in corpus.phrases


def test_clean_ding_text():
    assert corpora.clean_ding_text("Abfahrt {f} /Abf./ [transp.] <Abfahrtszeit>") == "Abfahrt"
    assert (
        corpora.clean_ding_text("Aal (auf der Speisekarte) [cook.]") == "Aal (auf der Speisekarte)"
    )


def test_ding_split_is_deterministic_and_disjoint(tmp_path):
    corpus = corpora.read_ding(fixtures.write_ding(tmp_path / "de-en", 300))
    a = corpora.split_ding(corpus, num_test=50, num_validation=20)
    b = corpora.split_ding(corpora.read_ding(tmp_path / "de-en"), num_test=50, num_validation=20)
    assert a == b
    assert len(a["test"]) == 50 and len(a["validation"]) == 20
    held = {s for pair in a["test"] + a["validation"] for s in pair}
    for split in ("train", "train_phrases"):
        assert not any(de in held or en in held for de, en in a[split])
    with pytest.raises(ValueError, match="only 303 distinct English sentences"):
        corpora.split_ding(corpus, num_test=300, num_validation=20)


def test_sword_module_round_trip(tmp_path):
    d = fixtures.write_sword_module(tmp_path / "kjv", fixtures.KJV_BOOKS, fixtures.KJV_NT)
    verses = corpora.read_sword_module(d)
    assert list(verses) == ["Gen.1.1", "Gen.1.2", "Gen.2.1", "Ruth.1.1", "Obad.1.1", "Jude.1.1"]
    assert verses["Gen.1.1"] == "In the beginning God created the heaven."
    assert verses["Gen.1.2"] == "And the earth was without form."  # the note is dropped


def test_strip_osis():
    raw = (
        '<div type="x-milestone" sID="pv1"/>¶ And <divineName><w lemma="s:H3068">LORD'
        '</w></divineName> said<note n="a">x</note>, <title>Head</title>Let &amp; be. '
    )
    assert corpora.strip_osis(raw) == "And LORD said, Let & be."


def test_sword_errors(tmp_path):
    with pytest.raises(FileNotFoundError, match="no SWORD ztext files"):
        corpora.read_sword_module(tmp_path)
    d = fixtures.write_sword_module(tmp_path / "bad", fixtures.KJV_BOOKS)
    (d / "ot.bzv").write_bytes((d / "ot.bzv").read_bytes()[:-3])
    with pytest.raises(ValueError, match="not multiples of 12/10 bytes"):
        corpora.read_sword_module(d)
    d = fixtures.write_sword_module(tmp_path / "corrupt", fixtures.KJV_BOOKS)
    (d / "ot.bzz").write_bytes(b"\x00" * (d / "ot.bzz").stat().st_size)
    with pytest.raises(ValueError, match="corrupt"):
        corpora.read_sword_module(d)


def test_bible_split_by_books(tmp_path):
    en = corpora.read_sword_module(
        fixtures.write_sword_module(tmp_path / "en", fixtures.KJV_BOOKS, fixtures.KJV_NT)
    )
    es = corpora.read_sword_module(
        fixtures.write_sword_module(tmp_path / "es", fixtures.RV_BOOKS, fixtures.RV_NT)
    )
    splits = corpora.split_bible(en, es)
    assert [v[0] for v in splits["train"]] == ["Gen.1.1", "Gen.1.2", "Gen.2.1"]
    assert [v[0] for v in splits["test"]] == ["Ruth.1.1", "Jude.1.1"]
    assert [v[0] for v in splits["validation"]] == ["Obad.1.1"]
    assert splits["train"][0][2] == "EN el principio crió Dios los cielos."


RAW = Path(os.environ.get("FLAXFORMER_RAW_DIR", "data/raw"))


@pytest.mark.skipif(
    not (RAW / "usr/share/trans/de-en").exists(), reason="trans-de-en not prepared (make prepare)"
)
def test_real_ding_package():
    corpus = corpora.read_ding(RAW / "usr/share/trans/de-en")
    assert 19_000 < len(corpus.sentences) < 22_000  # "about 20k pairs"
    assert len(corpus.phrases) > 350_000
    splits = corpora.split_ding(corpus)
    assert len(splits["test"]) >= 1000 and len(splits["validation"]) >= 500


@pytest.mark.skipif(
    not (RAW / "usr/share/sword/modules/texts/ztext/engKJV2006eb").exists(),
    reason="sword-text-kjv not prepared (make prepare)",
)
def test_real_bible_packages():
    base = RAW / "usr/share/sword/modules/texts/ztext"
    kjv = corpora.read_sword_module(base / "engKJV2006eb")
    rv = corpora.read_sword_module(base / "spaRV1909eb")
    assert len(kjv) == 31_102  # the KJV's verse count
    assert kjv["John.3.16"].startswith("For God so loved the world")
    assert rv["John.3.16"].startswith("Porque de tal manera amó Dios al mundo")
    splits = corpora.split_bible(kjv, rv)
    assert {v[0].split(".")[0] for v in splits["test"]} == set(corpora.BIBLE_TEST_BOOKS)
