"""float64 mode, the way this project checks numerics: cached decoding (the full cache
and the sliding-window ring buffer) equals the full forward pass with x64 on, greedy
and beam search run there with float64 scores, and model.dtype=float64 without x64 is
refused instead of silently computing in float32."""

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from flaxformer_lite import ModelConfig, Transformer
from flaxformer_lite.config.model import ConfigError
from flaxformer_lite.inference import decoding
from flaxformer_lite.model.partitioning import unbox
from flaxformer_lite.model.transformer import shift_right

# Two decoder layers: the second layer's cache holds keys computed from the first's
# cached output. Small otherwise: the point is the dtypes and the cache indexing.
CFG = ModelConfig(
    vocab_size=24,
    d_model=16,
    num_heads=2,
    d_ff=32,
    num_encoder_layers=1,
    num_decoder_layers=2,
    max_len=16,
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
# the default run takes the full cache; the slow tier the sliding window too
CACHE_PARAMS = ["full", pytest.param("sliding window", marks=pytest.mark.slow)]
SRC = jnp.array([[5, 6, 7, 8, 1, 0], [9, 10, 1, 0, 0, 0], [11, 12, 13, 14, 15, 1]])
TGT = jnp.array([[20, 21, 22, 23, 4, 1, 0], [3, 4, 5, 6, 7, 8, 1], [9, 9, 9, 1, 0, 0, 0]])
# Every value below is float64 end to end (the parameters too): the cached and the
# full pass add the same terms in another order, so they agree to a few float64 ulps
# amplified by three layers; float32 would be off by ~1e-7 relative.
TOL = dict(rtol=1e-10, atol=1e-10)
WIDTH = 12  # every hypothesis (max_length 10) fits: one compiled scoring pass


@pytest.fixture(autouse=True)
def x64():
    with jax.enable_x64(True):
        yield


@functools.cache
def _model(cache: str):
    """(model, float64 parameters sharpened like a trained model's)."""
    model = Transformer(dataclasses.replace(CFG, **CACHES[cache]))
    with jax.enable_x64(True):
        params = unbox(jax.jit(model.init)(jax.random.key(3), SRC, TGT))["params"]
        return model, jax.tree.map(lambda x: x * 1.5, params)


@functools.partial(jax.jit, static_argnums=0)
def _full_logits(model, params, src, tgt):
    return model.apply({"params": params}, src, tgt)


@pytest.mark.parametrize("cache", CACHE_PARAMS)
def test_cached_decoding_equals_the_full_forward_in_float64(cache):
    model, params = _model(cache)
    assert all(p.dtype == jnp.float64 for p in jax.tree.leaves(params))
    full = _full_logits(model, params, SRC, TGT)
    assert full.dtype == jnp.float64
    encoded = jax.jit(functools.partial(model.apply, method=Transformer.encode))(
        {"params": params}, SRC
    )
    cache_vars = unbox(jax.jit(functools.partial(model.init, decode=True))(
        jax.random.key(0), SRC, TGT
    ))["cache"]  # fmt: skip

    @jax.jit
    def step(cache_vars, encoded, tokens):
        return model.apply(
            {"params": params, "cache": cache_vars}, encoded, SRC, tokens,
            decode=True, mutable=["cache"], method=Transformer.decode,
        )  # fmt: skip

    dec_in = shift_right(TGT, model.config.bos_id)
    steps = []
    for i in range(TGT.shape[1]):  # the first step stores the encoder's keys and values
        logits, mutated = step(cache_vars, encoded if i == 0 else None, dec_in[:, i : i + 1])
        cache_vars = mutated["cache"]
        steps.append(logits)
    cached = jnp.concatenate(steps, axis=1)
    real = np.asarray(TGT != 0)  # a padding target is masked in the full pass only
    np.testing.assert_allclose(np.asarray(cached)[real], np.asarray(full)[real], **TOL)


def _padded(seq):
    """(``seq`` to its EOS, zero-padded to WIDTH; its length). The decoder is causal,
    so the padding after position n changes nothing before it."""
    n = next((i + 1 for i, t in enumerate(seq) if t == 1), None)
    if n is None:  # a live beam that fills a stopped row's list: up to its padding
        n = next((i for i, t in enumerate(seq) if t == 0), len(seq))
    return list(seq[:n]) + [0] * (WIDTH - n), n


@pytest.mark.parametrize("cache", CACHE_PARAMS)
def test_greedy_and_beam_search_run_in_float64(cache):
    """Greedy picks the full pass's argmax at every step; each beam's score is its
    float64 log-probability under the full pass with the length penalty (float32
    scores would differ in the 8th digit)."""
    model, params = _model(cache)
    kw = dict(max_length=10, eos_id=1, bos_id=2)
    greedy = np.asarray(decoding.sample(model, params, SRC, **kw))
    beams, scores = decoding.beam_search(model, params, SRC, beam_size=3, alpha=0.6, **kw)
    assert scores.dtype == jnp.float64
    rows = [(b, np.asarray(beams[b, k]).tolist()) for b in range(3) for k in range(3)]
    rows += [(b, greedy[b].tolist()) for b in range(3)]
    padded = [_padded(seq) for _, seq in rows]
    logits = _full_logits(  # every hypothesis in one batch
        model, params, SRC[np.array([b for b, _ in rows])], jnp.asarray([p for p, _ in padded])
    )
    logp = np.asarray(jax.nn.log_softmax(logits))
    for i, ((b, _), (labels, n)) in enumerate(zip(rows, padded, strict=True)):
        if i < 9:  # a beam: its score
            total = logp[i, np.arange(n), labels[:n]].sum()
            want = total / ((5 + n) / 6) ** 0.6
            assert float(scores[b, i % 3]) == pytest.approx(want, rel=1e-9, abs=1e-9)
        else:  # greedy: the argmax of the full pass at each step
            assert logp[i, :n].argmax(-1).tolist() == labels[:n]


def test_float64_without_x64_is_refused():
    """Without x64, JAX computes float64 in float32 without a word: the model refuses
    (where it takes its dtypes), and so does training, before any data is read."""
    from flaxformer_lite.training.train import train_and_evaluate
    from tests.fixtures import load_config

    with jax.enable_x64(False):
        model = Transformer(CFG)
        with pytest.raises(ConfigError, match=r"model.dtype=float64 needs JAX's 64-bit mode"):
            jax.eval_shape(model.init, jax.random.key(0), SRC, SRC)
        config = load_config()
        config.model.dtype = "float64"
        config.data.data_dir = "/nonexistent"  # never read: the check comes first
        with pytest.raises(ConfigError, match="JAX_ENABLE_X64=1"):
            train_and_evaluate(config, "/nonexistent/run")
    jax.eval_shape(model.init, jax.random.key(0), SRC, SRC)  # with x64 on, it builds
