"""The block-skipping band kernel (sparse/ops/band/pallas_triton.py): values and gradients against a
float64 dense reference with the band's mask, through Pallas' interpreter on CPU and
compiled by Triton on a GPU (marked gpu); and its loop bounds, which are the point of
the kernel: every block they skip holds no allowed pair, every block they visit holds one."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from flaxformer_lite.sparse.grammar import patterns as P
from flaxformer_lite.sparse.ops.band.pallas_triton import (
    _key_blocks,
    _query_blocks,
    band_attention,
    band_of,
)
from tests.fixtures import triton_lowering
from tests.oracles import dense_with_mask, random_qkvw, relative_error


def _mask(n, left, right, segments=None):
    """[b or 1, 1, n, n]: the band, and with segments the same example, not padding."""
    gap = np.arange(n)[:, None] - np.arange(n)[None]
    mask = ((gap <= left) & (gap >= -right))[None, None]
    if segments is not None:
        seg = np.asarray(segments)
        mask = mask & ((seg[:, :, None] == seg[:, None, :]) & (seg[:, None, :] != 0))[:, None]
    return mask


def _reference(q, k, v, left, right, segments=None):
    """float64 dense attention with the band (and segments) as a mask."""
    q, k, v = (np.asarray(x, np.float64) for x in (q, k, v))
    return dense_with_mask(q, k, v, _mask(q.shape[1], left, right, segments), np)


def _grads(fn, q, k, v, w):
    return jax.grad(lambda *a: jnp.sum(fn(*a).astype(jnp.float32) * w), argnums=(0, 1, 2))(q, k, v)


def _check(q, k, v, w, left, right, tol, segments=None, **blocks):
    """Values and dq, dk, dv within tol (relative, Frobenius) of float64; the reference's
    gradients come from jax under x64 of the same masked dense formula. Padding queries
    (segment 0) must give exactly 0."""
    kw = dict(left=left, right=right, segments=segments, **blocks)
    got = band_attention(q, k, v, **kw)
    assert relative_error(got, _reference(q, k, v, left, right, segments)) < tol
    if segments is not None:
        assert not np.any(np.asarray(got, np.float32)[np.asarray(segments) == 0])
    mask = _mask(q.shape[1], left, right, segments)
    mine = _grads(lambda *a: band_attention(*a, **kw), q, k, v, w)
    with jax.enable_x64(True):
        f64 = [jnp.asarray(np.asarray(x, np.float64)) for x in (q, k, v, w)]
        want = _grads(lambda *a: dense_with_mask(*a, mask, jnp), *f64[:3], f64[3])
    for g, r in zip(mine, want, strict=True):
        assert relative_error(g, r) < tol


# On CPU the kernel runs in float32 through the interpreter: the only differences from
# float64 are float32 rounding (observed 2e-7 to 5e-7 of the largest value; the bound is
# 1e-5, 80 float32 epsilons, for the accumulation order of another machine).
@pytest.mark.parametrize(
    "left,right", [(24, 24), (24, 0)], ids=["two-sided window", "causal window"]
)
def test_band_matches_float64_reference(left, right):
    # n = 100 is no multiple of the blocks (padded keys must stay masked); unequal blocks.
    q, k, v, w = random_qkvw(jnp.float32, 2, 100, 2, 16)
    _check(q, k, v, w, left, right, 1e-5, block_q=32, block_k=16)


def test_packed_rows_and_padding():
    """Two examples per row, then padding (id 0), and a head size of 24 (padded to 32
    inside): no query sees another example or padding, and padding gives zeros."""
    q, k, v, w = random_qkvw(jnp.float32, 2, 80, 2, 24, seed=2)
    seg = np.zeros((2, 80), np.int32)
    seg[0, :30], seg[0, 30:70] = 1, 2
    seg[1, :50], seg[1, 50:64] = 1, 2
    _check(q, k, v, w, 20, 20, 1e-5, segments=jnp.asarray(seg), block_q=16, block_k=32)


def test_dense_and_causal_are_bands():
    """Full patterns as bands of width n, the values against float64."""
    q, k, v, _ = random_qkvw(jnp.float32, 1, 48, 2, 16, seed=1)
    for pattern in (P.Full(), P.Full().causal()):
        left, right = band_of(pattern)
        got = band_attention(q, k, v, left=left, right=right, block_q=16, block_k=16)
        assert relative_error(got, _reference(q, k, v, min(left, 48), min(right, 48))) < 1e-5


@pytest.mark.parametrize(
    "n,bq,bk,left,right",
    [(1000, 64, 32, 100, 100), (1000, 32, 64, 256, 0), (96, 16, 16, 3, 40), (640, 128, 64, 0, 0)],
)
def test_loops_visit_exactly_the_blocks_with_allowed_pairs(n, bq, bk, left, right):
    gap = np.arange(n)[:, None] - np.arange(n)[None]
    allowed = (gap <= left) & (gap >= -right)
    m = -(-n // max(bq, bk)) * max(bq, bk)
    padded = np.zeros((m, m), bool)
    padded[:n, :n] = allowed
    tiles = padded.reshape(m // bq, bq, m // bk, bk).any(axis=(1, 3))  # [q blocks, k blocks]
    for i in range(m // bq):
        lo, hi = (int(x) for x in _key_blocks(i, bq, bk, left, right, n))
        visited = np.zeros(m // bk, bool)
        visited[lo:hi] = True
        # a query block past n (padding) visits something harmless or nothing
        if i * bq < n:
            np.testing.assert_array_equal(visited, tiles[i], err_msg=f"query block {i}")
    for j in range(m // bk):
        lo, hi = (int(x) for x in _query_blocks(j, bq, bk, left, right, n))
        visited = np.zeros(m // bq, bool)
        visited[lo:hi] = True
        if j * bk < n:
            np.testing.assert_array_equal(visited, tiles[:, j], err_msg=f"key block {j}")


def test_bad_arguments_are_named():
    q = jnp.zeros((1, 32, 1, 16))
    with pytest.raises(ValueError, match="block_q=48"):
        band_attention(q, q, q, left=4, right=4, block_q=48)
    with pytest.raises(ValueError, match="left=-1"):
        band_attention(q, q, q, left=-1, right=0)
    with pytest.raises(ValueError, match="blocked kernel"):
        band_of(P.bigbird(block_size=16, window_blocks=3, global_blocks=1, random_blocks=1))


# On a GPU: compiled by Triton, bfloat16 inputs with float32 accumulation, at a size
# where the loop bounds matter (n = 2048, window 256: 5 of 32 key blocks per query
# block). bfloat16 rounds inputs and probabilities by up to 2^-8 relative; the observed
# error of a fused kernel against float64 is ~0.5 of that, the bound 4 * 2^-8 as for
# cuDNN in test_kernels.py.
@pytest.mark.gpu
@pytest.mark.parametrize(
    "left,right", [(256, 256), (256, 0), (1 << 30, 0)], ids=["two-sided", "causal window", "causal"]
)
def test_band_on_gpu_bfloat16(left, right):
    q, k, v, w = random_qkvw(jnp.bfloat16, 2, 2048, 4, 64)
    _check(q, k, v, w.astype(jnp.float32), left, right, 4 * 2.0**-8)


def test_kernels_lower_to_triton():
    """The three kernels lower to Triton's IR here, without a GPU (jax.export for the
    cuda platform runs the same lowering a GPU's jit does), so a construct Triton cannot
    express fails on CPU, not on a lease."""
    seg = jnp.ones((1, 256), jnp.int32)

    def loss(q, k, v):
        plain = band_attention(q, k, v, left=64, right=0, interpret=False)
        packed = band_attention(q, k, v, left=64, right=64, segments=seg, interpret=False)
        return jnp.sum(plain) + jnp.sum(packed)

    x = jax.ShapeDtypeStruct((1, 256, 2, 64), jnp.bfloat16)
    text = triton_lowering(loss, x, x, x)
    for name in ("band_attention_forward", "band_attention_dkdv", "band_attention_dq"):
        assert text.count(f'name = "{name}"') == 2  # without and with segment ids


@pytest.mark.gpu
def test_band_on_gpu_packed_rows():
    """Segment ids on the GPU: three examples per row and padding, window 128."""
    q, k, v, w = random_qkvw(jnp.bfloat16, 2, 1024, 4, 64, seed=3)
    seg = np.zeros((2, 1024), np.int32)
    seg[:, :300], seg[:, 300:700], seg[:, 700:1000] = 1, 2, 3
    _check(q, k, v, w.astype(jnp.float32), 128, 128, 4 * 2.0**-8, segments=jnp.asarray(seg))
