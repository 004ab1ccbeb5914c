"""The accelerator kernels (model.attention_impl = cudnn | splash) against the project's
own, in values and gradients, on CPU: cuDNN's path through jax.nn.dot_product_attention's
implementation="xla", splash through Pallas' interpreter."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from flaxformer_lite import LanguageModel, ModelConfig, Transformer
from flaxformer_lite.components import kernels
from flaxformer_lite.components.sparse import masked_dense_attention
from flaxformer_lite.config import ConfigError
from flaxformer_lite.partitioning import unbox
from flaxformer_lite.sparse import patterns as P
from flaxformer_lite.sparse.blocked import sparse_attention


def _qkv(b=2, n=128, h=2, d=32, seed=0):
    keys = jax.random.split(jax.random.key(seed), 3)
    return [jax.random.normal(k, (b, n, h, d), jnp.float32) for k in keys]


def _segments(b, n):
    """Two packed examples per row, then padding (id 0)."""
    seg = np.zeros((b, n), np.int32)
    seg[:, : n // 2] = 1
    seg[:, n // 2 : n - n // 8] = 2
    return jnp.asarray(seg)


def _check(fn, ref, args, real):
    """Values and gradients (of a loss over the real positions) agree."""
    w = jnp.asarray(np.random.default_rng(0).normal(size=args[0].shape), jnp.float32)

    def loss(f):
        return lambda *a: jnp.sum(jnp.where(real[..., None, None], f(*a) * w, 0.0))

    np.testing.assert_allclose(
        np.where(real[..., None, None], fn(*args), 0),
        np.where(real[..., None, None], ref(*args), 0),
        rtol=1e-5,
        atol=1e-5,
    )
    got = jax.grad(loss(fn), argnums=(0, 1, 2))(*args)
    want = jax.grad(loss(ref), argnums=(0, 1, 2))(*args)
    for g, r in zip(got, want, strict=True):
        np.testing.assert_allclose(g, r, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize(
    "pattern",
    [P.Full(), P.Full().causal(), P.Local(16), P.Local(16).causal()],
    ids=["dense", "causal", "local", "causal-local"],
)
def test_cudnn_path_matches_the_masked_reference(pattern):
    q, k, v = _qkv()
    seg = _segments(2, 128)
    fn = lambda q, k, v: kernels.cudnn_attention(  # noqa: E731
        q, k, v, pattern=pattern, segments=seg, implementation="xla"
    )
    ref = lambda q, k, v: masked_dense_attention(q, k, v, pattern, segments=seg)  # noqa: E731
    _check(fn, ref, (q, k, v), np.asarray(seg) > 0)


def test_cudnn_path_takes_a_dense_mask():
    q, k, v = _qkv()
    mask = jnp.asarray(np.tril(np.ones((128, 128), bool)))[None, None]
    fn = lambda q, k, v: kernels.cudnn_attention(q, k, v, mask=mask, implementation="xla")  # noqa: E731
    ref = lambda q, k, v: masked_dense_attention(q, k, v, P.Full().causal())  # noqa: E731
    _check(fn, ref, (q, k, v), np.ones((2, 128), bool))


SPLASH_PATTERNS = {
    "full": [P.Full(), P.Full()],
    "causal|local": [P.Full().causal(), P.Local(16)],
    "causal-local|chunked": [P.Local(24).causal(), P.BlockLocal(128, 0).causal()],
    "bigbird|strided": [
        P.bigbird(block_size=32, window_blocks=3, global_blocks=1, random_blocks=1),
        P.Strided(32).causal(),
    ],
}


def _splash_against_blocked(patterns, heads):
    q, k, v = _qkv(b=1, n=256, h=heads, d=32, seed=1)
    seg = _segments(1, 256)
    per = heads // len(patterns)

    def ref(q, k, v):
        outs = [
            sparse_attention(
                q[:, :, per * g : per * (g + 1)],
                k[:, :, per * g : per * (g + 1)],
                v[:, :, per * g : per * (g + 1)],
                p,
                block_size=32,
                q_segments=seg,
                kv_segments=seg,
            )
            for g, p in enumerate(patterns)
        ]
        return jnp.concatenate(outs, axis=2)

    fn = lambda q, k, v: kernels.splash_attention(  # noqa: E731
        q, k, v, patterns, segments=seg, interpret=True
    )
    _check(fn, ref, (q, k, v), np.asarray(seg) > 0)


def test_splash_matches_the_blocked_kernel():
    """One head per pattern, packed rows: a CausalMask, a LocalMask, a ChunkedCausalMask
    and BigBird's NumpyMask against the blocked kernel (the slow test pairs them up)."""
    _splash_against_blocked(
        [
            P.Full().causal(),
            P.Local(16),
            P.BlockLocal(128, 0).causal(),
            P.bigbird(block_size=32, window_blocks=3, global_blocks=1, random_blocks=1),
        ],
        heads=4,
    )


@pytest.mark.slow
@pytest.mark.parametrize("name", list(SPLASH_PATTERNS))
def test_splash_matches_the_blocked_kernel_in_head_groups(name):
    """Two head groups of two heads each, under their own patterns."""
    _splash_against_blocked(SPLASH_PATTERNS[name], heads=4)


@pytest.fixture
def on_cpu_anyway(monkeypatch):
    """Run the model's cudnn/splash paths on CPU (xla / the interpreter)."""
    modes = {"cudnn": "xla", "splash": True}
    monkeypatch.setattr(kernels, "platform_mode", lambda impl: modes[impl])


def _grads_agree(model_a, model_b, *args):
    """Logits at the real (non-padding) target positions, and gradients of a loss on
    them. (Padded positions differ: jax's kernel spreads a fully masked row evenly,
    ours gives it zero weights; neither reaches a real position or the loss.)"""
    params = unbox(model_a.init(jax.random.key(0), *args))["params"]
    real = (args[-1] != 0)[..., None]

    def loss(model):
        return lambda p: jnp.sum(jnp.where(real, model.apply({"params": p}, *args), 0) ** 2) * 1e-3

    np.testing.assert_allclose(
        np.where(real, jax.jit(model_a.apply)({"params": params}, *args), 0),
        np.where(real, jax.jit(model_b.apply)({"params": params}, *args), 0),
        rtol=1e-4,
        atol=1e-4,
    )
    ga, gb = jax.jit(jax.grad(loss(model_a)))(params), jax.jit(jax.grad(loss(model_b)))(params)
    for (path, x), y in zip(
        jax.tree_util.tree_flatten_with_path(ga)[0], jax.tree.leaves(gb), strict=True
    ):
        np.testing.assert_allclose(x, y, rtol=1e-3, atol=1e-5, err_msg=jax.tree_util.keystr(path))


BASE = ModelConfig(
    vocab_size=50,
    d_model=32,
    num_heads=4,
    d_ff=64,
    num_encoder_layers=1,
    num_decoder_layers=1,
    max_len=128,
    embedding_dropout=0.0,
    residual_dropout=0.0,
)


def test_the_transformer_with_cudnn_attention(on_cpu_anyway):
    src = jnp.array([[5, 6, 7, 8, 9, 1, 0, 0], [10, 11, 1, 0, 0, 0, 0, 0]])
    tgt = jnp.array([[12, 13, 14, 1, 0, 0], [15, 16, 17, 18, 1, 0]])
    _grads_agree(Transformer(BASE), Transformer(BASE.replace(attention_impl="cudnn")), src, tgt)


@pytest.mark.parametrize(
    "impl,pattern", [("cudnn", "local:window=8"), ("splash", "local:window=8;bigbird")]
)
def test_the_language_model_with_fused_sparse_kernels(on_cpu_anyway, impl, pattern):
    config = BASE.replace(attention_pattern=pattern, attention_block_size=16)
    tokens = jax.random.randint(jax.random.key(3), (1, 128), 3, 50)
    _grads_agree(LanguageModel(config), LanguageModel(config.replace(attention_impl=impl)), tokens)


def test_a_kernel_off_its_platform_says_what_to_pick():
    model = Transformer(BASE.replace(attention_impl="cudnn"))
    x = jnp.ones((1, 4), jnp.int32)
    with pytest.raises(
        ValueError, match="attention_impl=cudnn needs an NVIDIA GPU, and this is cpu"
    ):
        model.init(jax.random.key(0), x, x)
    with pytest.raises(ValueError, match="attention_impl=splash needs a TPU"):
        kernels.platform_mode("splash")


def test_fused_kernels_refuse_what_they_cannot_compute():
    with pytest.raises(
        ConfigError, match="attention_impl=splash runs the sparse attention_pattern"
    ):
        BASE.replace(attention_impl="splash")
    with pytest.raises(ConfigError, match="computes dense, causal and local-window attention, not"):
        BASE.replace(attention_impl="cudnn", attention_pattern="bigbird", attention_block_size=16)
    with pytest.raises(ConfigError, match="not score_fn='additive'"):
        BASE.replace(attention_impl="cudnn", score_fn="additive")
    with pytest.raises(ConfigError, match="no dropout on the attention"):
        BASE.replace(attention_impl="cudnn", attention_dropout=0.1)
