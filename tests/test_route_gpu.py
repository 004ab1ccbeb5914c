"""MoBA's fused routing (sparse/ops/moba/routing_triton.py): through Pallas' interpreter on CPU, the
same table as the XLA routing (top_blocks over token_candidates) in float64, causal and
not, packed and padded rows, a partial last block, several chunks of summaries, ties
to the lower index, fewer candidates than slots; MoBA on it equals MoBA on the XLA
routing; a kernel that reads one chunk too few fails; it lowers to Triton for an H100;
on a GPU (marked gpu), the blocks it picks from bfloat16 inputs score as the float64
best do."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from flaxformer_lite.sparse.ops.moba import routing_triton as route_gpu
from flaxformer_lite.sparse.ops.moba import xla as routed
from tests.fixtures import triton_lowering
from tests.oracles import random_qkvw, relative_error


def _both(q, k, top_k, block, causal, segments=None, **kw):
    """(XLA routing, fused routing) of MoBA on ``[b, n, h, d]`` queries and keys."""
    return [
        routed.moba_attention(
            q,
            k,
            k,
            top_k,
            block=block,
            causal=causal,
            segments=segments,
            routing_only=True,
            route=route,
            **kw,
        )  # fmt: skip
        for route in ("xla", "fused")
    ]


def _same(a, b):
    assert (np.asarray(a.valid) == np.asarray(b.valid)).all()
    live = np.asarray(a.valid)
    assert (np.asarray(a.table)[live] == np.asarray(b.table)[live]).all()
    assert (np.asarray(b.table)[~live] == 0).all()  # an empty slot reads block 0, masked
    return live.mean()


PACKED = np.zeros((2, 300), np.int32)
PACKED[0, :100], PACKED[0, 100:280], PACKED[1] = 1, 2, 1  # packed + padded; one sequence


@pytest.mark.parametrize(
    "n,block,top_k,causal,packed",
    [(1100, 16, 9, True, False), (300, 32, 4, True, True)]
    + [pytest.param(300, 16, 40, False, True, marks=pytest.mark.slow)],
)
def test_the_fused_table_is_the_xla_routings(n, block, top_k, causal, packed):
    """float64 (no near-ties); n = 1,100 at blocks of 16: 69 blocks, two chunks of 64
    summaries and a partial last block; top_k=40 > the blocks a packed row offers."""
    with jax.enable_x64(True):
        b = 2 if packed else 1
        q, k, _, _ = random_qkvw(jnp.float64, b, n, 2, 16, seed=n + block)
        seg = jnp.asarray(PACKED) if packed else None
        share = _same(*_both(q, k, top_k, block, causal, seg))
        assert 0.3 < share < 1  # slots chosen and slots left empty both occur


def test_ties_go_to_the_lower_block():
    """Blocks 2, 5 and 9 hold the same keys (equal summaries, exactly equal scores) that
    every query prefers: a later query takes 2 and 5, never 9, as XLA's top_k does."""
    q, k, _, _ = random_qkvw(jnp.float32, 1, 256, 1, 16, seed=2)
    q = jnp.abs(q) + 0.1
    blocks = k.reshape(1, 16, 16, 1, 16)
    for j in (2, 5, 9):
        blocks = blocks.at[:, j].set(3.0)
    xla, fused = _both(q, blocks.reshape(k.shape), 3, 16, True)
    _same(xla, fused)
    assert (np.asarray(fused.table)[0, 0, 160:] == [2, 5]).all()


def test_moba_on_the_fused_routing_equals_moba_on_xlas():
    q, k, v, _ = random_qkvw(jnp.float32, 1, 100, 1, 16, seed=3)

    def loss(route):
        return lambda q, k, v: jnp.sum(routed.moba_attention(q, k, v, 4, block=16, causal=True,
                                                             route=route) ** 2)  # fmt: skip

    (a, ga), (b, gb) = (jax.value_and_grad(loss(r), argnums=(0, 1, 2))(q, k, v)
                        for r in ("xla", "fused"))  # fmt: skip
    assert float(a) == float(b)
    for x, y in zip(ga, gb, strict=True):
        assert relative_error(x, y) == 0


def test_a_chunk_left_unread_is_caught(monkeypatch):
    """128 blocks of 16: two chunks of summaries. A kernel that stops one chunk early
    (never choosing blocks 64-127) differs from the XLA routing."""
    q, k, _, _ = random_qkvw(jnp.float32, 1, 2048, 1, 16, seed=4)
    _same(*_both(q, k, 4, 16, False))
    real = route_gpu._kernel
    monkeypatch.setattr(route_gpu, "_kernel", lambda *refs, chunks, **kw: real(
        *refs, chunks=chunks - 1, **kw))  # fmt: skip
    with pytest.raises(AssertionError):
        _same(*_both(q, k, 4, 16, False))


def test_bad_arguments_and_defaults():
    q = jnp.zeros((1, 48, 1, 16))
    with pytest.raises(ValueError, match="route='fast'"):
        routed.moba_attention(q, q, q, 2, block=16, route="fast")
    with pytest.raises(ValueError, match="block=24 must be a multiple of 16"):
        routed.moba_attention(q, q, q, 2, block=24, route="fused", routing_only=True)
    assert route_gpu.tile_size(128) == 64 and route_gpu.tile_size(48) == 16


def test_the_fused_routing_lowers_to_triton():
    seg = jnp.ones((1, 512), jnp.int32)

    def loss(q, k, v):
        r = routed.moba_attention(q, k, v, 8, block=64, causal=True, segments=seg,
                                  route="fused", interpret=False, routing_only=True)  # fmt: skip
        return jnp.sum(r.table * r.valid).astype(jnp.float32) + 0 * jnp.sum(q)

    x = jax.ShapeDtypeStruct((1, 512, 2, 64), jnp.bfloat16)
    assert triton_lowering(loss, x, x, x).count(f'name = "{route_gpu.NAME}"') == 1


# On a GPU: compiled by Triton (tf32 products), bfloat16 inputs, n = 2,048. A query's
# chosen blocks must score as the float64 best do, within the products' rounding: each
# chosen score >= the float64 (k-1)-th best - 2^-8 times the scores' scale.
@pytest.mark.gpu
@pytest.mark.parametrize("causal", [True, False])
def test_fused_routing_on_gpu(causal):
    q, k, _, _ = random_qkvw(jnp.bfloat16, 2, 2048, 4, 64, seed=6)
    r = routed.moba_attention(q, k, k, 8, block=64, causal=causal, routing_only=True,
                              route="fused")  # fmt: skip
    q64 = np.swapaxes(np.asarray(q, np.float64), 1, 2) / 8.0
    means = np.swapaxes(np.asarray(k, np.float64), 1, 2).reshape(2, 4, 32, 64, 64).mean(3)
    scores = np.einsum("bhqd,bhjd->bhqj", q64, means)
    a = np.arange(2048)[:, None] // 64
    j = np.arange(32)[None, :]
    scores = np.where((j < a) if causal else (j != a), scores, -np.inf)
    kth = -np.sort(-scores, -1)[..., 6]  # the 7th best, -inf with fewer candidates
    table, valid = np.asarray(r.table), np.asarray(r.valid)
    assert (valid.sum(-1) == np.minimum(7, np.isfinite(scores).sum(-1))).all()
    chosen = np.take_along_axis(scores, table, -1)
    slack = 2.0**-8 * np.abs(scores[np.isfinite(scores)]).max()
    assert (np.where(valid, chosen, np.inf) >= kth[..., None] - slack).all()
