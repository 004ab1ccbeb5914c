"""MultiHeadAttention: projections against a float64 reference, caches, sow."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from flaxformer_lite.config.model import ModelConfig
from flaxformer_lite.model.masks import make_causal_mask
from flaxformer_lite.model.multihead import MultiHeadAttention
from flaxformer_lite.model.partitioning import unbox

CFG = ModelConfig(vocab_size=10, d_model=12, num_heads=3, d_k=5, d_v=7, d_ff=8, max_len=16)


def _np_mha(p, xq, xkv, mask):
    f = lambda a: np.asarray(a, np.float64)
    q = np.einsum("bqm,mhd->bqhd", xq, f(p["query"]["kernel"])) + f(p["query"]["bias"])
    k = np.einsum("bkm,mhd->bkhd", xkv, f(p["key"]["kernel"])) + f(p["key"]["bias"])
    v = np.einsum("bkm,mhd->bkhd", xkv, f(p["value"]["kernel"])) + f(p["value"]["bias"])
    s = np.einsum("bqhd,bkhd->bhqk", q, k) / np.sqrt(q.shape[-1])
    s = np.where(mask, s, -np.inf)
    w = np.exp(s - s.max(-1, keepdims=True))
    w = w / w.sum(-1, keepdims=True)
    o = np.einsum("bhqk,bkhv->bqhv", w, v)
    return np.einsum("bqhv,hvm->bqm", o, f(p["out"]["kernel"])) + f(p["out"]["bias"])


def test_projection_shapes_with_separate_dk_dv():
    x = jnp.ones((2, 4, 12))
    params = unbox(MultiHeadAttention(CFG).init(jax.random.key(0), x))["params"]
    shapes = jax.tree.map(lambda a: a.shape, params)
    assert shapes["query"]["kernel"] == (12, 3, 5) and shapes["key"]["kernel"] == (12, 3, 5)
    assert shapes["value"]["kernel"] == (12, 3, 7) and shapes["out"]["kernel"] == (3, 7, 12)
    no_bias = unbox(MultiHeadAttention(CFG.replace(use_bias=False)).init(jax.random.key(0), x))
    assert "bias" not in no_bias["params"]["query"]


def test_matches_float64_reference():
    r = np.random.default_rng(0)
    xq, xkv = r.normal(size=(2, 4, 12)), r.normal(size=(2, 6, 12))
    mask = r.random((2, 1, 4, 6)) > 0.2
    mask[..., 0] = True
    mha = MultiHeadAttention(CFG, self_attention=False)
    params = unbox(
        mha.init(jax.random.key(0), jnp.asarray(xq, jnp.float32), jnp.asarray(xkv, jnp.float32))
    )["params"]
    got = mha.apply(
        {"params": params}, jnp.asarray(xq, jnp.float32), jnp.asarray(xkv, jnp.float32), mask
    )
    np.testing.assert_allclose(got, _np_mha(params, xq, xkv, mask), rtol=1e-4, atol=1e-5)


def test_self_attention_cache_matches_full_causal():
    r = np.random.default_rng(1)
    x = jnp.asarray(r.normal(size=(2, 6, 12)), jnp.float32)
    mha = MultiHeadAttention(CFG)
    variables = unbox(mha.init(jax.random.key(0), x, decode=True))
    params, cache = variables["params"], variables["cache"]
    assert cache["cached_key"].shape == (2, 3, 6, 5)  # [b, h, t, d]
    assert int(cache["cache_index"]) == 0
    full = mha.apply({"params": params}, x, mask=make_causal_mask(6))
    outs = []
    # A 2-token chunk first (prefill), then one token at a time.
    for lo, hi in [(0, 2), (2, 3), (3, 4), (4, 5), (5, 6)]:
        out, mutated = mha.apply(
            {"params": params, "cache": cache}, x[:, lo:hi], decode=True, mutable=["cache"]
        )
        cache = mutated["cache"]
        outs.append(out)
    np.testing.assert_allclose(jnp.concatenate(outs, 1), full, rtol=1e-5, atol=1e-5)
    assert int(cache["cache_index"]) == 6


def test_cross_attention_cache_projects_encoder_once():
    r = np.random.default_rng(2)
    xq = jnp.asarray(r.normal(size=(2, 1, 12)), jnp.float32)
    enc = jnp.asarray(r.normal(size=(2, 5, 12)), jnp.float32)
    mha = MultiHeadAttention(CFG, self_attention=False)
    variables = unbox(mha.init(jax.random.key(0), xq, enc, decode=True))
    params = variables["params"]
    expected = mha.apply({"params": params}, xq, enc)
    first, mutated = mha.apply(
        {"params": params, "cache": variables["cache"]}, xq, enc, decode=True, mutable=["cache"]
    )
    again = mha.apply({"params": params, "cache": mutated["cache"]}, xq, None, decode=True)
    np.testing.assert_allclose(first, expected, rtol=1e-6)
    np.testing.assert_allclose(again, expected, rtol=1e-6)
    with pytest.raises(ValueError, match="cache is empty"):
        mha.apply({"params": params, "cache": {}}, xq, None, decode=True)


def test_sow_attention_weights():
    x = jnp.ones((2, 4, 12))
    mha = MultiHeadAttention(CFG.replace(sow_attention_weights=True))
    params = unbox(mha.init(jax.random.key(0), x))["params"]
    _, state = mha.apply({"params": params}, x, mutable=["intermediates"])
    (w,) = state["intermediates"]["attention_weights"]
    assert w.shape == (2, 3, 4, 4)
    np.testing.assert_allclose(w.sum(-1), 1.0, rtol=1e-6)
    _, off = MultiHeadAttention(CFG).apply({"params": params}, x, mutable=["intermediates"])
    assert "intermediates" not in off or not off["intermediates"]


def test_attention_dropout_needs_rng_and_changes_output():
    x = jnp.asarray(np.random.default_rng(3).normal(size=(2, 4, 12)), jnp.float32)
    mha = MultiHeadAttention(CFG.replace(attention_dropout=0.5))
    params = unbox(mha.init(jax.random.key(0), x))["params"]
    det = mha.apply({"params": params}, x)
    a = mha.apply({"params": params}, x, deterministic=False, rngs={"dropout": jax.random.key(1)})
    b = mha.apply({"params": params}, x, deterministic=False, rngs={"dropout": jax.random.key(2)})
    assert not np.allclose(a, det) and not np.allclose(a, b)


@pytest.mark.parametrize("score_fn", ["additive", "bilinear"])
def test_parameterised_scores_live_in_the_module(score_fn):
    x = jnp.ones((1, 3, 12))
    params = unbox(MultiHeadAttention(CFG.replace(score_fn=score_fn)).init(jax.random.key(0), x))
    assert "score" in params["params"]
