"""Attention core against a float64 numpy reference, for every score function."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from flaxformer_lite.model import attention as A
from flaxformer_lite.model.partitioning import unbox


def _np_softmax(x, mask):
    x = np.where(mask, x, -np.inf)
    m = np.max(x, axis=-1, keepdims=True)
    m = np.where(np.isfinite(m), m, 0.0)
    e = np.where(mask, np.exp(x - m), 0.0)
    s = e.sum(-1, keepdims=True)
    return np.where(s > 0, e / np.where(s > 0, s, 1.0), 0.0)


def _np_scores(name, q, k, params):
    """float64 reference scores [b h q k]."""
    if name == "scaled_dot":
        return np.einsum("bqhd,bkhd->bhqk", q, k) / np.sqrt(q.shape[-1])
    if name == "dot":
        return np.einsum("bqhd,bkhd->bhqk", q, k)
    if name == "bilinear":
        w = np.asarray(params["w"], np.float64)
        b, lq, h, d = q.shape
        out = np.zeros((b, h, lq, k.shape[1]))
        for hi in range(h):
            out[:, hi] = q[:, :, hi] @ w[hi] @ np.swapaxes(k[:, :, hi], 1, 2)
        return out
    if name == "additive":
        wq = np.asarray(params["w_query"], np.float64)
        wk = np.asarray(params["w_key"], np.float64)
        v = np.asarray(params["v"], np.float64)
        b, lq, h, d = q.shape
        lk = k.shape[1]
        out = np.zeros((b, h, lq, lk))
        for bi in range(b):
            for hi in range(h):
                for i in range(lq):
                    for j in range(lk):
                        hid = np.tanh(q[bi, i, hi] @ wq[hi] + k[bi, j, hi] @ wk[hi])
                        out[bi, hi, i, j] = hid @ v[hi]
        return out
    raise KeyError(name)


def _inputs(seed=0, b=2, lq=5, lk=7, h=3, d=4):
    r = np.random.default_rng(seed)
    q = r.normal(size=(b, lq, h, d))
    k = r.normal(size=(b, lk, h, d))
    v = r.normal(size=(b, lk, h, d + 1))  # d_v != d_k on purpose
    mask = r.random((b, 1, lq, lk)) > 0.3
    mask[0, 0, 1, :] = False  # one fully masked row
    return q, k, v, mask


def _score_callable(name, q):
    """The jax score function and its params (built via the registry)."""
    fn = A.make_score_fn(name, num_heads=q.shape[2], head_dim=q.shape[3])
    if isinstance(fn, A.nn.Module):
        params = unbox(
            fn.init(jax.random.key(1), jnp.asarray(q, jnp.float32), jnp.asarray(q, jnp.float32))
        )["params"]
        return (lambda qq, kk: fn.apply({"params": params}, qq, kk)), params
    return fn, {}


@pytest.mark.parametrize("name", ["scaled_dot", "dot", "additive", "bilinear"])
@pytest.mark.parametrize("use_mask", [False, True])
def test_attention_matches_float64_reference(name, use_mask):
    q, k, v, mask = _inputs()
    score, params = _score_callable(name, q)
    m = mask if use_mask else None
    out, weights = A.dot_product_attention(
        jnp.asarray(q, jnp.float32),
        jnp.asarray(k, jnp.float32),
        jnp.asarray(v, jnp.float32),
        m,
        score_fn=score,
        return_weights=True,
    )
    ref_w = _np_softmax(
        _np_scores(name, q, k, params), np.broadcast_to(mask if use_mask else True, (2, 3, 5, 7))
    )
    ref_out = np.einsum("bhqk,bkhv->bqhv", ref_w, v)
    np.testing.assert_allclose(np.asarray(weights), ref_w, rtol=2e-5, atol=2e-6)
    np.testing.assert_allclose(np.asarray(out), ref_out, rtol=2e-5, atol=2e-5)
    if use_mask:
        full = np.broadcast_to(mask, weights.shape)
        assert np.all(np.asarray(weights)[~full] == 0.0), "masked positions must get exactly 0"


def test_float64_path_is_exact():
    q, k, v, mask = _inputs(seed=3)
    with jax.enable_x64(True):
        out = A.dot_product_attention(jnp.asarray(q), jnp.asarray(k), jnp.asarray(v), mask)
        assert out.dtype == jnp.float64
    ref_w = _np_softmax(_np_scores("scaled_dot", q, k, {}), np.broadcast_to(mask, (2, 3, 5, 7)))
    np.testing.assert_allclose(
        np.asarray(out), np.einsum("bhqk,bkhv->bqhv", ref_w, v), rtol=1e-12, atol=1e-12
    )


def test_fully_masked_row_gives_zeros_not_nan():
    q, k, v, mask = _inputs()
    mask[:] = False
    out, w = A.dot_product_attention(
        jnp.asarray(q), jnp.asarray(k), jnp.asarray(v), mask, return_weights=True
    )
    assert np.all(np.asarray(w) == 0.0) and np.all(np.asarray(out) == 0.0)
    g = jax.grad(
        lambda qq: A.dot_product_attention(qq, jnp.asarray(k), jnp.asarray(v), mask).sum()
    )(jnp.asarray(q, jnp.float32))
    assert np.all(np.isfinite(np.asarray(g)))


def test_bfloat16_masking_does_not_overflow():
    q, k, v, mask = _inputs()
    bf = lambda x: jnp.asarray(x, jnp.bfloat16)
    out = A.dot_product_attention(bf(q) * 100, bf(k) * 100, bf(v), mask)
    assert out.dtype == jnp.bfloat16 and np.all(np.isfinite(np.asarray(out, np.float32)))


def test_dropout_on_weights():
    q, k, v, _ = _inputs()
    args = (jnp.asarray(q), jnp.asarray(k), jnp.asarray(v))
    det = A.dot_product_attention(*args, dropout_rate=0.5, deterministic=True)
    np.testing.assert_allclose(det, A.dot_product_attention(*args), rtol=1e-6)
    d1 = A.dot_product_attention(
        *args, dropout_rate=0.5, deterministic=False, dropout_rng=jax.random.key(0)
    )
    d2 = A.dot_product_attention(
        *args, dropout_rate=0.5, deterministic=False, dropout_rng=jax.random.key(0)
    )
    np.testing.assert_array_equal(d1, d2)
    assert not np.allclose(d1, det)
    with pytest.raises(ValueError, match="dropout_rng"):
        A.dot_product_attention(*args, dropout_rate=0.5, deterministic=False)


def test_parameterised_score_by_name_needs_module():
    q, k, v, _ = _inputs()
    with pytest.raises(ValueError, match="has parameters"):
        A.dot_product_attention(jnp.asarray(q), jnp.asarray(k), jnp.asarray(v), score_fn="additive")


def test_unknown_score_and_shape_errors():
    q, k, v, _ = _inputs()
    with pytest.raises(ValueError, match="unknown score function 'cosine'"):
        A.make_score_fn("cosine", num_heads=3, head_dim=4)
    with pytest.raises(ValueError, match=r"\[batch, length, heads, head_dim\]"):
        A.dot_product_attention(jnp.ones((2, 3, 4)), jnp.asarray(k), jnp.asarray(v))


def test_registry_adds_a_score_in_one_place():
    name = "test_negated_dot"
    if name not in A.score_fn_names():
        A.register_score_fn(name)(lambda **_: lambda q, k: -A.dot_scores(q, k))
    from flaxformer_lite.config.model import ModelConfig

    ModelConfig(score_fn=name)  # the config accepts it with no other edit
    q, k, v, _ = _inputs()
    a = A.dot_product_attention(jnp.asarray(q), jnp.asarray(k), jnp.asarray(v), score_fn=name)
    b = A.dot_product_attention(jnp.asarray(q), -jnp.asarray(k), jnp.asarray(v), score_fn="dot")
    np.testing.assert_allclose(a, b, rtol=1e-6)
    with pytest.raises(ValueError, match="already registered"):
        A.register_score_fn(name)(lambda **_: A.dot_scores)
