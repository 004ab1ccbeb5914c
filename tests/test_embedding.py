"""Embeddings and positional encodings against the paper's formula."""

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from flaxformer_lite.model.embedding import (
    Embed,
    LearnedPositions,
    sinusoidal_encoding,
    sinusoidal_positions,
)
from flaxformer_lite.model.partitioning import unbox


def test_sinusoid_literal_values():
    pe = sinusoidal_positions(4, 6)
    # i = 0 has frequency 1: PE(pos, 0) = sin(pos), PE(pos, 1) = cos(pos).
    assert pe[1, 0] == pytest.approx(0.8414709848078965, abs=1e-15)
    assert pe[1, 1] == pytest.approx(0.5403023058681398, abs=1e-15)
    assert pe[0, 0::2].tolist() == [0.0, 0.0, 0.0] and pe[0, 1::2].tolist() == [1.0, 1.0, 1.0]
    # i = 2 (dims 4, 5): frequency 10000^(-4/6).
    assert pe[3, 4] == pytest.approx(math.sin(3 / 10000 ** (4 / 6)), abs=1e-15)
    assert pe[3, 5] == pytest.approx(math.cos(3 / 10000 ** (4 / 6)), abs=1e-15)


def test_sinusoid_matches_formula_everywhere():
    d, length = 16, 64
    pe = sinusoidal_positions(length, d)
    for pos in range(length):
        for i in range(d // 2):
            angle = pos / 10000 ** (2 * i / d)
            assert pe[pos, 2 * i] == pytest.approx(math.sin(angle), abs=1e-13)
            assert pe[pos, 2 * i + 1] == pytest.approx(math.cos(angle), abs=1e-13)


@pytest.mark.parametrize("k", [1, 3, 17])
def test_relative_positions_are_a_fixed_rotation(k):
    """PE(pos + k) = M_k PE(pos), with M_k independent of pos (Section 3.5)."""
    d, length = 32, 200
    pe = sinusoidal_positions(length + k, d)
    inv = 10000.0 ** (-np.arange(0, d, 2) / d)
    m = np.zeros((d, d))
    for i, w in enumerate(inv):
        c, s = math.cos(k * w), math.sin(k * w)
        # (sin, cos) pair: sin(a+b) = sin a cos b + cos a sin b,
        #                  cos(a+b) = cos a cos b - sin a sin b
        m[2 * i : 2 * i + 2, 2 * i : 2 * i + 2] = [[c, s], [-s, c]]
    np.testing.assert_allclose(pe[k:], pe[:length] @ m.T, atol=1e-10)


def test_encoding_of_explicit_positions():
    pe = sinusoidal_positions(10, 8)
    positions = np.array([[0, 1, 2, 0, 1, 9]])  # a packed row restarts at 0
    got = sinusoidal_encoding(jnp.asarray(positions), 8)
    assert got.shape == (1, 6, 8) and got.dtype == jnp.float32
    np.testing.assert_allclose(got[0], pe[positions[0]], atol=1e-6)
    with jax.enable_x64(True):
        got64 = sinusoidal_encoding(jnp.asarray(positions), 8, dtype=jnp.float64)
        np.testing.assert_allclose(got64[0], pe[positions[0]], atol=1e-14)


def test_odd_width_rejected():
    with pytest.raises(ValueError, match="must be even"):
        sinusoidal_positions(4, 7)


def test_embed_scale_and_attend():
    emb = Embed(vocab_size=11, features=4, scale=True)
    tokens = jnp.array([[1, 5, 10]])
    params = unbox(emb.init(jax.random.key(0), tokens))["params"]
    table = np.asarray(params["embedding"])
    np.testing.assert_allclose(
        emb.apply({"params": params}, tokens)[0], table[[1, 5, 10]] * 2.0, rtol=1e-6
    )
    unscaled = Embed(11, 4, scale=False).apply({"params": params}, tokens)
    np.testing.assert_allclose(unscaled[0], table[[1, 5, 10]], rtol=1e-6)
    x = np.random.default_rng(0).normal(size=(1, 2, 4)).astype(np.float32)
    logits = emb.apply({"params": params}, jnp.asarray(x), method=Embed.attend)
    np.testing.assert_allclose(logits, x @ table.T, rtol=1e-5)
    with pytest.raises(ValueError, match="integers"):
        emb.apply({"params": params}, jnp.ones((1, 2)))


def test_learned_positions_lookup():
    mod = LearnedPositions(max_len=8, d_model=4)
    pos = jnp.array([[0, 1, 0, 7]])
    params = unbox(mod.init(jax.random.key(0), pos))["params"]
    np.testing.assert_array_equal(
        mod.apply({"params": params}, pos)[0], np.asarray(params["embedding"])[[0, 1, 0, 7]]
    )


def test_rotary_positions_make_scores_depend_on_offsets_only():
    """RoFormer's property, in float64: q at position m and k at position n score the
    same as at m + c and n + c; and the rotation keeps norms."""
    from flaxformer_lite.model.embedding import rotate

    with jax.enable_x64(True):
        rng = np.random.default_rng(0)
        q = jnp.asarray(rng.normal(size=(1, 5, 2, 8)))
        k = jnp.asarray(rng.normal(size=(1, 5, 2, 8)))
        pos = jnp.asarray([[0, 3, 4, 9, 20]])

        def scores(shift):
            return jnp.einsum("bqhd,bkhd->bhqk", rotate(q, pos + shift), rotate(k, pos + shift))

        np.testing.assert_allclose(scores(0), scores(1000), rtol=1e-9, atol=1e-9)
        np.testing.assert_allclose(
            jnp.linalg.norm(rotate(q, pos), axis=-1), jnp.linalg.norm(q, axis=-1), rtol=1e-12
        )
        assert not np.allclose(scores(0), jnp.einsum("bqhd,bkhd->bhqk", q, k))
