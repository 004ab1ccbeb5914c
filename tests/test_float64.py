"""float64 mode, the way this project checks numerics: cached decoding (the full cache
and the sliding-window ring buffer) equals the full forward pass with x64 on, greedy
and beam search run there, and model.dtype=float64 without x64 is refused instead of
silently computing in float32."""

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from flaxformer_lite import LanguageModel, ModelConfig, Transformer, decoding
from flaxformer_lite.architectures.transformer import shift_right
from flaxformer_lite.config import ConfigError
from flaxformer_lite.partitioning import unbox

CFG = ModelConfig(
    vocab_size=40,
    d_model=32,
    num_heads=4,
    d_ff=64,
    num_encoder_layers=2,
    num_decoder_layers=2,
    max_len=32,
    embedding_dropout=0.0,
    residual_dropout=0.0,
    dtype="float64",
    param_dtype="float64",
)
# The full cache, and the ring buffer of a causal local pattern (window 3: positions
# beyond it leave the buffer while the sequence goes on).
CACHES = {
    "full": {},
    "sliding window": {"attention_pattern": "local:window=3", "attention_block_size": 4},
}
SRC = jnp.array([[5, 6, 7, 8, 1, 0], [9, 10, 1, 0, 0, 0], [11, 12, 13, 14, 15, 1]])
TGT = jnp.array([[20, 21, 22, 23, 24, 1, 0], [25, 26, 27, 28, 29, 30, 1]])
# Every value below is float64 end to end (the parameters too): the cached and the
# full pass add the same terms in another order, so they agree to a few float64 ulps
# amplified by two layers (float32 would give ~1e-6; measured here: ~1e-15).
TOL = dict(rtol=1e-10, atol=1e-10)


@pytest.fixture(autouse=True)
def x64():
    with jax.enable_x64(True):
        yield


def _params(model, *inputs):
    params = unbox(model.init(jax.random.key(3), *inputs))["params"]
    assert all(p.dtype == jnp.float64 for p in jax.tree.leaves(params))
    return jax.tree.map(lambda x: x * 1.5, params)  # sharper, like a trained model


def _step_by_step(model, params, cache, steps, **kw):
    """Logits of feeding ``steps`` (each ``(*args)`` of one decoding step) through the
    cache, one jitted step (eager dispatch of every op costs more than the model)."""

    @jax.jit
    def step(cache, *args):
        return model.apply({"params": params, "cache": cache}, *args, mutable=["cache"], **kw)

    outs = []
    for args in steps:
        out, mutated = step(cache, *args)
        cache = mutated["cache"]
        outs.append(out)
    return jnp.concatenate(outs, axis=1)


@pytest.mark.parametrize("cache", CACHES)
def test_cached_decoding_equals_the_full_forward_in_float64(cache):
    config = dataclasses.replace(CFG, **CACHES[cache])
    model = Transformer(config)
    src, tgt = SRC[:2], TGT
    params = _params(model, src, tgt)
    full = model.apply({"params": params}, src, tgt)
    assert full.dtype == jnp.float64
    encoded = model.apply({"params": params}, src, method=Transformer.encode)
    dec_in = shift_right(tgt, config.bos_id)
    empty = unbox(model.init(jax.random.key(0), src, tgt, decode=True))["cache"]
    # The first step stores the encoder's keys and values; the others read them.
    steps = [(encoded if i == 0 else None, src, dec_in[:, i : i + 1]) for i in range(tgt.shape[1])]
    cached = _step_by_step(model, params, empty, steps, decode=True, method=Transformer.decode)
    real = np.asarray(tgt != 0)
    np.testing.assert_allclose(np.asarray(cached)[real], np.asarray(full)[real], **TOL)

    lm = LanguageModel(config)
    tokens = jnp.array([[5, 6, 7, 8, 9, 10, 11, 12], [13, 14, 15, 16, 17, 18, 19, 20]])
    lm_params = _params(lm, tokens)
    whole = lm.apply({"params": lm_params}, tokens)
    lm_cache = unbox(lm.init(jax.random.key(0), tokens, decode=True))["cache"]
    inputs = shift_right(tokens, config.bos_id)
    # One token a step: the ring buffer's protocol.
    steps = [(inputs[:, i : i + 1],) for i in range(tokens.shape[1])]
    outs = _step_by_step(lm, lm_params, lm_cache, steps, decode=True)
    np.testing.assert_allclose(outs, whole, **TOL)


WIDTH = 12  # every hypothesis (max_length 10) fits: one compiled scoring pass


@functools.partial(jax.jit, static_argnums=0)
def _label_log_probs(model, params, src, labels):
    """log p(labels[t] | src, labels[:t]) at each position, by the full forward pass
    (the decoder is causal: the zero padding after a hypothesis changes nothing before
    it)."""
    logp = jax.nn.log_softmax(model.apply({"params": params}, src[None], labels[None]))
    return jnp.take_along_axis(logp[0], labels[:, None], -1)[:, 0]


@pytest.mark.parametrize("cache", CACHES)
def test_greedy_and_beam_search_run_in_float64(cache):
    """Cached greedy == the uncached search; each beam's score is its float64
    log-probability under the full pass with the length penalty (float32 scores would
    differ in the 8th digit)."""
    model = Transformer(dataclasses.replace(CFG, **CACHES[cache]))
    params = _params(model, SRC, SRC)
    kw = dict(max_length=10, eos_id=1, bos_id=2)
    greedy = decoding.sample(model, params, SRC, **kw)
    np.testing.assert_array_equal(greedy, decoding.greedy_uncached(model, params, SRC, **kw))
    beams, scores = decoding.beam_search(model, params, SRC, beam_size=3, alpha=0.6, **kw)
    assert scores.dtype == jnp.float64
    for b in range(SRC.shape[0]):
        for k in range(3):
            seq = np.asarray(beams[b, k]).tolist()
            n = next((i + 1 for i, t in enumerate(seq) if t == 1), len(seq))
            labels = jnp.asarray(seq[:n] + [0] * (WIDTH - n))
            logp = float(_label_log_probs(model, params, SRC[b], labels)[:n].sum())
            want = logp / ((5 + n) / 6) ** 0.6
            assert float(scores[b, k]) == pytest.approx(want, rel=1e-9, abs=1e-9)


def test_float64_without_x64_is_refused():
    """Without x64, JAX computes float64 in float32 without a word: the model refuses
    (where it takes its dtypes), and so does training, before any data is read."""
    from flaxformer_lite.training.train import train_and_evaluate
    from tests.fixtures import load_config

    with jax.enable_x64(False):
        model = Transformer(CFG)
        with pytest.raises(ConfigError, match=r"model.dtype=float64 needs JAX's 64-bit mode"):
            model.init(jax.random.key(0), SRC, SRC)
        config = load_config()
        config.model.dtype = "float64"
        config.data.data_dir = "/nonexistent"  # never read: the check comes first
        with pytest.raises(ConfigError, match="JAX_ENABLE_X64=1"):
            train_and_evaluate(config, "/nonexistent/run")
    model.init(jax.random.key(0), SRC, SRC)  # with x64 on (the fixture), it builds
