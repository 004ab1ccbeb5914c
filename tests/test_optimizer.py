"""The optimizer's parts: the learning-rate factor, the parameter EMA, the embedding rate."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from flaxformer_lite.config.experiment import OptimizerConfig, validate_experiment
from flaxformer_lite.config.model import ConfigError, ModelConfig
from flaxformer_lite.model.transformer import Transformer
from flaxformer_lite.training.state import (
    TrainState,
    create_train_state,
    evaluation_params,
    make_optimizer,
    params_ema,
)
from tests.fixtures import load_config


def test_lr_factor_scales_the_learning_rate_exactly():
    """Adam, then the factor, then the parameter average: factor f is Adam at f
    times the rate, and the average sees the scaled steps."""
    params = {"w": jnp.array([1.0, -2.0, 3.0]), "b": jnp.array(0.5)}
    grads = [
        {"w": jnp.array([0.3, -0.1, 0.2]) * (k + 1), "b": jnp.array(0.1 - 0.05 * k)}
        for k in range(3)
    ]
    opt = OptimizerConfig(
        schedule="constant",
        learning_rate=1e-2,
        warmup_steps=0,
        cooldown_fraction=0.5,
        ema_decay=0.9,
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


@pytest.mark.slow
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


def test_the_spike_guard_skips_outlying_updates_and_counts_them():
    """Off by default; on, an update whose gradient norm is over factor x the median of
    the accepted ones leaves the parameters and Adam's state as they were."""
    from flaxformer_lite.training.state import SPIKE_GUARD_MIN, skip_spikes, skipped_updates

    assert OptimizerConfig().spike_factor == 0
    with pytest.raises(ConfigError, match="spike_factor=0.5 would skip ordinary updates"):
        OptimizerConfig(spike_factor=0.5)
    tx = skip_spikes(optax.adam(0.1), factor=3.0, window=8)
    params = {"w": jnp.ones(4)}
    state = tx.init(params)
    rng = np.random.default_rng(0)
    norms = [1.0 + 0.2 * rng.random() for _ in range(SPIKE_GUARD_MIN)] + [50.0, 2.0, 1.0]
    for i, norm in enumerate(norms):
        grads = {"w": jnp.full(4, norm / 2.0)}  # global norm = norm
        updates, new_state = tx.update(grads, state, params)
        new_params = optax.apply_updates(params, updates)
        if norm == 50.0:  # the spike: nothing moves, Adam's step count included
            assert int(skipped_updates(new_state)) == 1
            np.testing.assert_array_equal(new_params["w"], params["w"])
            same = jax.tree.map(np.array_equal, new_state.inner, state.inner)
            assert all(jax.tree.leaves(same))
        else:
            assert not np.array_equal(new_params["w"], params["w"]), i
        params, state = new_params, new_state
    assert int(state.skipped) == 1 and int(state.accepted) == len(norms) - 1
    # make_optimizer puts the guard around the whole optimizer only when asked.
    config = OptimizerConfig(spike_factor=5.0)
    tx, _ = make_optimizer(config, ModelConfig(), 100)
    assert skipped_updates(tx.init({"w": jnp.ones(2)})) is not None
    plain, _ = make_optimizer(OptimizerConfig(), ModelConfig(), 100)
    assert skipped_updates(plain.init({"w": jnp.ones(2)})) is None
