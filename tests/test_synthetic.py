"""Generated long-range tasks (data/synthetic.py): deterministic, correct by construction,
read back through TFDS as written; the classifier head and a recall task train through
the same steps as the language models."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from flaxformer_lite.config import files
from flaxformer_lite.config.experiment import ExperimentConfig
from flaxformer_lite.config.fields import ConfigError
from flaxformer_lite.config.model import ModelConfig
from flaxformer_lite.data import synthetic as S
from flaxformer_lite.data.assembly import check_generated
from flaxformer_lite.model.build import build_model
from flaxformer_lite.training.state import create_train_state, make_optimizer
from flaxformer_lite.training.steps import eval_step, train_step
from tests.fixtures import ROOT, load_config


def _first(spec, split="train", n=3):
    return [e for _, e in zip(range(n), spec.examples(split), strict=False)]


def test_generators_are_deterministic_per_split():
    for spec in (S.Spec("mqar", 64, 8), S.Spec("needle", 32), S.Spec("listops", 64)):
        a, b = _first(spec), _first(spec)
        for x, y in zip(a, b, strict=True):
            assert x.keys() == y.keys() and all(np.array_equal(x[k], y[k]) for k in x)
        other = _first(spec, "test")
        assert any(not np.array_equal(x[k], y[k]) for x, y in zip(a, other, strict=True) for k in x)


def test_mqar_rows_ask_every_key_once_and_score_the_answers():
    for e in _first(S.Spec("mqar", 64, 8), n=20):
        t, w = e["targets"], e["weights"]
        keys, values = t[0:16:2], t[1:16:2]
        assert len(set(keys.tolist())) == 8 and (keys < S.FIRST + S.KEYS).all()
        answers = np.flatnonzero(w)
        assert len(answers) == 8 and answers.min() > 16
        for a in answers:  # the answer is the value the queried key had
            (i,) = np.flatnonzero(keys == t[a - 1])
            assert t[a] == values[i]
        rest = np.setdiff1d(np.arange(16, 64), np.concatenate([answers, answers - 1]))
        assert (t[rest] == S.FILL).all()


def test_recall_distances_point_at_the_copied_value():
    """experiments/long_range/recall_distance.py: each answer's distance leads back to
    the value it copies (the answer's token), one answer per pair."""
    import importlib.util

    path = ROOT / "experiments" / "long_range" / "recall_distance.py"
    spec = importlib.util.spec_from_file_location("recall_distance", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    for e in _first(S.Spec("mqar", 64, 8), n=10):
        t, w = e["targets"], e["weights"]
        answers, dist = module.answer_distances(t, w)
        assert answers.tolist() == np.flatnonzero(w).tolist()
        copied = answers - dist
        assert (t[copied] == t[answers]).all() and (copied < 16).all() and (copied % 2 == 1).all()
        assert sorted(copied.tolist()) == list(range(1, 16, 2))  # each pair asked once
    # Sweeps that differ only in their number of pairs are drawn together.
    assert module._family("mqar/l64_p8_k16") == module._family("mqar/l64_p16_k16")
    assert module._family("mqar/l128_p8") == "mqar/l128" != module._family("mqar/l64_p8_k16")
    assert module.bucket_of(128) == 16  # the committed l128 record's buckets


def test_needle_asks_the_key_at_its_distance():
    seen = set()
    for e in _first(S.Spec("needle", 64), n=40):
        t, d = e["targets"], int(e["group"][0])
        seen.add(d)
        assert np.flatnonzero(e["weights"]).tolist() == [63]
        assert t[62 - d] == t[62]  # the needle's key, d before the query
        assert t[63] == t[62 - d + 1]  # the answer: its value
        assert (t[0:62:2] == t[62]).sum() == 1  # no distractor has the key
    assert seen == set(S.needle_distances(64).tolist()) == {2, 4, 8, 16, 32, 62}


def test_needle_with_fewer_symbols_keeps_its_key_unique():
    spec = S.parse("needle/l64_k4")
    assert spec == S.Spec("needle", 64, 0, 4) and spec.name == "l64_k4"
    assert S.Spec("needle", 64).name == "l64"  # the 128-symbol name is unchanged
    for e in _first(spec, n=40):
        t, d = e["targets"], int(e["group"][0])
        keys, values = t[0:64:2], t[1:64:2]
        assert keys.min() >= S.FIRST and keys.max() < S.FIRST + 4
        assert values.min() >= S.FIRST + S.KEYS and values.max() < S.FIRST + S.KEYS + 4
        assert (t[0:62:2] == t[62]).sum() == 1 and t[62 - d] == t[62]  # 3 keys left, still one
        assert t[63] == t[62 - d + 1]


def test_listops_values_and_lengths():
    assert S.listops_value(("[MAX", [2, 9, ("[MIN", [4, 7]), 0])) == 9
    assert S.listops_value(("[MED", [1, 5, 3])) == 3
    assert S.listops_value(("[MED", [1, 5, 3, 8])) == 4  # the median rounded down
    assert S.listops_value(("[SM", [7, 8, ("[MAX", [1, 9])])) == 4
    tree = ("[MIN", [3, ("[MAX", [2, 6])])
    assert S.listops_symbols(tree) == ["[MIN", "3", "[MAX", "2", "6", "]", "]"]
    names = {i + S.FIRST: s for i, s in enumerate(S.LISTOPS_SYMBOLS)}
    for e in _first(S.Spec("listops", 128), n=20):
        symbols = [names[int(i)] for i in e["inputs"]]
        assert 32 <= len(symbols) <= 128
        assert symbols.count("]") == sum(s.startswith("[") for s in symbols)
        assert 0 <= e["targets"][0] < 10


def test_mqar_with_fewer_symbols_draws_from_them_alone():
    spec = S.parse("mqar/l64_p8_k16")
    assert spec == S.Spec("mqar", 64, 8, 16) and spec.name == "l64_p8_k16"
    assert S.Spec("mqar", 64, 8).name == "l64_p8"  # the 128-symbol names are unchanged
    rows = _first(spec, n=50)
    t = np.stack([e["targets"] for e in rows])
    keys, values = t[:, 0:16:2], t[:, 1:16:2]
    assert keys.min() >= S.FIRST and keys.max() < S.FIRST + 16
    assert values.min() >= S.FIRST + S.KEYS and values.max() < S.FIRST + S.KEYS + 16
    assert len(np.unique(keys)) == 16  # every symbol is used
    full = np.stack([e["targets"] for e in _first(S.Spec("mqar", 64, 8), n=50)])
    assert full[:, 0:16:2].max() >= S.FIRST + 16  # the default draws from all 128


def test_dataset_names_are_checked():
    assert S.parse("ding_de_en") is None
    assert S.parse("mqar/l64_p8") == S.Spec("mqar", 64, 8)
    for bad, words in [
        ("mqar/l64", "mqar/l512_p32"),
        ("needle/x", "needle/l512"),
        ("needle/l64_p8_k16", "needle/l512"),
        ("needle/l64_k1", "k1 symbols must be 2 to 128"),
        ("listops/l64_k16", "listops/l512"),
        ("mqar/l16_p8", r"4 \* pairs <= 16"),
        ("mqar/l64_p8_k4", r"pairs <= 4 \(the k symbols\)"),
        ("mqar/l64_p8_k200", "k200 symbols must be 1 to 128"),
    ]:
        with pytest.raises(ValueError, match=words):
            S.parse(bad)


def test_the_builder_writes_what_the_generator_makes(tmp_path):
    got = S.load_examples("needle/l16", "validation", str(tmp_path))
    want = list(S.Spec("needle", 16).examples("validation"))
    assert len(got) == len(want) == S.SPLITS["validation"]
    for g, w in zip(got[:50], want[:50], strict=True):
        assert g.keys() == w.keys() and all(np.array_equal(g[k], w[k]) for k in g)


def _config(dataset, **changes):
    config = files.load_config(str(ROOT / "experiments" / "long_range" / "config.py"), dataset)
    for key, value in changes.items():
        section, _, name = key.partition(".")
        config[section][name] = value
    return ExperimentConfig.from_config(config)


def test_generated_tasks_are_checked_against_the_config():
    with pytest.raises(ConfigError, match="num_classes >= 2"):
        _config("listops,l64", **{"model.num_classes": 0})
    with pytest.raises(ConfigError, match="data.pack=False"):
        _config("mqar,l64,p8", **{"data.pack": True})
    with pytest.raises(ValueError, match="vocab_size=100 is smaller than mqar's 260"):
        check_generated(_config("mqar,l64,p8", **{"model.vocab_size": 100}))
    with pytest.raises(ValueError, match="is a recall task; set data.task=recall"):
        check_generated(_config("listops,l64", **{"data.dataset": "needle/l64"}))
    with pytest.raises(ValueError, match="data.max_length=32 is shorter"):
        check_generated(_config("mqar,l64,p8", **{"data.max_length": 32}))


def _steps(model_config, task, batches, num_steps, lr=3e-3):
    config = load_config()
    config.optimizer.schedule, config.optimizer.learning_rate = "constant", lr
    config.optimizer.warmup_steps = 10
    tx, schedule = make_optimizer(config.optimizer, model_config, num_steps)
    model = build_model(model_config, task)
    state = create_train_state(model, tx, 0, batches[0]["inputs" if task == "classify" else
                                                      "targets"].shape[1])  # fmt: skip
    step = jax.jit(
        functools.partial(train_step, model=model, tx=tx, schedule=schedule, label_smoothing=0.0)
    )  # the suite's fast compile: 300 steps of this model ran 3x faster than an optimized one
    for i in range(num_steps):
        state, _ = step(state, batches[i % len(batches)])
    return model, state


def test_the_classifier_learns_a_toy_task_to_100_percent():
    """The label is the first token's symbol: the head, its loss on ``targets[:, 0]`` and
    the pooled encoder (learned positions) must all work to fit it."""
    rng = np.random.default_rng(0)
    config = ModelConfig(
        vocab_size=16, d_model=32, num_heads=2, d_ff=64, num_encoder_layers=1,
        num_decoder_layers=0, max_len=8, embedding_dropout=0.0, residual_dropout=0.0,
        positional="learned", num_classes=10,
    )  # fmt: skip

    def batch(n):
        inputs = rng.integers(3, 13, (n, 8)).astype(np.int32)
        targets = np.zeros((n, 8), np.int32)
        targets[:, 0] = inputs[:, 0] - 3
        weights = np.zeros((n, 8), np.int32)
        weights[:, 0] = 1
        return {"inputs": inputs, "targets": targets, "weights": weights}

    model, state = _steps(config, "classify", [batch(32) for _ in range(8)], 300)
    test = {k: jnp.asarray(v) for k, v in batch(256).items()}
    sums = eval_step(state.params, test, model=model, label_smoothing=0.0)
    assert float(sums["tokens"]) == 256  # one target per row
    assert float(sums["correct"]) == 256  # 100%


def test_recall_loss_counts_only_the_answers():
    """With ``weights``, a generated recall task's loss and accuracy are over its answers
    alone; without, over every non-padding token."""
    config = ModelConfig(
        vocab_size=S.VOCAB["mqar"], d_model=16, num_heads=2, d_ff=32, num_encoder_layers=0,
        num_decoder_layers=1, max_len=64,
    )  # fmt: skip
    model = build_model(config, "recall")
    rows = _first(S.Spec("mqar", 64, 8), n=4)
    batch = {k: jnp.asarray(np.stack([r[k] for r in rows])) for k in ("targets", "weights")}
    params = model.init(jax.random.key(0), batch["targets"])["params"]
    scored = eval_step(params, batch, model=model, label_smoothing=0.0)
    everything = eval_step(params, {"targets": batch["targets"]}, model=model, label_smoothing=0.0)
    assert float(scored["tokens"]) == 4 * 8
    assert float(everything["tokens"]) == 4 * 64


def test_a_recall_run_trains_and_scores_accuracy_by_distance(tmp_path, one_device):
    """needle/l16 through train_and_evaluate and the evaluate command's function: the
    validation accuracy is over the answers, the test scores by distance."""
    from flaxformer_lite.inference.evaluation import evaluate_workdir
    from flaxformer_lite.training.train import train_and_evaluate

    config = files.load_config(
        str(ROOT / "experiments" / "long_range" / "config.py"), "needle,l16,debug"
    )
    config.data.data_dir = str(tmp_path / "tfds")
    metrics = train_and_evaluate(config, tmp_path / "run")
    assert (
        metrics["step"] == 6 and metrics["tokens"] == 2 * 8
    )  # :debug: 2 batches of 8 rows, one answer each
    scores = evaluate_workdir(tmp_path / "run", "test", limit=200)
    assert scores["answers"] == 200 and 0 <= scores["accuracy"] <= 1
    assert set(scores["accuracy_by_group"]) == {"2", "4", "8", "14"}
