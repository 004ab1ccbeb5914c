"""prepare -> TFDS builders (array_record, no TensorFlow) -> tokenizer -> packed batches."""

import subprocess
import sys
import threading

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import tensorflow_datasets as tfds

from flaxformer_lite import Transformer
from flaxformer_lite.config.model import ModelConfig
from flaxformer_lite.data import builders, packing, pipeline, prepare, sources
from flaxformer_lite.data.tokenizer import EOS_ID, Tokenizer, load_or_train, train_tokenizer
from flaxformer_lite.model.partitioning import unbox
from flaxformer_lite.training import losses
from flaxformer_lite.training.steps import eval_step
from tests import fixtures


@pytest.fixture(scope="module")
def raw_root(tmp_path_factory):
    return fixtures.write_raw_root(tmp_path_factory.mktemp("raw"))


@pytest.fixture(scope="module")
def data_dir(tmp_path_factory, raw_root):
    d = tmp_path_factory.mktemp("tfds")
    for name in ("ding_de_en", "bible_en_es"):
        builders.build_local_dataset(name, d, raw_dir=raw_root)
    return d


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory, data_dir):
    pairs = sources.load_text_pairs("ding_de_en", "train", "en", "de", data_dir)
    return train_tokenizer(
        (s for p in pairs for s in p),
        tmp_path_factory.mktemp("tok") / "tokenizer.model",
        vocab_size=100,
    )


def test_prepare_finds_extracted_packages(raw_root, tmp_path):
    paths = prepare.locate_dataset("bible_en_es", raw_root)
    assert paths["sword-text-kjv"].name == "engKJV2006eb"
    # --source may name the file itself.
    direct = prepare.locate_dataset(
        "ding_de_en", tmp_path / "empty", {"trans-de-en": raw_root / "usr/share/trans/de-en"}
    )
    assert direct["trans-de-en"] == raw_root / "usr/share/trans/de-en"


def test_prepare_errors(tmp_path, raw_root):
    with pytest.raises(prepare.PrepareError, match="neither .* holds the package's files"):
        prepare.locate_dataset("ding_de_en", tmp_path, {"trans-de-en": tmp_path / "nope"})
    with pytest.raises(prepare.PrepareError, match="unknown local dataset 'wmt'"):
        prepare.locate_dataset("wmt", tmp_path)
    rc = prepare.main(["--source", "bogus=/x"])
    assert rc == 1


def test_builders_write_array_record_and_read_without_tensorflow(data_dir):
    files = sorted(p.name for p in (data_dir / "ding_de_en" / "1.0.0").iterdir())
    assert any(".array_record-" in f for f in files)
    test = tfds.data_source("ding_de_en", split="test", data_dir=str(data_dir))
    assert len(test) == 1000
    ex = test[0]
    assert set(ex) == {"de", "en"} and ex["en"].decode().startswith("This is sentence")
    bible = tfds.data_source("bible_en_es", split="test", data_dir=str(data_dir))
    assert sorted(bible[i]["osis_id"].decode() for i in range(len(bible))) == [
        "Jude.1.1",
        "Ruth.1.1",
    ]
    code = (
        "import tensorflow_datasets as tfds, sys; "
        f"s = tfds.data_source('ding_de_en', split='train', data_dir={str(data_dir)!r}); "
        "s[0]; print('tensorflow' in sys.modules)"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip().endswith("False")


def test_load_text_pairs_direction_and_errors(data_dir):
    en_de = sources.load_text_pairs("ding_de_en", "validation", "en", "de", data_dir)
    de_en = sources.load_text_pairs("ding_de_en", "validation", "de", "en", data_dir)
    assert en_de[0] == de_en[0][::-1]
    with pytest.raises(ValueError, match="has no feature 'fr'"):
        sources.load_text_pairs("ding_de_en", "validation", "en", "fr", data_dir)


def test_tokenizer_ids_and_round_trip(tokenizer, tmp_path):
    ids = tokenizer.encode("This is sentence number 7.")
    assert ids[-1] == EOS_ID and ids.dtype == np.int32 and 0 not in ids
    assert tokenizer.decode(ids) == "This is sentence number 7."
    assert Tokenizer.load(tokenizer.path).vocab_size == 100
    bad = tmp_path / "bad.model"
    bad.write_bytes(b"not a model")
    with pytest.raises(ValueError, match="not a valid sentencepiece model"):
        Tokenizer.load(bad)
    with pytest.raises(ValueError, match="lower model.vocab_size"):
        train_tokenizer(iter(["a b c"] * 10), tmp_path / "t.model", vocab_size=5000)


def test_a_given_tokenizer_is_checked_and_copied_into_the_run(tokenizer, tmp_path):
    import sentencepiece as spm

    def never():
        raise AssertionError("a given tokenizer is not trained again")

    run = tmp_path / "run"
    got = load_or_train(run, never, 128, given=tokenizer.path)  # 100 pieces fit in 128
    assert (run / "tokenizer.model").read_bytes() == tokenizer.path.read_bytes()
    assert got.encode("sentence 7").tolist() == tokenizer.encode("sentence 7").tolist()
    assert load_or_train(run, never, 128, given=tokenizer.path).vocab_size == 100  # a resume
    with pytest.raises(ValueError, match="has 100 pieces but model.vocab_size=64; set "):
        load_or_train(tmp_path / "small", never, 64, given=tokenizer.path)
    with pytest.raises(ValueError, match="no such file"):
        load_or_train(tmp_path / "x", never, 128, given=tmp_path / "nope.model")
    with pytest.raises(ValueError, match="no piece for the tag '<dict>'"):
        load_or_train(tmp_path / "x", never, 128, ("<dict>",), given=tokenizer.path)
    # A model with sentencepiece's default ids (unk 0, bos 1, eos 2, no pad).
    foreign = tmp_path / "foreign.model"
    with open(foreign, "wb") as f:
        spm.SentencePieceTrainer.train(
            sentence_iterator=iter(["a b c d e f g h"] * 50), model_writer=f, vocab_size=12,
            minloglevel=2,
        )  # fmt: skip
    with pytest.raises(ValueError, match="--pad_id=0 --eos_id=1 --bos_id=2 --unk_id=3"):
        load_or_train(tmp_path / "x", never, 128, given=foreign)
    # A run that trained its own tokenizer refuses another one.
    own = tmp_path / "own"
    load_or_train(own, lambda: iter(["a b c d e f g h i j"] * 50), 16)
    with pytest.raises(ValueError, match="is not the tokenizer the run in"):
        load_or_train(own, never, 128, given=tokenizer.path)
    assert not (tmp_path / "x").exists() and not (tmp_path / "small").exists()


def test_tokenize_drop_truncate_and_empty(tokenizer):
    pairs = [
        ("This is sentence number 1.", "Das ist Satz Nummer 1."),
        ("This is " * 30, "Das ist"),
        ("", "leer"),
        ("   ", "x"),
    ]
    kept, stats = pipeline.tokenize_pairs(pairs, tokenizer, max_length=30, too_long="drop")
    assert len(kept) == 1 and stats.dropped_too_long == 1 and stats.dropped_empty == 2
    cut, stats = pipeline.tokenize_pairs(pairs, tokenizer, max_length=30, too_long="truncate")
    assert len(cut) == 2 and stats.truncated == 1
    assert len(cut[1]["inputs"]) == 30 and cut[1]["inputs"][-1] == EOS_ID
    with pytest.raises(ValueError, match="data.too_long='cut'"):
        pipeline.tokenize_pairs(pairs, tokenizer, 16, too_long="cut")


def _examples(n=60, seed=0):
    rng = np.random.default_rng(seed)
    return [
        {
            "inputs": np.append(rng.integers(4, 50, rng.integers(1, 12)), EOS_ID).astype(np.int32),
            "targets": np.append(rng.integers(4, 50, rng.integers(1, 12)), EOS_ID).astype(np.int32),
        }
        for _ in range(n)
    ]


def test_epoch_plan_uses_every_example_once_and_fits():
    exs = _examples(200)
    lengths = np.array([[len(e["inputs"]), len(e["targets"])] for e in exs])
    plan = packing.plan_epoch(lengths, np.random.default_rng(0).permutation(200), 8, 24)
    seen = sorted(i for batch in plan for row in batch for i in row)
    assert seen == list(range(200))
    for batch in plan:
        assert len(batch) == 8
        for row in batch:
            assert lengths[row].sum(axis=0).max(initial=0) <= 24


def test_packed_batch_layout():
    exs = _examples(40)
    it = packing.train_iterator(exs, batch_size=4, max_length=24, seed=1, prefetch=0)
    b = next(it)
    for key in ("inputs", "targets"):
        seg, pos, tok = b[f"{key}_segment_ids"], b[f"{key}_positions"], b[key]
        assert ((tok != 0) == (seg != 0)).all()
        for row in range(4):
            for s in set(seg[row]) - {0}:
                idx = np.flatnonzero(seg[row] == s)
                assert (pos[row, idx] == np.arange(len(idx))).all()
                assert tok[row, idx[-1]] == EOS_ID


def test_resume_replays_the_same_batches():
    exs = _examples(50)
    it = packing.train_iterator(exs, batch_size=4, max_length=24, seed=3)
    for _ in range(7):  # crosses an epoch boundary
        next(it)
    state = it.get_state()
    expected = [next(it) for _ in range(3)]
    it.close()
    again = packing.train_iterator(exs, batch_size=4, max_length=24, seed=3)
    again.set_state(state)
    for want in expected:
        got = next(again)
        assert all(np.array_equal(got[k], want[k]) for k in want)
    again.close()


def test_epochs_reshuffle_and_processes_are_disjoint():
    exs = _examples(64)
    ds = packing.PackedTrainDataset(exs, batch_size=4, max_length=24, seed=0, pack=True)
    assert ds.plan(0) != ds.plan(1)
    shards = [
        packing.train_iterator(
            exs, batch_size=2, max_length=24, seed=0, prefetch=0, process_index=i, process_count=2
        )
        for i in range(2)
    ]
    ids = [{tuple(r) for r in next(s)["inputs"]} for s in shards]
    assert not ids[0] & ids[1]
    with pytest.raises(ValueError, match="cannot fill its 4 rows of a batch"):
        packing.train_iterator(exs[:3], batch_size=4, max_length=24, seed=0)


def test_subset_sampler_draws_each_pool_in_turn():
    def ex(i):
        return {"inputs": np.array([i, 1], np.int32), "targets": np.array([i, 1], np.int32)}

    fixed, pool = [ex(i) for i in range(5)], [ex(100 + i) for i in range(10)]
    sampler = pipeline.SubsetSampler(fixed, [(pool, 4)], seed=0)
    assert len(sampler) == 9
    epochs = [sampler(e) for e in range(5)]  # 20 draws: two passes over the pool
    assert all(_same_examples(e[:5], fixed) and len(e) == 9 for e in epochs)
    first = [int(x["inputs"][0]) for e in epochs[:2] for x in e[5:]] + [
        int(x["inputs"][0]) for x in epochs[2][5:7]
    ]
    assert sorted(first) == list(range(100, 110)), "the pool once before any repeat"
    drawn = sorted(int(x["inputs"][0]) for e in epochs for x in e[5:])
    assert drawn == sorted(list(range(100, 110)) * 2)
    assert _same_examples(sampler(3), epochs[3]), "the same epoch draws the same pairs"
    other = pipeline.SubsetSampler(fixed, [(pool, 4)], seed=1)
    assert not all(_same_examples(other(e), epochs[e]) for e in range(5))
    with pytest.raises(ValueError, match="cannot draw 11 of a pool of 10"):
        pipeline.SubsetSampler(fixed, [(pool, 11)], seed=0)
    # Packed batches over the draws resume exactly.
    kw = dict(batch_size=2, max_length=8, seed=3, resample=sampler)
    it = packing.train_iterator(sampler(0), **kw)
    for _ in range(7):
        next(it)
    state = it.get_state()
    expected = [next(it) for _ in range(6)]
    it.close()
    again = packing.train_iterator(sampler(0), **kw)
    again.set_state(state)
    for want in expected:
        got = next(again)
        for k in want:
            np.testing.assert_array_equal(got[k], want[k])
    again.close()


def _same_examples(a, b):
    return len(a) == len(b) and all(
        np.array_equal(x[k], y[k]) for x, y in zip(a, b, strict=True) for k in x
    )


def _sampler(tokenizer, n=40, max_length=64):
    texts = [(f"This is sentence number {i}.", f"Das ist Satz Nummer {i}.") for i in range(n)]
    kept = []
    best, _ = pipeline.tokenize_pairs(texts, tokenizer, max_length=64, kept_texts=kept)
    assert kept == texts
    sampler = pipeline.SubwordSampler(kept, best, tokenizer, 0.1, max_length, seed=0)
    return texts, best, sampler


def test_subword_sampling_varies_by_epoch_and_keeps_the_text(tokenizer):
    texts, best, sampler = _sampler(tokenizer)
    e0, e1 = sampler(1), sampler(2)
    assert _same_examples(e0, sampler(1)), "the same epoch gives the same segmentations"
    assert not _same_examples(e0, e1) and not _same_examples(e0, best)
    for ex, (src, tgt) in zip(e1, texts, strict=True):
        assert tokenizer.decode(ex["inputs"]) == src and tokenizer.decode(ex["targets"]) == tgt
        assert ex["inputs"][-1] == EOS_ID and ex["targets"][-1] == EOS_ID
    # A sample longer than max_length falls back to the best segmentation.
    limit = max(max(len(e["inputs"]), len(e["targets"])) for e in best)
    _, _, tight = _sampler(tokenizer, max_length=limit)
    capped = tight(1)
    assert all(max(len(e["inputs"]), len(e["targets"])) <= limit for e in capped)
    assert any(_same_examples([c], [b]) for c, b in zip(capped, best, strict=True))
    with pytest.raises(ValueError, match="3 texts for 40 examples"):
        pipeline.SubwordSampler(texts[:3], best, tokenizer, 0.1, 64, seed=0)


def test_subword_sampling_is_the_same_when_threads_sample_at_once(tokenizer):
    """Epochs sampled on two threads at the same time (an iterator prefetching its
    next epoch while another samples; once seen to flake a full run) give what each
    gives alone. sentencepiece takes its sampling seed process-wide; the sampler holds
    a lock over the seed and the epoch's draws, so this holds whether the library's
    generator is one per thread (0.2.1) or one per process."""
    _, _, sampler = _sampler(tokenizer, n=2000)  # epochs long enough to interleave
    alone = {epoch: sampler(epoch) for epoch in (1, 2)}
    for _ in range(3):
        got = {}
        threads = [
            threading.Thread(target=lambda e=epoch, out=got: out.setdefault(e, sampler(e)))
            for epoch in (1, 2)
        ]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert all(_same_examples(got[e], alone[e]) for e in (1, 2))


def test_subword_sampled_batches_resume_exactly(tokenizer):
    texts, best, sampler = _sampler(tokenizer)
    kw = dict(batch_size=2, max_length=32, seed=3, resample=sampler)
    it = packing.train_iterator(best, **kw)
    first = next(it)
    firsts = [first] + [next(it) for _ in range(3)]
    seen = set()
    for _ in range(12):  # several epochs
        b = next(it)
        for row, seg in zip(b["targets"], b["targets_segment_ids"], strict=True):
            for s in set(seg) - {0}:
                seen.add(tokenizer.decode(row[seg == s]))
    assert seen <= {t for _, t in texts}, "packed samples decode to the training targets"
    state = it.get_state()
    expected = [next(it) for _ in range(4)]
    it.close()
    again = packing.train_iterator(best, **kw)
    again.set_state(state)
    for want in expected:
        got = next(again)
        assert all(np.array_equal(got[k], want[k]) for k in want)
    again.close()
    # Sampled segmentations differ from the best ones (over four batches: a short
    # sentence may sample its best segmentation, and one batch has only a few).
    plain = packing.train_iterator(best, **{**kw, "resample": None})
    plains = [next(plain) for _ in range(4)]
    assert not all(
        np.array_equal(a["targets"], b["targets"]) for a, b in zip(plains, firsts, strict=True)
    )
    plain.close()


def test_packed_loss_equals_padded_loss():
    """The same examples packed several to a row or padded one per row: same loss sums."""
    c = ModelConfig(
        vocab_size=50,
        d_model=32,
        num_heads=4,
        d_ff=64,
        num_encoder_layers=2,
        num_decoder_layers=2,
        max_len=32,
    )
    model = Transformer(c)
    exs = _examples(12, seed=5)
    packed = packing.PackedTrainDataset(exs, batch_size=3, max_length=32, seed=0, pack=True)
    rows = packed.plan(0)[0]
    members = [exs[i] for row in rows for i in row]
    packed_batch = packed.materialize(rows)
    padded_batch = pipeline.eval_batches(members, batch_size=len(members), max_length=32)[0]
    params = unbox(
        model.init(jax.random.key(0), jnp.ones((1, 8), jnp.int32), jnp.ones((1, 8), jnp.int32))
    )["params"]
    a = eval_step(
        params,
        {k: jnp.asarray(v) for k, v in packed_batch.items()},
        model=model,
        label_smoothing=0.1,
    )
    b = eval_step(
        params,
        {k: jnp.asarray(v) for k, v in padded_batch.items()},
        model=model,
        label_smoothing=0.1,
    )
    assert float(a["tokens"]) == float(b["tokens"]) > 0
    for key in ("loss_sum", "nll_sum", "correct"):
        np.testing.assert_allclose(float(a[key]), float(b[key]), rtol=2e-5)
    assert losses.summarize(a)["loss"] > 0


def test_eval_batches_fill_the_last_batch():
    batches = pipeline.eval_batches(_examples(10), batch_size=4, max_length=24)
    assert len(batches) == 3 and batches[-1]["inputs"].shape == (4, 24)
    assert (batches[-1]["inputs"][2:] == 0).all()


def test_single_feature_packing_for_language_models(tokenizer):
    texts = [("This is sentence number 1.",), ("This is sentence number 22.",), ("",)]
    exs, stats = pipeline.tokenize_pairs(texts, tokenizer, max_length=64)
    assert stats.dropped_empty == 1 and set(exs[0]) == {"targets"}
    ds = packing.PackedTrainDataset(exs * 4, batch_size=2, max_length=64, seed=0, pack=True)
    batch = ds.materialize(ds.plan(0)[0])
    assert set(batch) == {"targets", "targets_segment_ids", "targets_positions"}
    assert batch["targets_segment_ids"].max() >= 2  # several texts share a row
