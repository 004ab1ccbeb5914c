"""Sparse attention: blocked kernel == masked dense oracle, causality, coverage, config."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from flaxformer_lite.config.model import ConfigError, ModelConfig
from flaxformer_lite.model import head_groups as sparse
from flaxformer_lite.model.attention import dot_product_attention
from flaxformer_lite.model.lm import LanguageModel
from flaxformer_lite.model.masks import make_causal_mask
from flaxformer_lite.model.partitioning import unbox
from flaxformer_lite.model.transformer import Transformer, shift_right
from flaxformer_lite.sparse.grammar import analysis, spec
from flaxformer_lite.sparse.grammar import patterns as P
from flaxformer_lite.sparse.ops.block_sparse.xla import block_diagonals, sparse_attention
from flaxformer_lite.sparse.ops.topk.xla import topk_attention
from tests import oracles


@pytest.fixture
def rng():
    return np.random.default_rng(0)


PATTERNS = {
    "full": P.Full(),
    "local": P.Local(5),
    "dilated": P.Dilated(3, 4),
    "strided": P.Strided(7),
    "fixed": P.Fixed(8, 2),
    "global": P.Global((0, 3, -1)),
    "random": P.RandomBlocks(8, 2, seed=1),
    "block_local": P.BlockLocal(8, 1),
    "bigbird": P.bigbird(8, 3, 1, 2),
    "sparse_strided": P.sparse_transformer_strided(6),
    "longformer": P.longformer(4, (0,)),
    "local|strided|global": P.Local(3) | P.Strided(5) | P.Global((2,)),
    "local&dilated": P.Local(6) & P.Dilated(4, 2),
    "global&local": P.Global((1,)) & P.Local(3),
    "fixed|random": P.Fixed(4) | P.RandomBlocks(4, 1, seed=3),
}


def _qkv(rng, b, n, h, d):
    return tuple(jnp.asarray(rng.normal(size=(b, n, h, d)), jnp.float32) for _ in range(3))


def _segments(b, n):
    s = np.ones((b, n), np.int32)
    s[0, n // 2 :] = 2  # two packed examples in row 0
    s[-1, n - 3 :] = 0  # padding at the end of the last row
    return jnp.asarray(s)


# Every pattern and causal variant at a length that is not a multiple of the block
# (with packed segments and padding); a few at a multiple. The default run takes each
# pattern once, causal and not in turn (both variants of the kernel's masks are in it,
# and every pattern's block tables); the other variant of each is in the slow run.
def _cases():
    cases = [(name, 37, 8) for name in PATTERNS]
    cases += [(n, 32, 16) for n in ("full", "bigbird", "sparse_strided", "local|strided|global")]
    out = []
    for i, (name, n, block) in enumerate(cases):
        for causal in (False, True):
            marks = () if causal == bool(i % 2) else (pytest.mark.slow,)
            out.append(pytest.param(name, causal, n, block, marks=marks))
    return out


CASES = _cases()


@pytest.mark.parametrize("name,causal,n,block", CASES)
def test_blocked_matches_reference_values_and_gradients(name, causal, n, block, rng):
    pattern = PATTERNS[name].causal() if causal else PATTERNS[name]
    q, k, v = _qkv(rng, 2, n, 2, 8)
    seg = _segments(2, n) if n % block else None
    kw = dict(q_segments=seg, kv_segments=seg)
    weights = jnp.cos(jnp.arange(8.0))

    def loss(fn):
        return lambda q, k, v: (fn(q, k, v) * weights).sum()

    blocked = lambda q, k, v: sparse_attention(q, k, v, pattern, block_size=block, **kw)
    ref = lambda q, k, v: oracles.masked_attention(q, k, v, pattern, **kw)
    np.testing.assert_allclose(jax.jit(blocked)(q, k, v), ref(q, k, v), atol=2e-6, rtol=1e-5)
    gb = jax.jit(jax.grad(loss(blocked), argnums=(0, 1, 2)))(q, k, v)
    gr = jax.grad(loss(ref), argnums=(0, 1, 2))(q, k, v)
    for a, r in zip(gb, gr, strict=True):
        np.testing.assert_allclose(a, r, atol=1e-5, rtol=1e-4)


@pytest.mark.parametrize(
    "name,causal",
    [
        ("bigbird", False),  # band + global + random blocks
        ("local", True),
        pytest.param("local|strided|global", False, marks=pytest.mark.slow),
        pytest.param("random", False, marks=pytest.mark.slow),
    ],
)
def test_blocked_agrees_with_reference_in_float64(name, causal, rng):
    """The block kernel's hand-written backward (recomputed probabilities) to float64
    rounding: values and gradients, packed segments and padding, a partial last block."""
    pattern = PATTERNS[name].causal() if causal else PATTERNS[name]
    with jax.enable_x64():
        q, k, v = (jnp.asarray(x, jnp.float64) for x in _qkv(rng, 2, 37, 2, 8))
        seg = _segments(2, 37)
        kw = dict(q_segments=seg, kv_segments=seg)
        weights = jnp.cos(jnp.arange(8.0, dtype=jnp.float64))
        blocked = lambda q, k, v: sparse_attention(q, k, v, pattern, block_size=8, **kw)
        ref = lambda q, k, v: oracles.masked_attention(q, k, v, pattern, **kw)
        # Under jit: op by op, the kernel's many small block operations dispatch one at a
        # time (several times slower here); the arithmetic, in float64, is the same.
        grad = lambda fn: jax.jit(
            jax.value_and_grad(lambda *a: (fn(*a) * weights).sum(), (0, 1, 2))
        )
        got, want = grad(blocked)(q, k, v), grad(ref)(q, k, v)
        np.testing.assert_allclose(got[0], want[0], rtol=1e-12)
        for a, r in zip(got[1], want[1], strict=True):
            assert a.dtype == jnp.float64
            np.testing.assert_allclose(a, r, rtol=1e-9, atol=1e-12)


def test_normalise_backward_is_the_quotients(rng):
    """online_softmax.normalise's written-out backward equals autodiff of
    ``where(l > 0, o / l, 0)`` in float64 (rounding only), zero where ``l == 0``; a
    backward that forgot the ``dl`` term or divided by ``l`` twice fails."""
    from flaxformer_lite.sparse.ops.online_softmax import normalise

    def quotient(o, l):
        return jnp.where(l[..., None] > 0, o / jnp.where(l > 0, l, 1.0)[..., None], 0.0)

    with jax.enable_x64():
        o = jnp.asarray(rng.normal(size=(2, 3, 7, 5)))
        l = jnp.asarray(rng.uniform(0.2, 3.0, size=(2, 3, 7))).at[0, 1, 2].set(0.0)
        g = jnp.asarray(rng.normal(size=o.shape))
        grads = [jax.grad(lambda o, l, f=f: (f(o, l) * g).sum(), (0, 1))(o, l)
                 for f in (normalise, quotient)]  # fmt: skip
        np.testing.assert_allclose(normalise(o, l), quotient(o, l), rtol=1e-14)
        for got, want in zip(*grads, strict=True):
            np.testing.assert_allclose(got, want, rtol=1e-12, atol=1e-14)
        assert not grads[0][0][0, 1, 2].any() and grads[0][1][0, 1, 2] == 0
        assert float(abs(grads[0][1]).max()) > 0.1  # the dl term is there to check


@pytest.mark.parametrize(
    "name,scan_blocks", [("bigbird", 2), ("local|strided|global", 2), ("fixed", 1)]
)
def test_scanned_blocks_match_reference(name, scan_blocks, rng):
    """The memory-saving mode (query blocks in a lax.map, recomputed in the backward
    pass) gives the reference's values and gradients; 5 blocks do not divide by 2."""
    pattern = PATTERNS[name].causal() if name == "fixed" else PATTERNS[name]
    q, k, v = _qkv(rng, 2, 37, 2, 8)
    seg = _segments(2, 37)
    kw = dict(q_segments=seg, kv_segments=seg)
    weights = jnp.cos(jnp.arange(8.0))
    blocked = lambda q, k, v: sparse_attention(
        q, k, v, pattern, block_size=8, scan_blocks=scan_blocks, **kw
    )
    ref = lambda q, k, v: oracles.masked_attention(q, k, v, pattern, **kw)
    np.testing.assert_allclose(jax.jit(blocked)(q, k, v), ref(q, k, v), atol=2e-6, rtol=1e-5)
    loss = lambda fn: lambda q, k, v: (fn(q, k, v) * weights).sum()
    gb = jax.jit(jax.grad(loss(blocked), argnums=(0, 1, 2)))(q, k, v)
    gr = jax.grad(loss(ref), argnums=(0, 1, 2))(q, k, v)
    for a, r in zip(gb, gr, strict=True):
        np.testing.assert_allclose(a, r, atol=1e-5, rtol=1e-4)


@pytest.mark.parametrize("name", ["bigbird", "local|strided|global", "fixed"])
def test_reference_impl_is_the_masked_oracle(name, rng):
    """attention_impl=reference (dense attention under the pattern's mask) agrees with
    the oracle, packed segments and padding included."""
    pattern = PATTERNS[name]
    q, k, v = _qkv(rng, 2, 37, 2, 8)
    seg = _segments(2, 37)
    got = sparse.masked_dense_attention(q, k, v, pattern, segments=seg)
    want = oracles.masked_attention(q, k, v, pattern, q_segments=seg, kv_segments=seg)
    np.testing.assert_allclose(got, want, atol=2e-6, rtol=1e-5)


def test_block_diagonals_split_bands_from_random_blocks():
    mask = np.eye(10, dtype=bool) | np.eye(10, k=1, dtype=bool) | np.eye(10, k=-1, dtype=bool)
    mask[2, 7] = mask[9, 0] = True  # two "random" blocks
    offsets, rest = block_diagonals(mask)
    assert offsets == [-1, 0, 1]
    assert sorted(zip(*np.nonzero(rest), strict=True)) == [(2, 7), (9, 0)]


@pytest.mark.parametrize("name", ["local", "dilated", "strided", "fixed", "bigbird", "random"])
def test_causal_variants_never_see_the_future(name, rng):
    pattern = PATTERNS[name].causal()
    n = 29
    assert not np.triu(pattern.mask(n), 1).any()
    q, k, v = _qkv(rng, 1, n, 2, 4)
    t = 13
    v2 = v.at[:, t + 1 :].add(100.0)
    k2 = k.at[:, t + 1 :].add(-50.0)
    a = sparse_attention(q, k, v, pattern, block_size=8)
    b = sparse_attention(q, k2, v2, pattern, block_size=8)
    np.testing.assert_allclose(a[:, : t + 1], b[:, : t + 1], atol=1e-6)


@pytest.mark.parametrize("causal", [False, True])
def test_full_pattern_is_dense_attention(causal, rng):
    q, k, v = _qkv(rng, 2, 45, 4, 8)
    pattern = P.Full().causal() if causal else P.Full()
    mask = make_causal_mask(45) if causal else None
    dense = dot_product_attention(q, k, v, mask)
    np.testing.assert_allclose(sparse_attention(q, k, v, pattern, block_size=16), dense, atol=2e-6)
    # A union that happens to cover everything is dense too.
    cover = P.Local(3) | P.BlockLocal(16, 2)
    if causal:
        cover = cover.causal()
    assert cover.mask(45)[np.tril(np.ones((45, 45), bool)) if causal else slice(None)].all()
    np.testing.assert_allclose(sparse_attention(q, k, v, cover, block_size=16), dense, atol=2e-6)


def test_blocked_has_no_quadratic_array():
    """The local kernel's jaxpr holds nothing of size n*n (n = 1024, block 32)."""
    n, block = 1024, 32
    q = jnp.zeros((1, n, 1, 8))
    jaxpr = jax.make_jaxpr(
        lambda q, k, v: sparse_attention(q, k, v, P.Local(16), block_size=block)
    )(q, q, q)
    sizes = [int(np.prod(v.aval.shape)) for eqn in jaxpr.eqns for v in eqn.outvars]
    assert max(sizes) < n * n // 8, max(sizes)


def test_random_pattern_reproducible_from_config():
    a = P.RandomBlocks(8, 2, seed=5)
    assert (a.mask(64) == P.RandomBlocks(8, 2, seed=5).mask(64)).all()
    assert not (a.mask(64) == P.RandomBlocks(8, 2, seed=6).mask(64)).all()
    # per layer: different draws, each reproducible
    assert not (a.for_layer(1).mask(64) == a.mask(64)).all()
    assert (a.for_layer(1).mask(64) == P.RandomBlocks(8, 2, seed=5, layer=1).mask(64)).all()
    # a causal table for a longer sequence extends the shorter one (decoding == full pass)
    c = a.causal()
    assert (c.mask(96)[:64, :64] == c.mask(64)).all()
    # from the config spec
    one = spec.layer_patterns("bigbird:block=8", 2, 4, block_size=64, seed=7, causal=False)
    two = spec.layer_patterns("bigbird:block=8", 2, 4, block_size=64, seed=7, causal=False)
    assert (one[0].mask(80) == two[0].mask(80)).all()


def test_receptive_field_claims():
    n = 64
    band = P.Local(2)
    cov = analysis.coverage(band, n, 8)
    assert (np.diff(cov) > 0).all()  # grows with every layer
    field = analysis.receptive_field(band, n, 3)
    assert field[2, 32].sum() == 2 * 3 * 2 + 1  # reach L*w each side
    assert analysis.layers_to_cover(P.Dilated(4, 4), n, 32) is None  # never covers all
    assert analysis.coverage(P.Dilated(4, 4), n, 32)[-1] <= 0.25 + 1e-9
    assert analysis.layers_to_cover(P.etc(2, 1), n) == 2  # via the global token
    assert analysis.layers_to_cover(P.bigbird(8, 3, 1, 1), n) <= 2
    assert analysis.layers_to_cover(band, n) == 32  # output 63 reads input 0: 63 / 2 per layer


def _cells(png_path, fig, rows: int, cols: int) -> np.ndarray:
    """The saved PNG's pixel at the centre of each cell of the figure's image axes,
    ``[rows, cols, channels]`` (display y runs up, PNG rows run down)."""
    import matplotlib.image

    pixels = matplotlib.image.imread(png_path)
    box = fig.axes[0].get_window_extent()
    height = pixels.shape[0]
    ys = box.y1 - (np.arange(rows) + 0.5) * box.height / rows
    xs = box.x0 + (np.arange(cols) + 0.5) * box.width / cols
    return pixels[(height - ys).astype(int)[:, None], xs.astype(int)[None, :]]


def test_pictures_draw_the_pattern(tmp_path):
    """The PNGs have the figure's size, and each cell of the drawn matrix is dark exactly
    where the pattern attends (and the receptive-field rows where inputs reach)."""
    pattern, n = P.bigbird(8, 3, 1, 2), 64
    fig = analysis.pattern_figure(pattern, n)
    path = analysis.plot_pattern(pattern, n, tmp_path / "bigbird.png")
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    fig.savefig(tmp_path / "same.png")
    import matplotlib.image

    pixels = matplotlib.image.imread(path)
    assert pixels.shape[:2] == (400, 400)  # 4 x 4 inches at 100 dpi
    np.testing.assert_array_equal(pixels, matplotlib.image.imread(tmp_path / "same.png"))
    brightness = _cells(path, fig, n, n)[..., :3].mean(-1)
    np.testing.assert_array_equal(brightness < 0.5, pattern.mask(n))
    layers = 6
    rf = analysis.receptive_field_figure(P.Local(2), n, layers)
    path = analysis.plot_receptive_field(P.Local(2), n, layers, tmp_path / "rf.png")
    assert matplotlib.image.imread(path).shape[:2] == (int(100 * (0.35 * layers + 1.2)), 600)
    want = analysis.receptive_field(P.Local(2), n, layers)[:, n // 2, :]
    blue = _cells(path, rf, layers, n)
    reached = blue[..., 2] - blue[..., 0] > 0.3  # Blues: reached cells are blue, others white
    np.testing.assert_array_equal(reached, want)


def test_topk_matches_dense_topk(rng):
    q, k, v = _qkv(rng, 1, 50, 2, 8)
    for causal in (False, True):
        out = topk_attention(q, k, v, 6, causal=causal, query_block=16)
        np.testing.assert_allclose(
            out, oracles.topk_attention(q, k, v, 6, causal=causal), atol=2e-6
        )
    # k >= n is dense attention
    np.testing.assert_allclose(
        topk_attention(q, k, v, 64, query_block=16), dot_product_attention(q, k, v), atol=2e-6
    )


# -- the model --------------------------------------------------------------------------


def _model_config(**kw):
    base = dict(
        vocab_size=50, d_model=32, num_heads=4, d_ff=64, num_encoder_layers=2,
        num_decoder_layers=2, max_len=64, embedding_dropout=0.0, residual_dropout=0.0,
    )  # fmt: skip
    return ModelConfig(**{**base, **kw})


@pytest.mark.slow
def test_transformer_with_full_pattern_equals_dense(rng):
    c = _model_config()
    inp = jnp.asarray(rng.integers(3, 50, (2, 21))).at[1, 15:].set(0)
    tgt = jnp.asarray(rng.integers(3, 50, (2, 19))).at[1, 12:].set(0)
    params = unbox(Transformer(c).init(jax.random.key(0), inp, tgt))
    dense = Transformer(c).apply(params, inp, tgt)
    # topk with k >= the length keeps every key: dense attention too
    for pattern_spec in ("full;full", "topk:k=32", "local:window=2|full", "topk:k=2"):
        sc = c.replace(attention_pattern=pattern_spec, attention_block_size=8)
        out = Transformer(sc).apply(params, inp, tgt)
        if pattern_spec in ("local:window=2|full", "topk:k=2"):
            assert np.abs(out - dense).max() > 1e-3  # a real restriction changes the output
        else:
            np.testing.assert_allclose(out, dense, atol=1e-5)


@pytest.mark.parametrize(
    "spec",
    [
        "local:window=5",
        "local:window=3;local:window=7",
        pytest.param("bigbird:block=4,window=3,global=1,random=2", marks=pytest.mark.slow),
        "sparse_strided:stride=4",
        pytest.param("dilated:window=2,dilation=3+global:first=2", marks=pytest.mark.slow),
    ],
)
def test_lm_cached_decoding_matches_full_forward(spec, rng):
    c = _model_config(attention_pattern=spec, attention_block_size=4)
    lm = LanguageModel(c)
    toks = jnp.asarray(rng.integers(3, 50, (2, 17)))
    params = unbox(lm.init(jax.random.key(1), toks))
    full = lm.apply(params, toks)
    ref = LanguageModel(c.replace(attention_impl="reference")).apply(params, toks)
    np.testing.assert_allclose(full, ref, atol=1e-5)
    inputs = shift_right(toks, c.bos_id)
    cache = unbox(lm.init(jax.random.key(1), jnp.zeros((2, 17), jnp.int32), decode=True))["cache"]
    step = jax.jit(
        lambda cache, tok: lm.apply({**params, "cache": cache}, tok, decode=True, mutable=["cache"])
    )
    steps = []
    for t in range(17):
        logits, mut = step(cache, inputs[:, t : t + 1])
        cache = mut["cache"]
        steps.append(logits)
    np.testing.assert_allclose(jnp.concatenate(steps, 1), full, atol=1e-5)
    key_cache = cache["decoder"]["layer_0"]["self_attention"]["cached_key"]
    if spec.startswith("local"):  # sliding window ring buffer [b, slots, h, d]: O(window)
        assert (
            key_cache.shape[1] == max(int(w) for w in spec.replace(";", "=").split("=")[1::2]) + 1
        )
    else:  # the full cache, head-major [b, h, t, d]
        assert key_cache.shape[2] == 17


@pytest.mark.parametrize(
    "field,value,needle",
    [
        ("attention_pattern", "locl", "unknown sparse pattern 'locl'"),
        ("attention_pattern", "local:width=3", "bad argument 'width=3'"),
        ("attention_pattern", "local:window=x", "is not an integer"),
        ("attention_pattern", "local:window=0", "window=0 must be a positive integer"),
        ("attention_pattern", "local;local;local", "3 head groups"),
        ("attention_pattern", "bigbird:window=2", "must be odd"),
        ("attention_impl", "flash", "attention_impl"),
        ("attention_block_size", 0, "attention_block_size=0"),
        ("attention_scan_blocks", -1, "attention_scan_blocks=-1 must be >= 0"),
    ],
)
def test_bad_sparse_config(field, value, needle):
    with pytest.raises(ConfigError, match=needle):
        _model_config(**{field: value})


def test_topk_in_the_model_is_the_kernel_and_sows_its_weights(rng):
    """A model's topk layer computes the top-k kernel; its sown weights are the
    dense top-k weights, which give the same output; cached decoding says no."""
    c = _model_config(attention_pattern="topk:k=3;local:window=2", attention_block_size=8)
    q, k, v = (jnp.asarray(rng.standard_normal((2, 12, 4, 8)), jnp.float32) for _ in range(3))
    patterns = spec.layer_patterns(c.attention_pattern, 0, 4, block_size=8, seed=0, causal=True)
    out = sparse.multihead_sparse_attention(q, k, v, patterns, block_size=8)
    np.testing.assert_allclose(
        out[:, :, :2], topk_attention(q[:, :, :2], k[:, :, :2], v[:, :, :2], 3, causal=True),
        atol=1e-6,
    )  # fmt: skip
    weights = sparse.dense_attention_weights(q, k, patterns)
    assert int((weights[:, :2] > 0).sum(-1).max()) == 3  # three keys per query
    np.testing.assert_allclose(jnp.einsum("bhqk,bkhd->bqhd", weights, v), out, rtol=1e-5, atol=1e-5)
    with pytest.raises(spec.PatternSpecError, match="cached decoding"):
        sparse.decode_mask(patterns, 4, jnp.arange(1), jnp.arange(12), 12)
    with pytest.raises(ConfigError, match="topk cannot be combined"):
        _model_config(attention_pattern="topk:k=3+local:window=2")


def test_sparse_rejects_unsupported_combinations():
    with pytest.raises(ConfigError, match="score_fn='additive'"):
        _model_config(attention_pattern="local", score_fn="additive")
    with pytest.raises(ConfigError, match="attention_dropout"):
        _model_config(attention_pattern="local", attention_dropout=0.1)
