"""Attention diagnostics (inference/diagnostics.py) against hand-computed cases, and the
largest logit the model sows against one computed from its own projections."""

import math

import jax
import jax.numpy as jnp
import numpy as np

from flaxformer_lite.config.model import ModelConfig
from flaxformer_lite.model.multihead import MultiHeadAttention
from flaxformer_lite.model.partitioning import unbox
from flaxformer_lite.views import diagnostics


def _weights():
    """Two heads over 3 keys (and a padding query, all zeros): head 0 looks at itself,
    head 1 spreads evenly."""
    w = np.zeros((1, 2, 4, 3))
    w[0, 0, :3] = np.eye(3)
    w[0, 1, :3] = 1 / 3
    return w


def test_statistics_of_two_hand_made_heads():
    logits = np.array([[[1.0, 5.0, 2.0, 99.0], [0.5, 0.5, 0.5, 99.0]]])  # 99: the padding row
    s = diagnostics.head_stats(_weights(), logits, patterns=["local:window=1", "topk:k=2", "full"])
    np.testing.assert_allclose(s["entropy"], [0.0, math.log(3)])
    # head 1: query 0 sees distances 0, 1, 2 (mean 1), query 1: 1, 0, 1, query 2: 1
    np.testing.assert_allclose(s["distance"], [0.0, (1 + 2 / 3 + 1) / 3])
    np.testing.assert_allclose(s["max_logit"], [5.0, 0.5])  # the padding query ignored
    # a window of 1 holds 2 of 3 keys at the ends, all 3 in the middle
    np.testing.assert_allclose(s["mass_in:local:window=1"], [1.0, (2 / 3 + 1 + 2 / 3) / 3])
    np.testing.assert_allclose(s["mass_in:topk:k=2"], [1.0, 2 / 3])
    np.testing.assert_allclose(s["mass_in:full"], [1.0, 1.0])


def test_a_causal_decoder_is_measured_against_causal_patterns():
    w = np.zeros((1, 1, 3, 3))
    w[0, 0] = np.tril(np.ones((3, 3))) / np.arange(1, 4)[:, None]  # uniform over the past
    s = diagnostics.head_stats(w, patterns=["local:window=1"], causal=True)
    # query 2 keeps keys 1 and 2 of its three; queries 0 and 1 keep everything
    np.testing.assert_allclose(s["mass_in:local:window=1"], [(1 + 1 + 2 / 3) / 3])


def test_cross_attention_has_no_distance_or_pattern():
    s = diagnostics.head_stats(_weights(), patterns=["local:window=1"], self_attention=False)
    assert set(s) == {"entropy"}


def test_the_sown_largest_logit_is_the_largest_score():
    """MultiHeadAttention sows each query's largest allowed score; recomputed here from
    its query and key projections."""
    config = ModelConfig(
        vocab_size=10, d_model=8, num_heads=2, d_ff=16, num_encoder_layers=1,
        num_decoder_layers=1, max_len=8, sow_attention_weights=True,
    )  # fmt: skip
    x = jax.random.normal(jax.random.key(0), (1, 5, 8))
    mask = jnp.tril(jnp.ones((5, 5), bool))[None, None]
    mha = MultiHeadAttention(config)
    params = unbox(mha.init(jax.random.key(1), x))["params"]
    _, state = mha.apply({"params": params}, x, mask=mask, mutable=["intermediates"])
    (sown,) = state["intermediates"]["attention_max_logit"]
    p = params
    q = jnp.einsum("bsm,mhd->bshd", x, p["query"]["kernel"]) + p["query"]["bias"]
    k = jnp.einsum("bsm,mhd->bshd", x, p["key"]["kernel"]) + p["key"]["bias"]
    scores = jnp.einsum("bqhd,bkhd->bhqk", q, k) / math.sqrt(4)
    want = jnp.max(jnp.where(mask, scores, -jnp.inf), axis=-1)
    np.testing.assert_allclose(sown, want, rtol=1e-5, atol=1e-6)


def test_module_table_and_flat_names():
    sown = {
        "encoder": {
            "layer_1": {"self_attention": {"attention_weights": (_weights(),)}},
            "layer_0": {"self_attention": {"attention_weights": (_weights(),)}},
        },
        "decoder": {"layer_0": {"cross_attention": {"attention_weights": (_weights(),)}}},
    }
    stats = diagnostics.module_stats(sown, patterns=["local:window=1"])
    assert list(stats) == [
        "encoder/layer_0/self_attention",
        "encoder/layer_1/self_attention",
        "decoder/layer_0/cross_attention",
    ]
    flat = diagnostics.flat(stats)
    assert math.isclose(flat["encoder/layer_1/self_attention/head_1/entropy"], math.log(3))
    assert "decoder/layer_0/cross_attention/head_0/distance" not in flat
    text = diagnostics.table(stats)
    assert text.count("\n") == 2 + 6 - 1 and "mass_in:local:window=1" in text
