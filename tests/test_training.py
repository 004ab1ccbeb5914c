"""Training: schedules, loss, pmap == jit, resume, bad input, the CLI."""

import functools
import json
import os
import pathlib
import subprocess
import sys

import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
import optax
import pytest

from flaxformer_lite import checkpoints as ckpt_lib
from flaxformer_lite import experiment
from flaxformer_lite.architectures.transformer import Transformer
from flaxformer_lite.config import ConfigError, ModelConfig
from flaxformer_lite.data import cooccurrence, pipeline
from flaxformer_lite.data.tokenizer import UNK_ID
from flaxformer_lite.experiment import ADDED_FIELDS, validate_experiment, with_added_fields
from flaxformer_lite.training import losses, schedules
from flaxformer_lite.training.average import abstract_train_state, average_workdir
from flaxformer_lite.training.parallel import DataParallel
from flaxformer_lite.training.state import (
    TrainState,
    build_model,
    create_train_state,
    evaluation_params,
    make_optimizer,
    params_ema,
)
from flaxformer_lite.training.steps import train_step
from flaxformer_lite.training.train import (
    TrainingError,
    _ppmi_embedding_params,
    prepare_data,
    train_and_evaluate,
)
from flaxformer_lite.translate import Translator
from tests import fixtures

ROOT = pathlib.Path(__file__).resolve().parents[1]


def load_config(name="ende_small", arg="debug"):
    return experiment.load_config(str(ROOT / "configs" / f"{name}.py"), arg)


# Schedules and loss ------------------------------------------------------------------


@pytest.mark.parametrize("count", [0, 1, 99, 3999, 4000, 4001, 99_999])
def test_noam_is_the_papers_formula(count):
    step = count + 1  # the paper counts steps from 1
    want = 512**-0.5 * min(step**-0.5, step * 4000**-1.5)
    got = float(schedules.noam(512, 4000)(count))
    assert got == pytest.approx(want, rel=1e-6)


def test_noam_peak_and_scale():
    s = schedules.noam(512, 4000, scale=2.0)
    values = [float(s(c)) for c in range(3990, 4010)]
    assert max(values) == pytest.approx(2 * 512**-0.5 * 4000**-0.5, rel=1e-5)
    assert int(np.argmax(values)) + 3990 + 1 == 4000


def test_cooldown_factor_by_steps_is_with_cooldown():
    """With no clock the host-side factor is the in-graph cooldown of
    ``fraction * num_steps`` updates, update for update (``step`` is 1-based)."""
    ramp = schedules.with_cooldown(schedules.constant(1.0), total_steps=50, cooldown_steps=10)
    for step in range(1, 51):
        got = schedules.cooldown_factor(0.2, step, 50)
        assert got == pytest.approx(float(ramp(step - 1)), abs=1e-7), step
    assert schedules.cooldown_factor(0.2, 50, 50) == pytest.approx(0.1)
    assert schedules.cooldown_factor(0.0, 50, 50) == 1.0


def test_cooldown_factor_by_time_and_the_nearer_end():
    f = functools.partial(schedules.cooldown_factor, 0.25, num_steps=1000, budget_seconds=400.0)
    assert f(step=10, seconds_left=300.0) == 1.0  # before the last 100 s
    assert f(step=10, seconds_left=100.0) == pytest.approx(1.0)
    assert f(step=10, seconds_left=50.0) == pytest.approx(0.5)
    assert f(step=10, seconds_left=-5.0) == 0.0  # past the deadline: no update at all
    # The steps end first: their ramp wins (update 951 of 1000 has 50 of 250 left).
    assert f(step=951, seconds_left=300.0) == pytest.approx(0.2)
    with pytest.raises(ValueError, match="cooldown fraction 1.5 must be in"):
        schedules.cooldown_factor(1.5, 1, 10)


def test_lr_factor_scales_the_learning_rate_exactly():
    """Adam, then the factor, then the parameter average: factor f is Adam at f
    times the rate, and the average sees the scaled steps."""
    params = {"w": jnp.array([1.0, -2.0, 3.0]), "b": jnp.array(0.5)}
    grads = [
        {"w": jnp.array([0.3, -0.1, 0.2]) * (k + 1), "b": jnp.array(0.1 - 0.05 * k)}
        for k in range(3)
    ]
    opt = ml_collections.ConfigDict(
        {
            "b1": 0.9,
            "b2": 0.98,
            "eps": 1e-9,
            "schedule": "constant",
            "learning_rate": 1e-2,
            "warmup_steps": 0,
            "cooldown_steps": 0,
            "cooldown_fraction": 0.5,
            "clip_grad_norm": 0.0,
            "grad_accum_steps": 1,
            "weight_decay": 0.0,
            "ema_decay": 0.9,
        }
    )
    model = ModelConfig(d_model=8)
    scaled, _ = make_optimizer(opt, model, 10)
    factors = [1.0, 0.5, 0.25]
    s_state, s_params = scaled.init(params), params
    for g, f in zip(grads, factors, strict=True):
        u, s_state = scaled.update(g, s_state, s_params, lr_factor=jnp.float32(f))
        s_params = optax.apply_updates(s_params, u)
    # The reference: plain Adam whose rate is the factor times 1e-2, at each step.
    ref = optax.inject_hyperparams(optax.adam)(learning_rate=1e-2, b1=0.9, b2=0.98, eps=1e-9)
    r_state, r_params, ema = ref.init(params), params, None
    for k, (g, f) in enumerate(zip(grads, factors, strict=True)):
        r_state.hyperparams["learning_rate"] = jnp.float32(1e-2 * f)
        u, r_state = ref.update(g, r_state, r_params)
        r_params = optax.apply_updates(r_params, u)
        w = 0.1 / (1 - 0.9 ** (k + 1))
        new = r_params
        ema = new if ema is None else jax.tree.map(lambda e, p, w=w: e + w * (p - e), ema, new)
    for name in params:
        np.testing.assert_allclose(s_params[name], r_params[name], rtol=1e-6)
    state = TrainState(step=jnp.int32(3), params=s_params, opt_state=s_state, rng=None)
    for name, value in evaluation_params(state).items():
        np.testing.assert_allclose(value, ema[name], rtol=1e-6)
    with pytest.raises(ValueError, match="call tx.update\\(g, s, params, lr_factor=f\\)"):
        scaled.update(grads[0], s_state, s_params)


def test_other_schedules():
    cos = schedules.warmup_cosine(1e-3, 10, 100)
    assert float(cos(0)) == 0.0 and float(cos(10)) == pytest.approx(1e-3)
    assert float(cos(100)) == pytest.approx(0.0, abs=1e-9)
    const = schedules.constant(5e-4, warmup_steps=4)
    assert float(const(2)) == pytest.approx(2.5e-4) and float(const(50)) == pytest.approx(5e-4)


def test_cooldown_scales_the_tail_linearly_to_zero():
    base = schedules.noam(256, 10)
    cooled = schedules.with_cooldown(base, total_steps=100, cooldown_steps=20)
    for count in (0, 5, 10, 50, 80):  # before the cooldown: untouched
        assert float(cooled(count)) == pytest.approx(float(base(count)), rel=1e-6)
    for count in (81, 90, 99):  # update 100 - k is scaled by k / 20
        want = float(base(count)) * (100 - count) / 20
        assert float(cooled(count)) == pytest.approx(want, rel=1e-5)
    assert float(cooled(100)) == 0.0 and float(cooled(150)) == 0.0
    assert schedules.with_cooldown(base, 100, 0) is base
    with pytest.raises(ValueError, match="cooldown_steps=101 exceeds the run's 100 updates"):
        schedules.with_cooldown(base, 100, 101)


def test_params_ema_is_the_bias_corrected_average():
    decay = 0.9
    tx = optax.chain(optax.sgd(0.1), params_ema(decay))
    params = {"w": jnp.array([1.0, -2.0])}
    state = tx.init(params)
    history = []
    for i in range(6):
        grads = {"w": jnp.array([0.5 + i, 1.0 - i])}
        updates, state = tx.update(grads, state, params)
        params = optax.apply_updates(params, updates)
        history.append(np.asarray(params["w"], np.float64))
    # Zero-initialised EMA divided by (1 - decay^t), in float64.
    m = np.zeros(2)
    for p in history:
        m = decay * m + (1 - decay) * p
    want = m / (1 - decay ** len(history))
    ema = state[1].ema["w"]
    np.testing.assert_allclose(np.asarray(ema), want, rtol=1e-6)
    fake = TrainState(jnp.zeros([], jnp.int32), params, state, jnp.zeros(2, jnp.uint32))
    np.testing.assert_allclose(np.asarray(evaluation_params(fake)["w"]), want, rtol=1e-6)
    plain = fake.replace(opt_state=optax.sgd(0.1).init(params))
    assert evaluation_params(plain) is params
    with pytest.raises(ValueError, match="decay 1.0 must be in"):
        params_ema(1.0)


def test_embedding_lr_scale_scales_only_token_embeddings():
    config = load_config()
    model_config = validate_experiment(config)
    model = Transformer(model_config)
    state = create_train_state(model, optax.sgd(1.0), 0, 8)
    grads = jax.tree.map(jnp.ones_like, state.params)
    updates = {}
    for scale in (1.0, 0.25):
        config.optimizer.embedding_lr_scale = scale
        tx, _ = make_optimizer(config.optimizer, model_config, 100)
        updates[scale], _ = tx.update(grads, tx.init(state.params), state.params)
    for path, full in jax.tree_util.tree_flatten_with_path(updates[1.0])[0]:
        scaled = dict(jax.tree_util.tree_flatten_with_path(updates[0.25])[0])[path]
        factor = 0.25 if jax.tree_util.keystr(path) == "['shared_embedding']['embedding']" else 1
        np.testing.assert_allclose(scaled, factor * full, rtol=1e-6)


@pytest.mark.parametrize("smoothing", [0.0, 0.1])
def test_loss_matches_float64_reference(smoothing):
    rng = np.random.default_rng(0)
    logits = rng.normal(size=(2, 5, 11)) * 3
    labels = rng.integers(0, 11, (2, 5))
    got_s, got_nll = losses.token_losses(
        jnp.asarray(logits, jnp.float32), jnp.asarray(labels), smoothing
    )
    logp = logits - np.log(np.exp(logits).sum(-1, keepdims=True))
    q = np.full(logits.shape, smoothing / 10)
    np.put_along_axis(q, labels[..., None], 1 - smoothing, axis=-1)
    np.testing.assert_allclose(got_s, -(q * logp).sum(-1), rtol=1e-5)
    np.testing.assert_allclose(
        got_nll, -np.take_along_axis(logp, labels[..., None], -1)[..., 0], rtol=1e-5
    )


def test_loss_normalised_by_real_tokens():
    logits = jnp.zeros((1, 4, 7))
    labels = jnp.array([[3, 4, 0, 0]])
    s = losses.sums(logits, labels, (labels != 0).astype(jnp.float32), 0.0)
    m = losses.summarize(s)
    assert float(m["tokens"]) == 2 and float(m["nll"]) == pytest.approx(np.log(7), rel=1e-6)
    assert float(m["perplexity"]) == pytest.approx(7.0, rel=1e-5)


def test_accuracy_is_argmax_and_ties_count_as_wrong():
    rng = np.random.default_rng(1)
    logits = jnp.asarray(rng.normal(size=(3, 6, 13)), jnp.float32)
    labels = jnp.asarray(rng.integers(0, 13, (3, 6)))
    labels = labels.at[0, :3].set(jnp.argmax(logits[0, :3], -1))  # some certainly right
    weights = jnp.ones((3, 6))
    s = losses.sums(logits, labels, weights, 0.1)
    assert float(s["correct"]) == float(jnp.sum(jnp.argmax(logits, -1) == labels)) >= 3
    flat = losses.sums(jnp.zeros((1, 4, 7)), jnp.array([[1, 2, 3, 4]]), jnp.ones((1, 4)), 0.1)
    assert float(flat["correct"]) == 0.0


# Parallelism -----------------------------------------------------------------------


def _tiny_setup(batch_size=8, cooldown_fraction=0.0):
    c = ModelConfig(
        vocab_size=60,
        d_model=32,
        num_heads=4,
        d_ff=64,
        num_encoder_layers=1,
        num_decoder_layers=1,
        max_len=32,
        residual_dropout=0.0,
        embedding_dropout=0.0,
    )
    config = load_config()
    config.optimizer.cooldown_fraction = cooldown_fraction
    tx, schedule = make_optimizer(config.optimizer, c, 100)
    model = Transformer(c)
    state = create_train_state(model, tx, 0, 16)
    exs = [
        {
            "inputs": np.array([5 + i % 40, 6, 7, 1], np.int32),
            "targets": np.array([8, 9 + i % 30, 1], np.int32),
        }
        for i in range(64)
    ]
    it = pipeline.train_iterator(exs, batch_size=batch_size, max_length=16, seed=0, prefetch=0)
    batches = [next(it) for _ in range(3)]
    step = functools.partial(train_step, model=model, tx=tx, schedule=schedule, label_smoothing=0.1)
    return state, batches, step


def _run(kind, state, batches, step_fn, factors=None):
    par = DataParallel(kind)
    fn = par.train_step(step_fn.func, **step_fn.keywords)
    s = par.put_state(state)
    out = []
    for b, f in zip(batches, factors or [None] * len(batches), strict=True):
        s, m = fn(s, par.put_batch(b), f)
        out.append(par.metrics_to_host(m))
    return out, par.params_of(s)


@pytest.mark.parametrize("factors", [None, [1.0, 0.6, 0.3]], ids=["schedule", "lr_factor"])
def test_pmap_equals_jit_on_8_devices(factors):
    assert jax.device_count() == 8, "run with XLA_FLAGS=--xla_force_host_platform_device_count=8"
    cooldown = 0.5 if factors else 0.0
    state, batches, step = _tiny_setup(cooldown_fraction=cooldown)
    jit_metrics, jit_params = _run("jit", state, batches, step, factors)
    state, _, _ = _tiny_setup(cooldown_fraction=cooldown)  # the jit run donated the state
    pmap_metrics, pmap_params = _run("pmap", state, batches, step, factors)
    for a, b in zip(jit_metrics, pmap_metrics, strict=True):
        for key in ("loss", "nll", "accuracy", "tokens", "grad_norm", "learning_rate"):
            assert a[key] == pytest.approx(b[key], rel=1e-5), key
    # Key biases are skipped: their true gradient is exactly zero (a key bias adds the
    # same q.b to every logit of a row, which softmax ignores), so both paths compute
    # rounding noise of ~1e-9 that Adam with the paper's eps=1e-9 turns into full steps.
    flat_pmap = dict(jax.tree_util.tree_flatten_with_path(pmap_params)[0])
    compared = 0
    for path, x in jax.tree_util.tree_flatten_with_path(jit_params)[0]:
        name = jax.tree_util.keystr(path)
        if name.endswith("['key']['bias']"):
            continue
        # atol: float32 summation order differs (all-reduce vs psum), ~0.02% of one step.
        np.testing.assert_allclose(x, flat_pmap[path], rtol=1e-4, atol=1e-5, err_msg=name)
        compared += 1
    assert compared > 20


def test_concurrent_splits_give_the_same_step(kind="jit"):
    """Splitting the batch into independent chains changes nothing but the dropout draws
    (jit over 8 devices: the row groups are cut from a sharded batch; pmap runs the same
    step function per device)."""
    state, batches, step = _tiny_setup(batch_size=16)  # 2 rows per device
    whole_metrics, whole_params = _run(kind, state, batches[:2], step)
    state, _, _ = _tiny_setup(batch_size=16)
    split = functools.partial(step.func, **step.keywords, concurrent_splits=2)
    split_metrics, split_params = _run(kind, state, batches[:2], split)
    for a, b in zip(whole_metrics, split_metrics, strict=True):
        for key in ("loss", "nll", "accuracy", "tokens", "grad_norm"):
            assert a[key] == pytest.approx(b[key], rel=1e-5), key
    for (path, x), y in zip(
        jax.tree_util.tree_flatten_with_path(whole_params)[0],
        jax.tree.leaves(split_params),
        strict=True,
    ):
        if not jax.tree_util.keystr(path).endswith("['key']['bias']"):  # see above
            np.testing.assert_allclose(x, y, rtol=1e-4, atol=1e-5)


def test_batch_must_divide_among_devices():
    with pytest.raises(ValueError, match="not divisible by the 8 devices"):
        DataParallel("jit").check_batch_size(12)


# End to end on fixture data ----------------------------------------------------------


@pytest.fixture(scope="module")
def fixture_data(tmp_path_factory):
    return fixtures.build_ding_dataset(tmp_path_factory.mktemp("ding"))


def debug_config(data_dir, **train):
    config = load_config()
    config.model.vocab_size = 100  # the fixture corpus supports ~108 pieces
    # Dropout on, whatever the default config says, so that the resume and averaging
    # tests always exercise the dropout keys.
    config.model.residual_dropout = 0.1
    config.model.embedding_dropout = 0.1
    config.data.data_dir = str(data_dir)
    for k, v in train.items():
        config.train[k] = v
    return config


def _last_params(workdir, config):
    target = abstract_train_state(config).params
    params, step = ckpt_lib.restore_params(workdir, target, kind="last")
    return params, step


def test_resume_is_exact(fixture_data, tmp_path):
    _, data_dir = fixture_data
    straight = tmp_path / "straight"
    train_and_evaluate(debug_config(data_dir, num_steps=6, checkpoint_every=3), straight)
    split = tmp_path / "split"
    train_and_evaluate(debug_config(data_dir, num_steps=3, checkpoint_every=3), split)
    metrics = train_and_evaluate(debug_config(data_dir, num_steps=6, checkpoint_every=3), split)
    assert {"loss", "nll", "perplexity", "accuracy"} <= set(metrics)
    a, step_a = _last_params(straight, debug_config(data_dir))
    b, step_b = _last_params(split, debug_config(data_dir))
    assert step_a == step_b == 6
    jax.tree.map(np.testing.assert_array_equal, a, b)
    # Averaging the last two checkpoints (3 and 6), of the moving average the run
    # evaluated with (the default config keeps one).
    average_workdir(split, 2)
    avg, _ = ckpt_lib.restore_params(split, a, kind="averaged")
    target = abstract_train_state(debug_config(data_dir))
    state3, _ = ckpt_lib.Checkpoints(split).restore(target, 3)
    state6, _ = ckpt_lib.Checkpoints(split).restore(target, 6)
    assert debug_config(data_dir).optimizer.ema_decay > 0
    mean = jax.tree.map(
        lambda x, y: (np.asarray(x) + np.asarray(y)) / 2,
        evaluation_params(state6),
        evaluation_params(state3),
    )
    jax.tree.map(
        lambda m, want: np.testing.assert_allclose(np.asarray(m), want, rtol=1e-6), avg, mean
    )
    # Averaging again with another count replaces the average (same last step).
    average_workdir(split, 1)
    again, _ = ckpt_lib.restore_params(split, a, kind="averaged")
    jax.tree.map(
        lambda m, want: np.testing.assert_allclose(np.asarray(m), np.asarray(want), rtol=1e-6),
        again,
        evaluation_params(state6),
    )


def test_time_budget_stops_early_with_a_checkpoint_and_resumes(fixture_data, tmp_path, capsys):
    _, data_dir = fixture_data
    # A budget that has run out before the first step: one step is taken, then the run
    # stops there, evaluated and checkpointed as if that step were the last.
    config = debug_config(data_dir, num_steps=6, checkpoint_every=4, eval_every=4)
    config.train.max_minutes = 1e-6
    metrics = train_and_evaluate(config, tmp_path)
    assert {"loss", "accuracy"} <= set(metrics)
    out = capsys.readouterr().out
    assert "done: step 1 (1 this run)" in out
    assert "train.max_minutes=1e-06 reached before step 6" in out
    assert "validation @ 1:" in out
    _, step = _last_params(tmp_path, config)
    assert step == 1
    # The budget is the run's, over resumes: running the same command again trains nothing.
    train_and_evaluate(config, tmp_path)
    out = capsys.readouterr().out
    assert "train.max_minutes=1e-06 already spent on this run" in out
    assert "done: step 1 (0 this run)" in out
    _, step = _last_params(tmp_path, config)
    assert step == 1
    # Without the budget the same workdir resumes there and trains to num_steps.
    config.train.max_minutes = 0.0
    train_and_evaluate(config, tmp_path)
    assert "done: step 6 (5 this run)" in capsys.readouterr().out
    _, step = _last_params(tmp_path, config)
    assert step == 6


def _logged_rates(workdir) -> dict[int, float]:
    lines = (workdir / "metrics.jsonl").read_text().splitlines()
    records = [json.loads(line) for line in lines]
    return {r["step"]: r["learning_rate"] for r in records if r["split"] == "train"}


def test_cooldown_fraction_ramps_the_rate_to_zero_by_steps_and_by_the_clock(
    fixture_data, tmp_path, capsys
):
    _, data_dir = fixture_data
    config = debug_config(data_dir, num_steps=6, log_every=1, eval_every=6, checkpoint_every=6)
    config.optimizer.cooldown_fraction = 0.5
    config.train.embedding_init = "random"  # the initial parameters are create_train_state's
    train_and_evaluate(config, tmp_path / "steps")
    assert "cooldown from step 5: the learning rate falls linearly to 0" in capsys.readouterr().out
    noam = schedules.noam(config.model.d_model, config.optimizer.warmup_steps)
    rates = _logged_rates(tmp_path / "steps")
    for step, factor in ((1, 1.0), (4, 1.0), (5, 2 / 3), (6, 1 / 3)):
        assert rates[step] == pytest.approx(float(noam(step - 1)) * factor, rel=1e-6), step
    # A budget spent before the first step: the one step taken has a factor of 0, so
    # it leaves the initial parameters as they were.
    config.train.max_minutes = 1e-6
    train_and_evaluate(config, tmp_path / "clock")
    assert _logged_rates(tmp_path / "clock") == {1: 0.0}
    params, step = _last_params(tmp_path / "clock", config)
    assert step == 1
    model = build_model(experiment.validate_experiment(config))
    init = create_train_state(model, make_optimizer(config.optimizer, model.config, 6)[0], 0, 32)
    jax.tree.map(np.testing.assert_array_equal, params, init.params)


def test_ema_run_evaluates_and_keeps_the_average(fixture_data, tmp_path):
    _, data_dir = fixture_data
    config = debug_config(data_dir, num_steps=4, eval_every=4, checkpoint_every=4)
    config.optimizer.ema_decay = 0.5
    train_and_evaluate(config, tmp_path)
    state, _ = ckpt_lib.Checkpoints(tmp_path).restore(abstract_train_state(config), 4)
    ema = evaluation_params(state)
    best, step = ckpt_lib.restore_params(tmp_path, state.params, kind="best")
    assert step == 4
    jax.tree.map(np.testing.assert_array_equal, best, ema)
    differs = jax.tree.map(
        lambda a, b: bool(np.any(np.asarray(a) != np.asarray(b))), ema, state.params
    )
    assert any(jax.tree.leaves(differs))  # the average is not the last parameters
    # The last checkpoint translates, and averages, with the moving average too.
    last = Translator.from_workdir(tmp_path, kind="last")
    assert last.checkpoint == "last checkpoint, step 4"
    jax.tree.map(np.testing.assert_array_equal, last.params, ema)
    average_workdir(tmp_path, 1)
    averaged, _ = ckpt_lib.restore_params(tmp_path, state.params, kind="averaged")
    jax.tree.map(np.testing.assert_array_equal, averaged, ema)


def test_ppmi_embedding_init(fixture_data, tmp_path, capsys):
    _, data_dir = fixture_data
    config = debug_config(data_dir, num_steps=2, eval_every=2, checkpoint_every=2)
    config.train.embedding_init = "ppmi"
    config.train.embedding_init_splits = "train,train_phrases"
    data = prepare_data(config, tmp_path / "prep")
    state = create_train_state(
        Transformer(validate_experiment(config)), optax.sgd(0.1), 0, config.data.max_length
    )
    params = _ppmi_embedding_params(config, data.tokenizer, state.params)
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
        for en, de in pipeline.load_texts("ding_de_en", split, ("en", "de"), data_dir)
    ]
    want, _ = cooccurrence.ppmi_embeddings(documents, 100, 32, seed=config.train.seed)
    np.testing.assert_allclose(table, want, atol=1e-5)
    train_and_evaluate(config, tmp_path / "run")
    assert "embeddings: PPMI vectors for" in capsys.readouterr().out


def test_other_models_workdir_is_refused(fixture_data, tmp_path):
    _, data_dir = fixture_data
    train_and_evaluate(debug_config(data_dir, num_steps=2), tmp_path)
    other = debug_config(data_dir, num_steps=2)
    other.model.d_ff = 128
    with pytest.raises(TrainingError, match=r"different model \(model.d_ff: 64 -> 128\)"):
        train_and_evaluate(other, tmp_path)


def test_nan_loss_stops_with_the_step_and_keeps_the_checkpoint(fixture_data, tmp_path):
    _, data_dir = fixture_data
    config = debug_config(data_dir, num_steps=40, checkpoint_every=2, log_every=2, eval_every=40)
    config.optimizer.schedule = "constant"
    config.optimizer.warmup_steps = 0
    config.optimizer.clip_grad_norm = 0.0
    config.optimizer.learning_rate = 1e30
    with pytest.raises(TrainingError, match=r"the loss is (nan|inf) .* at step \d+") as e:
        train_and_evaluate(config, tmp_path)
    assert "last good checkpoint is" in str(e.value)


def test_unwritable_workdir(fixture_data, tmp_path):
    _, data_dir = fixture_data
    blocker = tmp_path / "file"
    blocker.write_text("x")
    with pytest.raises(TrainingError, match="cannot write to --workdir"):
        train_and_evaluate(debug_config(data_dir), blocker / "run")


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
    main = pipeline.load_texts("ding_de_en", "train", ("en", "de"), data_dir)
    phrases = pipeline.load_texts("ding_de_en", "train_phrases", ("en", "de"), data_dir)
    kept = pipeline.known_word_pairs(phrases, pipeline.word_counts(main), 1)
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
    main = pipeline.load_texts("ding_de_en", "train", ("en", "de"), data_dir)
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
    phrases = pipeline.load_texts("ding_de_en", "train_phrases", ("en", "de"), data_dir)
    assert len(both) == len(phrases)


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
    main = pipeline.load_texts("ding_de_en", "train", ("en", "de"), data_dir)
    phrases = pipeline.load_texts("ding_de_en", "train_phrases", ("en", "de"), data_dir)
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
    counts = pipeline.word_counts(main)
    aux = [("house", "Haus"), ("the old house", "das alte Haus"), ("a", "ein"), ("...", "…")]
    assert pipeline.known_word_pairs(aux, counts, 1) == [("house", "Haus"), ("a", "ein")]
    assert pipeline.known_word_pairs(aux, counts, 2) == [("house", "Haus")]


def test_config_errors_come_before_data(tmp_path):
    config = load_config()
    config.data.data_dir = str(tmp_path / "does-not-exist")
    config.train.parallelism = "spmd"
    with pytest.raises(ConfigError, match="parallelism='spmd'; choose one of jit, pmap"):
        train_and_evaluate(config, tmp_path / "run")
    assert not (tmp_path / "run").exists()
    config = load_config()
    config.data.max_length = 1024
    with pytest.raises(ConfigError, match="exceeds model.max_len"):
        validate_experiment(config)
    config = load_config()
    config.train.concurrent_splits = 3  # the debug batch has 8 rows
    with pytest.raises(ConfigError, match="concurrent_splits=3 must be >= 1 and divide"):
        validate_experiment(config)
    config = load_config()
    config.train.best_metric = "bleu"
    config.train.eval_bleu_sentences = 0
    message = "best_metric='bleu' needs a translation task and .*eval_bleu_sentences > 0"
    with pytest.raises(ConfigError, match=message):
        validate_experiment(config)
    for section, field, value, message in (
        ("data", "aux_min_count", -1, "aux_min_count=-1 must be >= 0"),
        ("optimizer", "ema_decay", 1.0, r"ema_decay=1.0 must be in \[0, 1\)"),
        ("optimizer", "cooldown_steps", 10**6, r"cooldown_steps=1000000 must be in \[0, "),
        ("optimizer", "cooldown_steps", -1, r"cooldown_steps=-1 must be in \[0, "),
        ("optimizer", "embedding_lr_scale", -1.0, "embedding_lr_scale=-1.0 must be >= 0"),
        ("train", "embedding_init", "glove", "embedding_init='glove'; choose one of random, ppmi"),
        ("data", "aux_tag", "dict", "aux_tag='dict' needs a translation task and the form <name>"),
        ("data", "aux_tag", "<two words>", "the form <name>"),
        ("data", "reverse_tag", "2en", "reverse_tag='2en' needs a translation task"),
        ("data", "subword_alpha", -0.1, r"subword_alpha=-0.1 must be in \[0, 1\]"),
        ("data", "subword_alpha", 1.5, r"subword_alpha=1.5 must be in \[0, 1\]"),
        ("train", "max_minutes", -1.0, "max_minutes=-1.0 must be >= 0"),
    ):
        config = load_config()
        config[section][field] = value
        with pytest.raises(ConfigError, match=message):
            validate_experiment(config)
    config = load_config()
    config.train.max_minutes = 15.0
    config.optimizer.cooldown_steps = 2
    with pytest.raises(ConfigError, match="max_minutes=15.0 stops at a step nobody knows"):
        validate_experiment(config)
    config.optimizer.cooldown_steps = 0
    validate_experiment(config)
    config.optimizer.cooldown_fraction = 0.3  # the cooldown that works with a budget
    validate_experiment(config)
    config.train.max_minutes, config.optimizer.cooldown_steps = 0.0, 2
    with pytest.raises(ConfigError, match="are two cooldowns; set one of them to 0"):
        validate_experiment(config)
    for fraction in (-0.1, 1.0):
        config = load_config()
        config.optimizer.cooldown_fraction = fraction
        with pytest.raises(ConfigError, match=rf"cooldown_fraction={fraction} must be in \[0, 1\)"):
            validate_experiment(config)
    config = load_config()
    config.data.resample_subsets, config.data.subword_alpha = True, 0.2
    with pytest.raises(ConfigError, match="resample_subsets=True cannot be combined"):
        validate_experiment(config)
    config = load_config("lm_long_sparse")
    config.data.subword_alpha = 0.2
    with pytest.raises(ConfigError, match="does not apply to data.stream=True"):
        validate_experiment(config)
    bad = ml_collections.ConfigDict(load_config().to_dict())
    bad.train.extra = 1
    with pytest.raises(ConfigError, match=r"unknown fields \['extra'\]"):
        validate_experiment(bad)


def test_a_run_saved_before_later_fields_still_loads():
    """Workdirs written before a field existed (config.json without it) load with the
    field's neutral default, not the current config file's value."""
    values = load_config("ende_small", None).to_dict()
    for section, fields in ADDED_FIELDS.items():
        for name in fields:
            del values[section][name]
    config = ml_collections.ConfigDict(with_added_fields(values))
    validate_experiment(config)
    assert config.train.max_minutes == 0.0  # that run was bounded by num_steps only
    assert config.optimizer.ema_decay == 0.0 and config.train.embedding_init == "random"


@pytest.mark.parametrize(
    "name", ["ende_small", "bible_small", "lm_small", "lm_long_sparse", "paper_base", "paper_big"]
)
def test_every_config_file_validates(name):
    for arg in (None, "debug"):
        validate_experiment(load_config(name, arg))
    with pytest.raises(ConfigError, match="unknown config variant 'huge'"):
        load_config(name, "huge")


def test_cli_debug_run(fixture_data, tmp_path):
    raw, data_dir = fixture_data
    env = dict(os.environ, FLAXFORMER_RAW_DIR=str(raw))
    cmd = [
        sys.executable,
        "-m",
        "flaxformer_lite.main",
        "--config=configs/ende_small.py:debug",
        f"--workdir={tmp_path / 'run'}",
        f"--config.data.data_dir={data_dir}",
        "--config.model.vocab_size=100",
    ]
    out = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, check=False)
    assert out.returncode == 0, out.stderr[-2000:]
    assert "validation @ 6: loss" in out.stdout and "perplexity" in out.stdout
    run = tmp_path / "run"
    assert (run / "metrics.jsonl").exists() and (run / "tokenizer.model").exists()
    assert any((run / "tensorboard").iterdir())
    bad = subprocess.run(
        cmd + ["--config.model.d_modle=3"],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        check=False,
    )
    assert (
        bad.returncode == 1
        and "unknown config field 'd_modle' (did you mean 'd_model'?)" in bad.stderr
    )
    assert "Traceback" not in bad.stderr


def test_language_model_training(fixture_data, tmp_path):
    """The decoder-only LM trains through the same loop on one text feature."""
    _, data_dir = fixture_data
    config = load_config("lm_small", "debug")
    config.model.vocab_size = 80  # English alone supports ~93 pieces
    config.data.dataset = "ding_de_en"  # the fixture Bible is too small for a tokenizer
    config.data.data_dir = str(data_dir)
    metrics = train_and_evaluate(config, tmp_path)
    assert np.isfinite(metrics["loss"]) and metrics["tokens"] > 0
    params, step = ckpt_lib.restore_params(tmp_path, abstract_train_state(config).params, "last")
    assert step == 6 and "encoder" not in params
    assert not any(
        "cross_attention" in jax.tree_util.keystr(p)
        for p, _ in jax.tree_util.tree_flatten_with_path(params)[0]
    )


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


def test_sparse_long_lm_debug_run(fixture_data, tmp_path):
    """configs/lm_long_sparse.py:debug trains through the blocked sparse kernel."""
    _, data_dir = fixture_data
    config = load_config("lm_long_sparse", "debug")
    config.model.vocab_size = 80
    config.model.max_len = config.data.max_length = 128
    config.train.batch_size = 8  # one row per simulated device
    config.data.dataset = "ding_de_en"  # the fixture Bible is too small for a tokenizer
    config.data.data_dir = str(data_dir)
    metrics = train_and_evaluate(config, tmp_path)
    assert np.isfinite(metrics["loss"]) and metrics["tokens"] > 0
