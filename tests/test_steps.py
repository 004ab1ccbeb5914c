"""The pure train/eval steps: the loss against float64, pmap == jit, concurrent splits."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from flaxformer_lite.config.model import ModelConfig
from flaxformer_lite.data import packing
from flaxformer_lite.model.transformer import Transformer
from flaxformer_lite.training import losses
from flaxformer_lite.training.parallel import Parallel
from flaxformer_lite.training.state import (
    create_train_state,
    make_optimizer,
)
from flaxformer_lite.training.steps import train_step
from tests.fixtures import load_config


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
    it = packing.train_iterator(exs, batch_size=batch_size, max_length=16, seed=0, prefetch=0)
    batches = [next(it) for _ in range(3)]
    step = functools.partial(train_step, model=model, tx=tx, schedule=schedule, label_smoothing=0.1)
    return state, batches, step


def _run(kind, state, batches, step_fn, factors=None):
    par = Parallel(kind)
    fn = par.train_step(step_fn.func, **step_fn.keywords)
    s = par.put_state(state)
    out = []
    for b, f in zip(batches, factors or [None] * len(batches), strict=True):
        s, m = fn(s, par.put_batch(b), f)
        out.append(par.metrics_to_host(m))
    return out, par.params_of(s)


@pytest.mark.parametrize(
    "factors",
    [None, pytest.param([1.0, 0.6, 0.3], marks=pytest.mark.slow)],
    ids=["schedule", "lr_factor"],
)
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


@pytest.mark.slow
def test_concurrent_splits_give_the_same_step(kind="jit"):
    """Splitting the batch into independent chains changes nothing but the dropout draws
    (jit over 8 devices: the row groups are cut from a sharded batch; pmap runs the same
    step function per device)."""
    state, batches, step = _tiny_setup(batch_size=16)  # 2 rows per device
    whole_metrics, whole_params = _run(kind, state, batches[:2], step)
    state, _, _ = _tiny_setup(batch_size=16)
    split = functools.partial(step.func, **step.keywords, concurrent_splits=2)
    split_metrics, split_params = _run(kind, state, batches[:2], split)
    # The same float32 terms summed per chain then across chains: round-off of order
    # epsilon (1.2e-7) times the reduction depth; parameters as in the pmap test above.
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
        Parallel("jit").check_batch_size(12)


@pytest.mark.parametrize("smoothing", [0.0, 0.1])
def test_loss_gradient_matches_float64_reference(smoothing):
    """The hand-written gradient (softmax - q in one pass) against autodiff of the
    float64 definition, with different weights on the smoothed loss and the nll."""
    rng = np.random.default_rng(2)
    logits = rng.normal(size=(2, 5, 11)) * 3
    labels = rng.integers(0, 11, (2, 5))
    w_s, w_n = rng.uniform(size=(2, 5)), rng.uniform(size=(2, 5))

    def ours(z):
        s, nll = losses.token_losses(z, jnp.asarray(labels), smoothing)
        return jnp.sum(s * w_s + nll * w_n)

    def reference(z):
        logp = jax.nn.log_softmax(z)
        q = jax.nn.one_hot(labels, 11, dtype=z.dtype) * (1 - smoothing - smoothing / 10)
        q = q + smoothing / 10
        s = -(q * logp).sum(-1)
        nll = -jnp.take_along_axis(logp, jnp.asarray(labels)[..., None], -1)[..., 0]
        return jnp.sum(s * w_s + nll * w_n)

    got = jax.grad(ours)(jnp.asarray(logits, jnp.float32))
    with jax.enable_x64():
        want = jax.grad(reference)(jnp.asarray(logits, jnp.float64))
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)
