"""The accelerator kernels (model.attention_impl = cudnn | splash) against the project's
own, in values and gradients, on CPU: cuDNN's path through jax.nn.dot_product_attention's
implementation="xla", splash through Pallas' interpreter."""

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from flaxformer_lite import LanguageModel, ModelConfig, Transformer
from flaxformer_lite.config.model import ConfigError
from flaxformer_lite.model import head_groups, kernels
from flaxformer_lite.model.head_groups import masked_dense_attention
from flaxformer_lite.model.partitioning import unbox
from flaxformer_lite.sparse.grammar import dynamic as D
from flaxformer_lite.sparse.grammar import patterns as P
from flaxformer_lite.sparse.ops.block_sparse.splash import splash_mask
from flaxformer_lite.sparse.ops.block_sparse.xla import sparse_attention


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


# cuDNN -------------------------------------------------------------------------------
# The same code runs with implementation="xla" here (jax.nn's XLA path on the arguments
# cuDNN would get; for packed rows the mask that cuDNN's segment table describes) and
# with implementation="cudnn" on a GPU (the tests marked gpu, skipped elsewhere).
IMPLEMENTATIONS = ["xla", pytest.param("cudnn", marks=pytest.mark.gpu)]
# A float32 model's attention runs in bfloat16 (8-bit mantissa, epsilon 2^-8): the
# observed relative error of values and gradients against float32 is ~0.5 epsilon
# (0.002-0.005 over these cases); the bound is 4 epsilon.
BF16_REL = 4 * 2.0**-8


def _rel(x, y, where=None):
    x, y = np.asarray(x, np.float64), np.asarray(y, np.float64)
    if where is not None:
        x, y = np.where(where, x, 0), np.where(where, y, 0)
    return np.linalg.norm(x - y) / np.linalg.norm(y)


def _packed(b, n):
    """Two packed examples per row, then padding (id 0)."""
    return _segments(b, n)


def _one_per_row(b, n):
    """One example per row, padded at the end (rows of different lengths)."""
    seg = np.zeros((b, n), np.int32)
    for row in range(b):
        seg[row, : n - 16 * (row + 1)] = 1
    return jnp.asarray(seg)


CUDNN_CASES = {  # name: (pattern, segments, packed)
    "dense": (P.Full(), None, False),
    "causal": (P.Full().causal(), None, False),
    "padding": (P.Full(), _one_per_row, False),
    "causal-padding": (P.Full().causal(), _one_per_row, False),
    "packed": (P.Full(), _packed, True),
    "causal-packed": (P.Full().causal(), _packed, True),
    "causal-local-packed": (P.Local(16).causal(), _packed, True),
    "causal-local": (P.Local(16).causal(), _one_per_row, False),
}


def _cudnn_case(name, implementation, b=2, n=128):
    pattern, segments, packed = CUDNN_CASES[name]
    seg = None if segments is None else segments(b, n)

    def fn(q, k, v):
        return kernels.cudnn_attention(
            q, k, v, pattern=pattern, q_segments=seg, packed=packed,
            implementation=implementation,
        )  # fmt: skip

    def ref(q, k, v):
        return masked_dense_attention(q, k, v, pattern, segments=seg)

    real = np.ones((b, n), bool) if seg is None else np.asarray(seg) > 0
    return fn, ref, seg, real


@pytest.mark.parametrize("implementation", IMPLEMENTATIONS)
@pytest.mark.parametrize("name", list(CUDNN_CASES))
def test_cudnn_path_matches_the_float32_reference(name, implementation):
    """Values and gradients (of a loss over the real positions) against the masked dense
    reference in float32, within bfloat16's precision."""
    fn, ref, _, real = _cudnn_case(name, implementation)
    q, k, v = _qkv()
    where = real[..., None, None]
    assert _rel(fn(q, k, v), ref(q, k, v), where) < BF16_REL
    w = jnp.asarray(np.random.default_rng(0).normal(size=q.shape), jnp.float32)
    loss = lambda f: lambda *a: jnp.sum(jnp.where(where, f(*a) * w, 0.0))  # noqa: E731
    got = jax.grad(loss(fn), argnums=(0, 1, 2))(q, k, v)
    want = jax.grad(loss(ref), argnums=(0, 1, 2))(q, k, v)
    for g, r in zip(got, want, strict=True):
        assert _rel(g, r) < BF16_REL
    if not real.all():
        np.testing.assert_array_equal(np.asarray(fn(q, k, v))[~real], 0)  # as our kernels


@pytest.mark.parametrize("implementation", IMPLEMENTATIONS)
@pytest.mark.parametrize("name", ["packed", "causal-local-packed", "causal-padding"])
def test_cudnn_never_attends_across_segments(name, implementation):
    """Exact, whatever the precision: replacing the keys and values a query may not see
    (other examples of the row, padding, keys past the window or in the future) leaves
    its output bit for bit the same."""
    fn, _, seg, real = _cudnn_case(name, implementation)
    pattern = CUDNN_CASES[name][0]
    q, k, v = _qkv()
    base = np.asarray(fn(q, k, v))
    n = q.shape[1]
    allowed = np.asarray(pattern.mask(n))[None] & (
        (np.asarray(seg)[:, :, None] == np.asarray(seg)[:, None, :]) & real[:, None, :]
    )
    noise = np.random.default_rng(1).normal(size=k.shape).astype(np.float32) * 10
    for row, query in [(0, 5), (0, 70), (1, 100)]:  # in the first and second example
        hidden = ~allowed[row, query]
        k2, v2 = np.array(k), np.array(v)
        k2[row, hidden], v2[row, hidden] = noise[row, hidden], noise[row, hidden]
        out = np.asarray(fn(q, jnp.asarray(k2), jnp.asarray(v2)))
        np.testing.assert_array_equal(out[row, query], base[row, query])


def test_cudnn_receives_bfloat16_lengths_and_segment_tables_not_masks():
    """What the fused kernel is given: q/k/v in bfloat16 for a float32 model, padding as
    lengths, packed rows as (length, start) per segment, a left-only window."""
    assert {f.name for f in dataclasses.fields(kernels.CudnnCall)}.isdisjoint({"mask", "bias"})
    q, k, v = _qkv(b=2, n=8)
    padded = jnp.asarray([[1, 1, 1, 1, 1, 0, 0, 0], [1, 1, 0, 0, 0, 0, 0, 0]])
    call = kernels.cudnn_call(q, k, v, q_segments=padded)
    assert {x.dtype for x in (call.query, call.key, call.value)} == {jnp.dtype(jnp.bfloat16)}
    assert call.q_seqlen.tolist() == [5, 2] and call.kv_seqlen.tolist() == [5, 2]
    assert not call.packed and not call.causal and call.window is None
    packed = jnp.asarray([[1, 1, 1, 2, 2, 0, 0, 0], [1, 1, 2, 2, 3, 3, 3, 3]])
    call = kernels.cudnn_call(q, k, v, q_segments=packed, packed=True, causal=True, window=3)
    assert call.q_seqlen.tolist() == [[3, 2, -1, -1], [2, 2, 4, -1]]
    assert call.q_offsets.tolist() == [[0, 3, -1, -1, -1], [0, 2, 4, -1, -1]]
    assert call.kv_offsets.tolist() == call.q_offsets.tolist()
    assert call.causal and call.window == 3
    # Cross-attention: target example i attends to source example i.
    src = jnp.asarray([[1, 1, 2, 2, 2, 2, 0, 0], [1, 2, 2, 3, 0, 0, 0, 0]])
    call = kernels.cudnn_call(q, k, v, q_segments=packed, kv_segments=src, packed=True)
    assert call.kv_seqlen.tolist() == [[2, 4, -1, -1], [1, 2, 1, -1]]
    assert call.kv_offsets.tolist() == [[0, 2, -1, -1, -1], [0, 1, 3, -1, -1]]
    half = kernels.cudnn_call(*(x.astype(jnp.float16) for x in (q, k, v)))
    assert half.query.dtype == jnp.float16  # fp16/bf16 models pass through


def test_cudnn_windows_are_left_only():
    assert kernels.cudnn_window(P.Local(16).causal()) == (True, 16)
    assert kernels.cudnn_window(P.Full()) == (False, None)
    assert kernels.cudnn_computes(P.Local(16).causal())
    assert not kernels.cudnn_computes(P.Local(16))  # two-sided: the band kernel runs it
    with pytest.raises(ValueError, match="not Dilated"):
        kernels.cudnn_window(P.Dilated(4, 2))


def test_each_pattern_has_its_gpu_kernel():
    """cuDNN for what it computes, the band kernel for a two-sided window, the
    block-sparse kernel for everything else static; top-k has none."""
    assert kernels.gpu_kernel(P.Full().causal()) == "cudnn"
    assert kernels.gpu_kernel(P.Local(16).causal()) == "cudnn"
    assert kernels.gpu_kernel(P.Local(16)) == "band"
    for pattern in (P.Dilated(4, 2), P.bigbird(16, 3, 1, 1), P.Local(8).causal() | P.Strided(8)):
        assert kernels.gpu_kernel(pattern) == "block_sparse"
    with pytest.raises(ValueError, match="topk attention's keys depend on the scores"):
        kernels.gpu_kernel(D.TopK(8))


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


def test_splash_reads_its_mask_from_the_tile_plan():
    """A pattern splash has no mask class for is read from the block-sparse kernel's
    tile plan: every slice splash may ask for (blocks, whole columns, unaligned
    rectangles) equals the pattern's dense mask there."""
    n = 384
    pattern = P.bigbird(block_size=32, window_blocks=3, global_blocks=1, random_blocks=2)
    for p in (pattern, pattern.causal(), P.Strided(24) | P.Global((5, -1))):
        mask, dense = splash_mask(p, n, 128), p.mask(n)
        for rows, cols in [
            (slice(0, 128), slice(128, 256)), (slice(None), slice(200, 201)),
            (slice(37, 300), slice(5, 383)), (slice(None), slice(None)),
        ]:  # fmt: skip
            np.testing.assert_array_equal(mask[rows, cols], dense[rows, cols])
        assert hash(mask) == hash(splash_mask(p, n, 128))


@pytest.mark.slow
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


@pytest.fixture(
    params=["xla-float32", "xla-bfloat16", pytest.param("cudnn-bfloat16", marks=pytest.mark.gpu)]
)
def cudnn_run(request, monkeypatch):
    """The model's cuDNN path three ways. On CPU (implementation="xla") keeping float32
    (the one change to the code path: q/k/v are not rounded), where the plumbing
    (segment tables, cross-attention's pairing, causality) must match the float32
    model to float32's tolerances; on CPU as it runs on a GPU, rounded to bfloat16,
    where the logits and the whole gradient must agree within bfloat16's (BF16_REL;
    one parameter's gradient alone can be off by more: ~8 epsilon seen on the packed
    Transformer's FFN bias); and on a GPU through real cuDNN, in bfloat16."""
    implementation, precision = request.param.split("-")
    if implementation == "xla":
        monkeypatch.setattr(kernels, "platform_mode", lambda impl: "xla")
    if precision == "float32":
        monkeypatch.setattr(kernels, "CUDNN_DTYPES", (*kernels.CUDNN_DTYPES, jnp.float32))
        return None
    return BF16_REL


def _grads_agree(model_a, model_b, *args, rel=None, **kwargs):
    """Logits at the real (non-padding) target positions, and gradients of a loss on
    them. (Padded positions differ: jax's kernel spreads a fully masked row evenly,
    ours gives it zero weights; neither reaches a real position or the loss.)
    ``rel``: compare by relative norm (per parameter) within this bound, for a model
    whose attention runs in bfloat16; else to float32's tolerances."""
    params = unbox(model_a.init(jax.random.key(0), *args, **kwargs))["params"]
    real = (args[-1] != 0)[..., None]
    apply = lambda model: functools.partial(model.apply, **kwargs)  # noqa: E731

    def loss(model):
        return lambda p: jnp.sum(jnp.where(real, apply(model)({"params": p}, *args), 0) ** 2) * 1e-3

    a = np.where(real, jax.jit(apply(model_a))({"params": params}, *args), 0)
    b = np.where(real, jax.jit(apply(model_b))({"params": params}, *args), 0)
    if rel is None:
        np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-4)
    else:
        assert _rel(b, a) < rel
    ga, gb = jax.jit(jax.grad(loss(model_a)))(params), jax.jit(jax.grad(loss(model_b)))(params)
    if rel is not None:  # the whole gradient (one leaf, a key bias, is 0 in exact arithmetic)
        flat = lambda g: np.concatenate([np.ravel(x) for x in jax.tree.leaves(g)])  # noqa: E731
        assert _rel(flat(gb), flat(ga)) < rel
        return
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


def test_the_transformer_with_cudnn_attention(cudnn_run):
    src = jnp.array([[5, 6, 7, 8, 9, 1, 0, 0], [10, 11, 1, 0, 0, 0, 0, 0]])
    tgt = jnp.array([[12, 13, 14, 1, 0, 0], [15, 16, 17, 18, 1, 0]])
    _grads_agree(
        Transformer(BASE), Transformer(BASE.replace(attention_impl="cudnn")), src, tgt,
        rel=cudnn_run,
    )  # fmt: skip


def test_the_transformer_with_cudnn_attention_on_packed_rows(cudnn_run):
    """Packed rows reach cuDNN as segment tables in the encoder, the causal decoder and
    cross-attention (target example i attends to source example i only)."""
    src = jnp.array([[5, 6, 7, 1, 8, 9, 1, 0], [10, 11, 1, 12, 1, 13, 14, 1]])
    src_seg = jnp.array([[1, 1, 1, 1, 2, 2, 2, 0], [1, 1, 1, 2, 2, 3, 3, 3]])
    tgt = jnp.array([[12, 13, 1, 14, 15, 16, 1, 0], [15, 1, 16, 17, 1, 18, 1, 0]])
    tgt_seg = jnp.array([[1, 1, 1, 2, 2, 2, 2, 0], [1, 1, 2, 2, 2, 3, 3, 0]])
    position = lambda seg: jnp.asarray(  # noqa: E731
        [[i - list(row).index(s) for i, s in enumerate(row)] for row in np.asarray(seg)]
    )
    packing = dict(
        inputs_segmentation=src_seg, targets_segmentation=tgt_seg,
        inputs_positions=position(src_seg), targets_positions=position(tgt_seg),
    )  # fmt: skip
    _grads_agree(
        Transformer(BASE), Transformer(BASE.replace(attention_impl="cudnn")), src, tgt,
        rel=cudnn_run, **packing,
    )  # fmt: skip


@pytest.mark.parametrize(
    "impl,pattern",
    [
        ("cudnn", "local:window=8"),
        ("cudnn", "bigbird;sparse_strided:stride=16"),
        ("splash", "local:window=8;bigbird"),
        pytest.param("cudnn-on-gpu", "local:window=8", marks=pytest.mark.gpu),
    ],
)
def test_the_language_model_with_fused_sparse_kernels(request, impl, pattern):
    if impl == "cudnn-on-gpu":
        impl = "cudnn"
    else:
        request.getfixturevalue("on_cpu_anyway")
    config = BASE.replace(attention_pattern=pattern, attention_block_size=16)
    tokens = jax.random.randint(jax.random.key(3), (1, 128), 3, 50)
    _grads_agree(
        LanguageModel(config), LanguageModel(config.replace(attention_impl=impl)), tokens,
        rel=BF16_REL if impl == "cudnn" else None,
    )  # fmt: skip


def test_a_two_sided_window_runs_on_the_band_kernel_under_cudnn(on_cpu_anyway, monkeypatch):
    """local:window=w in the encoder is two-sided, which cuDNN cannot compute: that head
    group runs on the band kernel (sparse/ops/band/pallas_triton.py, through Pallas' interpreter
    here;
    float32, so the same values as the blocked kernel to float32 rounding; the causal
    decoder's cuDNN path is checked by the language model's test above)."""
    from flaxformer_lite.sparse.ops.band import pallas_triton as band_gpu

    calls = []
    monkeypatch.setattr(
        head_groups, "band_attention",
        lambda *a, **kw: calls.append(kw) or band_gpu.band_attention(*a, **kw),
    )  # fmt: skip
    config = BASE.replace(attention_pattern="local:window=4", attention_block_size=16)
    src = jnp.array([[5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15, 1, 0, 0, 0, 0]])
    tgt = jnp.array([[12, 13, 14, 15, 16, 17, 18, 19, 20, 1, 0, 0, 0, 0, 0, 0]])
    model = Transformer(config.replace(attention_impl="cudnn"))
    params = unbox(model.init(jax.random.key(0), src, tgt))["params"]
    encoded = lambda m: m.apply({"params": params}, src, method=Transformer.encode)  # noqa: E731
    real = np.asarray(src != 0)
    np.testing.assert_allclose(  # the encoder: the band kernel, same float32 values
        np.asarray(encoded(model))[real], np.asarray(encoded(Transformer(config)))[real],
        rtol=1e-5, atol=1e-5,
    )  # fmt: skip
    assert calls and all(kw["interpret"] and kw["segments"] is not None for kw in calls)


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
    with pytest.raises(ConfigError, match="topk attention's keys depend on the scores"):
        BASE.replace(attention_impl="cudnn", attention_pattern="local:window=8;topk:k=4")
    BASE.replace(attention_impl="cudnn", attention_pattern="bigbird", attention_block_size=16)
    with pytest.raises(ConfigError, match="score_fn='additive' with model.attention_impl=cudnn"):
        BASE.replace(attention_impl="cudnn", score_fn="additive")
    with pytest.raises(ConfigError, match="no dropout on the attention"):
        BASE.replace(attention_impl="cudnn", attention_dropout=0.1)
    with pytest.raises(ConfigError, match="not float64"):
        BASE.replace(attention_impl="cudnn", dtype="float64")
    with pytest.raises(ConfigError, match="a multiple of 8 and at most 256.*d_k is 12"):
        BASE.replace(attention_impl="cudnn", d_model=48, num_heads=4)


def test_the_kernel_of_each_layer_is_named():
    """What a run prints at start-up: per stack and layer (alike layers as one entry),
    each head group's pattern and the kernel that runs it."""
    from flaxformer_lite.model.build import attention_kernels

    config = BASE.replace(
        attention_impl="cudnn", attention_pattern="bigbird;local:window=8|full",
        attention_block_size=16, num_encoder_layers=3, num_decoder_layers=2,
    )  # fmt: skip
    line = attention_kernels(config, "translation")
    assert line.startswith(
        "attention (attention_impl=cudnn): encoder layer 0: bigbird -> the "
        "block-sparse kernel (Triton), local:window=8 -> the band kernel"
    )
    assert (
        "decoder layer 0: causal bigbird -> the block-sparse kernel (Triton), causal "
        "local:window=8 -> cuDNN's fused kernel; decoder layer 1: causal full -> cuDNN"
    ) in line
    dense = attention_kernels(BASE.replace(num_decoder_layers=4), "lm")
    assert dense == "attention (attention_impl=blocked): decoder layers 0-3: dense -> XLA"
