"""A run's data from its config: PPMI start, auxiliary splits and tags, reversed pairs,
resampled subsets, running text."""

import jax
import numpy as np
import optax
import pytest

from flaxformer_lite.config.experiment import validate_experiment
from flaxformer_lite.config.model import ConfigError
from flaxformer_lite.data import assembly, cooccurrence, pipeline, sources
from flaxformer_lite.data.assembly import prepare_data
from flaxformer_lite.data.tokenizer import UNK_ID
from flaxformer_lite.inference.run import Run
from flaxformer_lite.model.transformer import Transformer
from flaxformer_lite.training.startup import ppmi_embedding_params
from flaxformer_lite.training.state import (
    create_train_state,
)
from flaxformer_lite.training.train import train_and_evaluate
from tests.fixtures import debug_config, load_config


@pytest.mark.slow
def test_ppmi_embedding_init(fixture_data, tmp_path):
    _, data_dir = fixture_data
    config = debug_config(data_dir, num_steps=2, eval_every=2, checkpoint_every=2)
    config.train.embedding_init = "ppmi"
    config.train.embedding_init_splits = "train,train_phrases"
    data = prepare_data(config, tmp_path / "prep")
    state = create_train_state(
        Transformer(validate_experiment(config)), optax.sgd(0.1), 0, config.data.max_length
    )
    params = ppmi_embedding_params(config, data.tokenizer, state.params)
    table = np.asarray(params["shared_embedding"]["embedding"])
    assert not np.allclose(table, state.params["shared_embedding"]["embedding"])
    np.testing.assert_allclose(np.linalg.norm(table, axis=1), 1.0, rtol=1e-5)
    # Everything else is the seed's initialisation.
    rest = {k: v for k, v in params.items() if k != "shared_embedding"}
    jax.tree.map(np.testing.assert_array_equal, rest, {k: state.params[k] for k in rest})
    # The table is the PPMI vectors of both splits' pairs, source and target pieces together.
    sp = data.tokenizer.sp
    documents = [
        np.array(sp.encode(en) + sp.encode(de))
        for split in ("train", "train_phrases")
        for en, de in sources.load_texts("ding_de_en", split, ("en", "de"), data_dir)
    ]
    want, _ = cooccurrence.ppmi_embeddings(documents, 100, 32, seed=config.train.seed)
    np.testing.assert_allclose(table, want, atol=1e-5)
    # The training loop starts from that table: with the embeddings' learning rate at 0
    # the run's checkpoint still holds it.
    config.optimizer.embedding_lr_scale = 0.0
    train_and_evaluate(config, tmp_path / "run")
    trained, step = Run.open(tmp_path / "run").params("last")
    assert step == 2
    np.testing.assert_allclose(trained["shared_embedding"]["embedding"], want, atol=1e-5)


def test_auxiliary_split_filter_and_tag(fixture_data, tmp_path):
    """Phrase pairs join training only when their words are the main split's, tagged."""
    _, data_dir = fixture_data
    config = debug_config(data_dir)
    config.data.train_splits = "train,train_phrases"
    config.data.aux_min_count = 1
    config.data.aux_tag = "<dict>"
    data = prepare_data(config, tmp_path)
    tag = data.tokenizer.sp.piece_to_id("<dict>")
    assert tag != UNK_ID
    main = sources.load_texts("ding_de_en", "train", ("en", "de"), data_dir)
    phrases = sources.load_texts("ding_de_en", "train_phrases", ("en", "de"), data_dir)
    kept = sources.known_word_pairs(phrases, sources.word_counts(main), 1)
    # The numbered fixture sentences know "sentence"/"Satz", not "eel"/"Aal".
    assert ("sentence", "Satz") in kept and ("eel", "Aal") not in kept
    assert 0 < len(kept) < len(phrases)
    tagged = [ex for ex in data.train if tag in ex["inputs"]]
    assert len(tagged) == len(kept)
    assert len(data.train) == len(main) + len(kept)
    for ex in tagged:
        assert tag in ex["inputs"][:2] and tag not in ex["targets"]
    # A run trained without the tag cannot silently resume with one.
    config.data.aux_tag = ""
    prepare_data(config, tmp_path / "untagged")
    config.data.aux_tag = "<dict>"
    with pytest.raises(ValueError, match="no piece for the tag '<dict>'"):
        prepare_data(config, tmp_path / "untagged")


def test_reverse_tag_trains_both_directions(fixture_data, tmp_path):
    """Every pair also appears reversed, its German source led by the tag; the
    configured direction stays untagged (the Translator needs no tag)."""
    _, data_dir = fixture_data
    config = debug_config(data_dir)
    config.data.train_splits = "train"  # the default's tagged phrase pairs aside
    config.data.reverse_tag = "<2en>"
    data = prepare_data(config, tmp_path)
    sp = data.tokenizer.sp
    tag = sp.piece_to_id("<2en>")
    assert tag != UNK_ID
    main = sources.load_texts("ding_de_en", "train", ("en", "de"), data_dir)
    assert len(data.train) == 2 * len(main)
    forward = {
        (sp.decode(ex["inputs"].tolist()), sp.decode(ex["targets"].tolist()))
        for ex in data.train
        if tag not in ex["inputs"]
    }
    reverse = {
        (
            sp.decode([i for i in ex["inputs"].tolist() if i != tag]),
            sp.decode(ex["targets"].tolist()),
        )
        for ex in data.train
        if tag in ex["inputs"]
    }
    # sentencepiece writes "<2en> ..." as "▁", "<2en>", ...: the tag leads the source.
    assert all(tag in ex["inputs"][:2] for ex in data.train if tag in ex["inputs"])
    assert forward == set(main)
    assert reverse == {(de, en) for en, de in main}
    assert not any(tag in ex["inputs"] or tag in ex["targets"] for ex in data.validation)
    # With tagged auxiliary pairs, both tags lead the reversed source; no target holds one.
    config.data.train_splits = "train,train_phrases"
    config.data.aux_min_count = 0  # every phrase pair
    config.data.aux_tag = "<dict>"
    data = prepare_data(config, tmp_path / "with_aux")
    sp = data.tokenizer.sp
    tags = {sp.piece_to_id("<2en>"), sp.piece_to_id("<dict>")}
    assert not any(tags & set(ex["targets"].tolist()) for ex in data.train)
    both = [ex for ex in data.train if tags <= set(ex["inputs"].tolist())]
    phrases = sources.load_texts("ding_de_en", "train_phrases", ("en", "de"), data_dir)
    assert len(both) == len(phrases)


@pytest.mark.slow
def test_resampled_auxiliary_subset(fixture_data, tmp_path):
    """data.resample_subsets: split:N keeps all its pairs in a pool and each epoch
    draws N of them in turn (per direction with reverse_tag), the main split fixed;
    a short run trains on the draws."""
    _, data_dir = fixture_data
    config = debug_config(data_dir, num_steps=4, checkpoint_every=4, eval_every=4)
    config.data.train_splits = "train,train_phrases:3"
    config.data.aux_min_count = 0
    config.data.aux_tag = "<dict>"
    config.data.resample_subsets = True
    data = prepare_data(config, tmp_path / "data")
    main = sources.load_texts("ding_de_en", "train", ("en", "de"), data_dir)
    phrases = sources.load_texts("ding_de_en", "train_phrases", ("en", "de"), data_dir)
    assert len(phrases) > 3
    assert len(data.train) == len(main)
    [(pool, count)] = data.train_pools
    assert (len(pool), count) == (len(phrases), 3)
    tag = data.tokenizer.sp.piece_to_id("<dict>")
    assert tag != UNK_ID and all(tag in ex["inputs"][:2] for ex in pool)
    sampler = data.sampler(0)
    epochs = [sampler(e) for e in range(len(phrases))]  # 3 full passes over the pool
    assert all(len(e) == len(main) + 3 for e in epochs)
    drawn = [tuple(ex["inputs"]) for e in epochs for ex in e[len(main) :]]
    assert sorted(drawn) == sorted([tuple(ex["inputs"]) for ex in pool] * 3)
    with_reverse = config.copy_and_resolve_references()
    with_reverse.data.reverse_tag = "<2en>"
    data = prepare_data(with_reverse, tmp_path / "reverse")
    assert len(data.train) == 2 * len(main)
    assert [(len(p), n) for p, n in data.train_pools] == [(len(phrases), 3)] * 2
    metrics = train_and_evaluate(config, tmp_path / "run")
    assert np.isfinite(metrics["loss"])


def test_known_word_pairs():
    main = [("The house is old.", "Das Haus ist alt."), ("A house.", "Ein Haus.")]
    counts = sources.word_counts(main)
    aux = [("house", "Haus"), ("the old house", "das alte Haus"), ("a", "ein"), ("...", "…")]
    assert sources.known_word_pairs(aux, counts, 1) == [("house", "Haus"), ("a", "ein")]
    assert sources.known_word_pairs(aux, counts, 2) == [("house", "Haus")]


def test_stream_rows_cut_running_text():
    class Chars:  # a stand-in tokenizer: one id per character, then EOS
        def encode_batch(self, texts):
            return [np.array([3 + ord(c) % 50 for c in t] + [1], np.int32) for t in texts]

    texts = [("abc",), ("",), ("defgh",), ("ij",)]
    rows, stats = pipeline.stream_rows(texts, Chars(), 4)
    stream = np.concatenate([r["targets"] for r in rows])
    assert len(stream) == 3 + 1 + 5 + 1 + 2 + 1 and stats.dropped_empty == 1
    assert [len(r["targets"]) for r in rows] == [4, 4, 4, 1]
    assert list(stream[:4]) == [3 + ord("a") % 50, 3 + ord("b") % 50, 3 + ord("c") % 50, 1]
    with pytest.raises(ConfigError, match="stream=True needs data.task='lm'"):
        config = load_config("ende_small")
        config.data.stream = True
        validate_experiment(config)


def test_the_tokenizer_learns_from_a_bounded_sample_of_whole_pairs(monkeypatch):
    """sentencepiece holds ~20 bytes per character it learns from: the sample is bounded
    in sentences and in characters, a prefix of the same seeded order of whole pairs
    (tagged as trained), read a chunk at a time."""
    monkeypatch.setattr(assembly, "_CHUNK", 7)  # several chunks
    rows = {"main": [(f"s{i}" * (1 + i % 3), f"t{i}") for i in range(40)],
            "aux": [(f"p{i}", f"q{i}") for i in range(25)]}  # fmt: skip

    class Split:  # a selection's reader over the rows above
        def __init__(self, name, aux=""):
            self.index, self.aux, self.name = np.arange(len(rows[name])), aux, name

        def rows(self, positions):
            return [rows[self.name][i] for i in self.index[positions]]

    selections = [Split("main"), Split("aux", "<dict> ")]
    everything = list(assembly.tokenizer_sentences(selections, 10_000, 2))
    assert len(everything) == 2 * 65 and "<dict> p0" in everything and "s0" in everything
    assert sorted(everything[0::2]) == sorted(
        [s for s, _ in rows["main"]] + [f"<dict> p{i}" for i in range(25)]
    )  # each pair once, its source before its target
    by_sentences = list(assembly.tokenizer_sentences(selections, 30, 2))
    assert by_sentences == everything[:30]
    budget = sum(len(t) for t in everything[:20]) + 1  # 10 pairs and a character
    by_characters = list(assembly.tokenizer_sentences(selections, 10_000, 2, budget))
    assert by_characters == everything[:20]  # whole pairs: the 11th does not fit
