"""Chunked (online-softmax) dense attention equals the plain kernel: values and
gradients in float64, with padding, causal and segment masks, chunks that do not divide
the lengths, cross-attention shapes, and through the whole model."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from flaxformer_lite import LanguageModel, ModelConfig, Transformer
from flaxformer_lite.config.model import ConfigError
from flaxformer_lite.model.attention import dot_product_attention
from flaxformer_lite.model.chunked import chunked_attention
from flaxformer_lite.model.partitioning import unbox


def _arrays(b, n, m, h, d, seed=0, dtype=jnp.float64):
    keys = jax.random.split(jax.random.key(seed), 4)
    q = jax.random.normal(keys[0], (b, n, h, d), dtype)
    k = jax.random.normal(keys[1], (b, m, h, d), dtype)
    v = jax.random.normal(keys[2], (b, m, h, d), dtype)
    cot = jax.random.normal(keys[3], (b, n, h, d), dtype)
    return q, k, v, cot


def _segments(b, n, seed):
    """Packed rows: 2-4 segments each, then padding (0)."""
    rng = np.random.default_rng(seed)
    out = np.zeros((b, n), np.int32)
    for row in range(b):
        cuts = np.sort(rng.choice(np.arange(1, n - 2), size=rng.integers(1, 4), replace=False))
        ends = list(cuts) + [n - rng.integers(0, 3)]
        start = 0
        for s, end in enumerate(ends, 1):
            out[row, start:end] = s
            start = end
    return jnp.asarray(out)


def _value_and_grads(fn, q, k, v, cot):
    """The output and the gradients for ``cot``, compiled as one program: op by op, the
    float64 cases spent most of their time dispatching and compiling single ops."""

    @jax.jit
    def run(q, k, v, cot):
        out, vjp = jax.vjp(fn, q, k, v)
        return (out, *vjp(cot))

    return run(q, k, v, cot)


CASES = {
    "plain": dict(n=40, m=40, chunk=16),
    "cross, padding mask": dict(n=24, m=37, chunk=8, mask=True),
    "causal": dict(n=50, m=50, chunk=16, causal=True),
    "packed causal": dict(n=48, m=48, chunk=16, causal=True, segments=True),
    "packed": dict(n=33, m=33, chunk=7, segments=True),
    "one chunk": dict(n=20, m=20, chunk=512, causal=True),
}


@pytest.mark.parametrize("name", list(CASES))
def test_chunked_equals_plain_in_float64(name):
    case = CASES[name]
    n, m = case["n"], case["m"]
    with jax.enable_x64():
        q, k, v, cot = _arrays(2, n, m, 3, 8)
        mask, kw = None, {}
        if case.get("mask"):
            mask = (jnp.arange(m) < jnp.array([m, m - 9])[:, None])[:, None, None, :]
            kw["mask"] = mask
        if case.get("segments"):
            seg = _segments(2, n, 1)
            kw.update(q_segments=seg, k_segments=seg)
            same = (seg[:, :, None] == seg[:, None, :]) & (seg[:, None, :] != 0)
            mask = same[:, None] if mask is None else mask & same[:, None]
        if case.get("causal"):
            kw["causal"] = True
            tri = jnp.tril(jnp.ones((n, m), bool))[None, None]
            mask = tri if mask is None else mask & tri
        # A row with nothing to attend (padding) outputs zeros here and a uniform
        # average in the plain kernel: compare the rows that see keys, and give the
        # others no cotangent so they add nothing to the gradients either.
        seen = jnp.ones((2, n), bool)
        if mask is not None:
            seen = jnp.any(jnp.broadcast_to(mask, (2, 1, n, m)), -1)[:, 0]
        cot = cot * seen[..., None, None]
        ours = functools.partial(chunked_attention, chunk=case["chunk"], **kw)
        plain = functools.partial(dot_product_attention, mask=mask)
        got = list(_value_and_grads(ours, q, k, v, cot))
        want = list(_value_and_grads(plain, q, k, v, cot))
        want[0] = want[0] * seen[..., None, None]
        got, want, seen = jax.tree.map(np.asarray, (got, want, seen))
    assert np.abs(got[0]).max() > 0.1 and seen.any()
    if "segments" in case:
        assert not seen.all()  # padding rows were there
        np.testing.assert_array_equal(got[0] * ~seen[..., None, None], 0.0)
    for a, b in zip(got, want, strict=True):
        np.testing.assert_allclose(a, b, rtol=1e-10, atol=1e-12)


def test_chunked_float32_agrees_and_keeps_memory_linear():
    q, k, v, cot = _arrays(1, 2048, 2048, 2, 32, dtype=jnp.float32)
    got = _value_and_grads(functools.partial(chunked_attention, chunk=256), q, k, v, cot)
    want = _value_and_grads(dot_product_attention, q, k, v, cot)
    for a, b in zip(got, want, strict=True):
        np.testing.assert_allclose(a, b, rtol=2e-4, atol=2e-5)

    def peak(fn):
        loss = lambda q, k, v: jnp.sum(fn(q, k, v) * cot)
        compiled = jax.jit(jax.grad(loss, argnums=(0, 1, 2))).lower(q, k, v).compile()
        mem = compiled.memory_analysis()
        return mem.temp_size_in_bytes

    # The plain kernel holds [h, n, n] weights (32 MiB here); the chunked one a few
    # [h, chunk, chunk] blocks.
    assert peak(functools.partial(chunked_attention, chunk=256)) * 8 < peak(dot_product_attention)


def _config(**kw):
    return ModelConfig(
        vocab_size=50, d_model=32, num_heads=4, d_ff=64, num_encoder_layers=1,
        num_decoder_layers=1, max_len=64, embedding_dropout=0.0, residual_dropout=0.0, **kw,
    )  # fmt: skip


@pytest.mark.parametrize("lm", [pytest.param(False, marks=pytest.mark.slow), True])
def test_the_models_with_chunked_attention_equal_plain(lm):
    """Packed batches (segment ids, positions) through the encoder-decoder and the LM."""
    plain_c, chunked_c = _config(), _config(attention_impl="chunked", attention_chunk=8)
    seg = _segments(2, 30, 3)
    tokens = jnp.where(seg > 0, jax.random.randint(jax.random.key(1), (2, 30), 3, 50), 0)
    pos = jnp.zeros_like(seg)
    kw = dict(deterministic=True)
    if lm:
        args, kw = (tokens,), dict(kw, positions=pos, segmentation=seg)
        plain, chunked = LanguageModel(plain_c), LanguageModel(chunked_c)
    else:
        args = (tokens, tokens)
        kw.update(inputs_segmentation=seg, targets_segmentation=seg)
        plain, chunked = Transformer(plain_c), Transformer(chunked_c)
    params = unbox(plain.init(jax.random.key(0), *args)["params"])

    def loss(model, p):
        logits = model.apply({"params": p}, *args, **kw)
        return jnp.sum(jnp.where(seg[..., None] > 0, logits, 0.0) ** 2)

    # The chunked model really runs the chunked kernel (its loops), the plain one none.
    loops = [
        str(jax.make_jaxpr(functools.partial(loss, m))(params)).count("scan[")
        for m in (plain, chunked)
    ]
    assert loops[0] == 0 and loops[1] >= 2
    (la, ga), (lb, gb) = (
        jax.jit(jax.value_and_grad(functools.partial(loss, m)))(params)  # jit: no eager dispatch
        for m in (plain, chunked)
    )
    np.testing.assert_allclose(la, lb, rtol=1e-5)
    # float32 sums in another order: compare at the gradients' scale (the key biases'
    # gradients are exactly zero in exact arithmetic, float noise here).
    scale = max(float(jnp.abs(g).max()) for g in jax.tree.leaves(ga))
    jax.tree.map(
        lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-3, atol=1e-5 * scale), ga, gb
    )


def test_chunked_refuses_what_it_cannot_compute():
    with pytest.raises(ConfigError, match="attention_impl=chunked"):
        _config(attention_impl="chunked", score_fn="additive")
    with pytest.raises(ConfigError, match="attention_impl=chunked"):
        _config(attention_impl="chunked", attention_dropout=0.1)
    with pytest.raises(ConfigError, match="attention_impl=chunked"):
        _config(attention_impl="chunked", attention_pattern="local:window=8")
