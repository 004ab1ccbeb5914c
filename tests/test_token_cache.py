"""The token cache and the array-based training path: ids tokenized once per (corpus,
tokenizer) and read back exactly; first-fit packing planned in chunks that resume
exactly; a cache of another tokenizer, a killed build or an unwritable data_dir is
never misread."""

import concurrent.futures.process
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
from absl import logging as absl_logging

from flaxformer_lite.data import assembly, packing, pipeline, sources, token_store
from flaxformer_lite.data.table import ExampleTable
from flaxformer_lite.data.token_store import Store, View
from flaxformer_lite.data.tokenizer import EOS_ID, train_tokenizer
from tests.fixtures import kill_when, load_config
from tests.test_data_pipeline import _examples
from tests.test_own_files import _pairs, _parallel

ROOT = Path(__file__).resolve().parents[1]


def _config(corpus: Path, data_dir: Path, vocab: int = 40, **data):
    config = load_config("ding_mini", "debug")
    config.data.dataset = f"files:{corpus}"
    config.data.source_lang, config.data.target_lang = "en", "de"
    config.data.data_dir = str(data_dir)
    config.model.vocab_size = vocab
    for key, value in data.items():
        setattr(config.data, key, value)
    return config


def _same(table, examples) -> None:
    assert len(table) == len(examples)
    for got, want in zip(table, examples, strict=True):
        assert got.keys() == want.keys()
        for k in want:
            np.testing.assert_array_equal(got[k], want[k])


def _stores(data_dir: Path) -> list[Path]:
    return sorted(p for p in (data_dir / token_store.CACHE_DIR).glob("*/*") if p.is_dir())


def test_cached_ids_are_the_tokenizers_and_the_next_run_reads_them(tmp_path, capsys):
    corpus, data_dir = tmp_path / "corpus", tmp_path / "tfds"
    _parallel(corpus, "train", _pairs(600))
    _parallel(corpus, "valid", _pairs(30, seed=1))
    config = _config(corpus, data_dir, max_length=10)
    data = assembly.prepare_data(config, tmp_path / "run1")
    assert capsys.readouterr().out.count("token cache: ") == 1  # train (validation: texts)
    texts = sources.load_texts(config.data.dataset, "train", ("en", "de"), data_dir)
    want, stats = pipeline.tokenize_pairs(texts, data.tokenizer, 10, "drop")
    assert 0 < stats.dropped_too_long and data.stats["train"] == stats
    _same(data.train, want)
    (store,) = _stores(data_dir)
    assert np.dtype(np.uint16).itemsize * sum(len(x) for e in want for x in e.values()) < (
        (store / "inputs.ids").stat().st_size + (store / "targets.ids").stat().st_size
    )  # every pair is cached, the dropped too, as uint16
    # Another run on the same corpus and tokenizer (a sweep's next point) reads the
    # cache; cut instead of dropped, its examples are tokenize_pairs' cut ones.
    tokenizer = str(tmp_path / "run1" / "tokenizer.model")
    again = _config(corpus, data_dir, max_length=10, tokenizer=tokenizer, too_long="truncate")
    cut = assembly.prepare_data(again, tmp_path / "run2")
    assert "token cache: " not in capsys.readouterr().out
    want, stats = pipeline.tokenize_pairs(texts, cut.tokenizer, 10, "truncate")
    assert stats.truncated and cut.stats["train"] == stats
    _same(cut.train, want)
    assert all(ex["inputs"][-1] == EOS_ID for ex in cut.train)


def test_a_store_of_another_tokenizer_is_rebuilt_never_read(tmp_path, capsys):
    corpus, data_dir = tmp_path / "corpus", tmp_path / "tfds"
    _parallel(corpus, "train", _pairs(400))
    first = assembly.prepare_data(_config(corpus, data_dir, vocab=40), tmp_path / "a")
    other = assembly.prepare_data(_config(corpus, data_dir, vocab=44), tmp_path / "b")
    mine, theirs = _stores(data_dir)  # one per tokenizer
    capsys.readouterr()
    # A store found under the other tokenizer's name (copied, restored from a backup):
    # its meta.json names the other tokenizer, so it is built again, not read.
    a_store = mine if (mine / "meta.json").read_text().count(_sha(tmp_path / "a")) else theirs
    b_store = theirs if a_store == mine else mine
    shutil.rmtree(b_store)
    shutil.copytree(a_store, b_store)
    again = assembly.prepare_data(_config(corpus, data_dir, vocab=44), tmp_path / "b")
    assert "of another tokenizer; building it again" in capsys.readouterr().out
    _same(again.train, list(other.train))
    pairs = zip(first.train, again.train, strict=True)
    assert not all(np.array_equal(x["inputs"], y["inputs"]) for x, y in pairs)


def _sha(workdir: Path) -> str:
    return token_store.file_sha256(workdir / "tokenizer.model")


def _rows(texts):
    return lambda start, stop: texts[start:stop]


class Chars:
    """A stand-in tokenizer with a file: an id per character (vocabulary 300)."""

    vocab_size = 300

    def __init__(self, path):
        self.path = path

    def encode(self, text):
        return np.array([4 + min(ord(c), 290) for c in text] + [EOS_ID], np.int32)


def _build(root, texts, tokenizer, name="train-x", key="k"):
    return token_store.cached_store(
        root, name, key, rows=_rows(texts), count=len(texts), keys=("inputs", "targets"),
        view=View(), tokenizer=tokenizer, tokenizer_sha="sha", describe={},
    )  # fmt: skip


def test_a_killed_build_is_never_read_and_the_next_builds_it_whole(tmp_path):
    texts = [(f"a{i}", f"bb{i}") for i in range(100)]
    root, tokenizer = tmp_path / "cache", Chars(tmp_path / "t")
    # What kill -9 leaves: a folder of a dead build (its pid is gone), and, had the rename
    # raced, a final folder without meta.json. Neither is read; both are replaced.
    dead = root / f"train-x.tmp-{token_store._HOST}-999999999"
    dead.mkdir(parents=True)
    elsewhere = root / "train-x.tmp-otherhost-1"  # another host's build, maybe running
    elsewhere.mkdir()
    (dead / "inputs.ids").write_bytes(b"\0" * 10)
    (root / "train-x").mkdir()
    (root / "train-x" / "inputs.ids").write_bytes(b"\1" * 10)
    store = _build(root, texts, tokenizer)
    assert not dead.exists() and (root / "train-x" / "meta.json").exists()
    assert elsewhere.exists()  # left alone for a day: its process cannot be asked
    os.utime(elsewhere, (time.time() - 2 * token_store.STALE_SECONDS,) * 2)
    (root / "train-x" / "meta.json").unlink()  # so that the next call builds again
    _build(root, texts, tokenizer)
    assert not elsewhere.exists()
    assert _ids(store.example(7)) == _ids(
        {"inputs": tokenizer.encode("a7"), "targets": tokenizer.encode("bb7")}
    )
    # A store cut short (a truncated file) does not open.
    ids = root / "train-x" / "targets.ids"
    ids.write_bytes(ids.read_bytes()[:-2])
    assert token_store.open_store(root / "train-x", "k", "sha") is None
    assert _ids(_build(root, texts, tokenizer).example(99))["targets"] == list(
        tokenizer.encode("bb99")
    )


def _ids(example):
    return {k: list(map(int, v)) for k, v in example.items()}


def test_an_unwritable_data_dir_is_one_clear_error(tmp_path):
    blocker = tmp_path / "tfds"
    blocker.write_text("a file where the data folder should be")
    with pytest.raises(token_store.TokenCacheError, match=r"cannot write the token cache in .*"):
        _build(blocker / token_store.CACHE_DIR, [("a", "b")], Chars(tmp_path / "t"))


KILLED_BUILD = """
import sys
import numpy as np
from flaxformer_lite.data import token_store
from flaxformer_lite.data.token_store import View
from flaxformer_lite.data.tokenizer import Tokenizer

tok = Tokenizer.load(sys.argv[2])
texts = [(f"the house {i}", f"das Haus {i}") for i in range(int(sys.argv[3]))]
store = token_store.cached_store(
    token_store.Path(sys.argv[1]), "train-x", "k", rows=lambda a, b: texts[a:b],
    count=len(texts), keys=("inputs", "targets"), view=View(), tokenizer=tok,
    tokenizer_sha="sha", describe={},
)
print(len(store), flush=True)
"""


@pytest.mark.slow
def test_a_cache_build_killed_midway_leaves_nothing_that_is_read(tmp_path):
    """SIGKILL while the cache is written: the next start ignores and removes the
    leftover, builds the store whole, and reads every example."""
    model = tmp_path / "tok.model"
    train_tokenizer(iter(["the house", "das Haus"] * 500 + list("0123456789")), model, 25)
    root, n = tmp_path / "cache", 3_000_000
    args = [sys.executable, "-c", KILLED_BUILD, str(root), str(model), str(n)]
    env = dict(os.environ, JAX_PLATFORMS="cpu")
    child = subprocess.Popen(args, cwd=ROOT, env=env, stdout=subprocess.PIPE, text=True)
    kill_when(child, lambda: any(p.stat().st_size for p in root.glob("train-x.tmp-*/*.ids")))
    assert token_store.open_store(root / "train-x", "k", "sha") is None
    args[-1] = str(n // 10)  # the next start (fewer pairs, to be quick): built whole
    out = subprocess.run(args, cwd=ROOT, env=env, capture_output=True, text=True, check=True)
    assert out.stdout.strip().splitlines()[-1] == str(n // 10)
    assert [p.name for p in root.iterdir()] == ["train-x"]


def _first_fit(lengths, batch_size, max_length):
    """The packing rule written plainly (numpy per example), as the reference."""
    rows, bounds = [], [0]
    room = np.full((batch_size, lengths.shape[1]), max_length)
    for j, need in enumerate(lengths):
        fits = np.flatnonzero((room >= need).all(axis=1))
        if fits.size == 0:
            bounds.append(j)
            room[:] = max_length
            fits = [0]
        rows.append(int(fits[0]))
        room[fits[0]] -= need
    return rows, bounds + [len(lengths)]


@pytest.mark.parametrize("features,batch_size", [(2, 1), (2, 3), (2, 16), (1, 5)])
def test_plan_rows_is_first_fit(features, batch_size):
    rng = np.random.default_rng(features * 10 + batch_size)
    lengths = rng.integers(2, 25, (2000, features))
    lengths[rng.random(2000) < 0.05] = 24  # some that fill a row
    rows, bounds = packing.plan_rows(lengths, batch_size, 24)
    want_rows, want_bounds = _first_fit(lengths, batch_size, 24)
    assert rows.tolist() == want_rows and bounds.tolist() == want_bounds


def test_chunked_epochs_hold_every_example_once_and_resume_exactly():
    exs = _examples(300)
    kw = dict(batch_size=4, max_length=24, seed=0, pack=True, ids=(0, 1), chunk=64)
    ds = packing.PackedTrainDataset(exs, **kw)
    it = iter(ds)
    seen: dict[int, list[int]] = {}
    states, batches = [], []
    while len(seen.get(2, [])) == 0:
        states.append(it.get_state())
        batch = next(it)
        batches.append(batch)
        ids = batch["example_ids"][batch["example_ids"] >= 0]
        for i in ids.tolist():
            seen.setdefault(i >> 32, []).append(i & 0xFFFFFFFF)
        for key in ("inputs", "targets"):  # the tokens are those of the ids, in order
            for r in range(4):
                row = batch["example_ids"][r]
                want = [t for i in row[row >= 0] for t in exs[int(i) & 0xFFFFFFFF][key]]
                got = batch[key][r][batch[f"{key}_segment_ids"][r] > 0]
                assert got.tolist() == [int(t) for t in want]
    assert sorted(seen[0]) == sorted(seen[1]) == list(range(300))
    assert {s["chunk"] for s in states} == {0, 1, 2, 3, 4}  # 300 examples, chunks of 64
    for k in (5, len(batches) // 2, len(batches) - 3):  # mid-chunk, across, next epoch
        again = iter(packing.PackedTrainDataset(exs, **kw))
        again.set_state(states[k])
        for want in batches[k : k + 4]:
            got = next(again)
            for key in want:
                np.testing.assert_array_equal(got[key], want[key])
    # One chunk is the whole-epoch plan: the batches of a small corpus are unchanged.
    whole = packing.PackedTrainDataset(exs, **{**kw, "chunk": None})
    order = whole.order(0)
    lengths = np.array([[len(e["inputs"]), len(e["targets"])] for e in exs])
    assert whole.plan(0) == packing.plan_epoch(lengths, order, 4, 24)


def test_two_processes_read_their_chunked_shards_as_one_does(monkeypatch):
    monkeypatch.setattr(packing, "CHUNK", 40)
    exs = ExampleTable.of(_examples(400, seed=1))
    kw = dict(batch_size=8, max_length=24, seed=2, shards=2, prefetch=0)
    one = packing.train_iterator(exs, **kw)
    two = [
        packing.train_iterator(exs, process_index=p, process_count=2, **{**kw, "batch_size": 4})
        for p in range(2)
    ]
    for _ in range(25):  # past the chunks' ends (each shard has 200 in 5 chunks)
        want = next(one)
        got = [next(t) for t in two]
        for key in want:
            np.testing.assert_array_equal(np.concatenate([g[key] for g in got]), want[key])


def test_a_table_reads_stores_as_the_examples_they_hold():
    exs = _examples(50, seed=3)
    store = Store.from_examples(exs)
    table = ExampleTable.of_store(store, max_length=6)
    for got, want in zip(table, exs, strict=True):  # cut to 6: five ids and EOS
        for k in want:
            cut = want[k] if len(want[k]) <= 6 else np.append(want[k][:5], EOS_ID)
            np.testing.assert_array_equal(got[k], cut)
    mixed = ExampleTable.concat([table.take(np.arange(40, 50)), ExampleTable.of(exs[:5])])
    assert len(mixed.stores) == 2 and len(mixed) == 15
    flat = mixed.gather("targets", np.array([11, 0, 14]))
    want = np.concatenate([exs[1]["targets"], mixed[0]["targets"], exs[4]["targets"]])
    np.testing.assert_array_equal(flat, want)


class _Texts:
    """Picklable rows (the token cache's worker processes read their chunks with it)."""

    def __init__(self, n):
        self.n = n

    def __call__(self, start, stop):
        absl_logging.warning("reading rows %d-%d", start, stop)  # as TFDS warns, opening
        return [(f"the house {i}", f"das Haus {i % 7}") for i in range(start, stop)]


@pytest.fixture(scope="module")
def small_spm(tmp_path_factory):
    model = tmp_path_factory.mktemp("spm") / "t.model"
    return train_tokenizer(iter(["the house", "das Haus"] * 500 + list("0123456789")), model, 25)


def _store(root, tokenizer, workers):
    return token_store.cached_store(
        root, "train-x", "k", rows=_Texts(400), count=400, keys=("inputs", "targets"),
        view=View(), tokenizer=tokenizer, tokenizer_sha="sha", describe={}, workers=workers,
    )  # fmt: skip


def _same_store(a, b):
    for k in a.keys:
        np.testing.assert_array_equal(np.asarray(a.ids[k]), np.asarray(b.ids[k]))
        np.testing.assert_array_equal(np.asarray(a.ends[k]), np.asarray(b.ends[k]))


def test_worker_processes_write_what_one_process_writes(tmp_path, monkeypatch, small_spm, capfd):
    monkeypatch.setattr(token_store, "CHUNK", 50)  # 8 chunks over 2 workers
    serial = _store(tmp_path / "one", small_spm, workers=1)
    verbosity = absl_logging.get_verbosity()
    absl_logging.set_verbosity(absl_logging.ERROR)  # as the command line sets it
    try:
        parallel = _store(tmp_path / "two", small_spm, workers=2)
    finally:
        absl_logging.set_verbosity(verbosity)
    # The workers keep this process's verbosity (spawned, they start at WARNING).
    assert "reading rows" not in capfd.readouterr().err
    _same_store(serial, parallel)
    assert _ids(parallel.example(123)) == {
        "inputs": list(small_spm.encode("the house 123")),
        "targets": list(small_spm.encode("das Haus 4")),
    }

    # Workers that fail midway (a script without a __main__ guard): the rest is
    # tokenized in this process, none twice, none skipped.
    def broken(rows, spans, *args):
        yield token_store._encode_chunk(rows, *spans[0], *args[:2], small_spm, args[3])
        raise concurrent.futures.process.BrokenProcessPool("a worker died")

    monkeypatch.setattr(token_store, "_parallel_chunks", broken)
    _same_store(serial, _store(tmp_path / "three", small_spm, workers=2))
