"""The fused block-sparse kernel (sparse/ops/block_sparse/pallas_triton.py) and its tile plans
(sparse/grammar/tiles.py): every registered pattern's plan holds exactly its pairs; the kernel's
values and three gradients against float64 masked dense attention through Pallas'
interpreter on CPU (a few patterns here, the whole catalogue in the slow tier), packed
rows, lengths that are no multiple of the tiles, a dropped tile caught, and the
lowering to Triton for an H100; on a GPU (marked gpu), compiled by Triton in bfloat16."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from flaxformer_lite.sparse.grammar import dynamic as D
from flaxformer_lite.sparse.grammar import patterns as P
from flaxformer_lite.sparse.grammar.spec import parse_spec, pattern_names
from flaxformer_lite.sparse.grammar.tiles import tile_plan
from flaxformer_lite.sparse.ops.block_sparse.pallas_triton import block_sparse_attention
from flaxformer_lite.sparse.ops.block_sparse.regroup import pattern_parts
from tests.fixtures import triton_lowering
from tests.oracles import dense_with_mask, random_qkvw, relative_error

# One small instance of every registered name (block 8, so that n = 40-100 holds
# several of each pattern's blocks), and the two ways of combining them.
SPECS = {
    "full": "full",
    "local": "local:window=5",
    "dilated": "dilated:window=3,dilation=3",
    "strided": "strided:stride=7",
    "sparse_strided": "sparse_strided:stride=6",
    "fixed": "fixed:stride=8,summary=2",
    "fixed_wide": "fixed:stride=32,summary=3",
    "global": "global:positions=0/17/-1",
    "random": "random:blocks=2",
    "block_local": "block_local:radius=1",
    "bigbird": "bigbird:window=3,global=1,random=1",
    "longformer": "longformer:window=4,global=2",
    "etc": "etc:window=4,global=3",
    "union": "local:window=3+strided:stride=11",
    "intersection": "local:window=9&dilated:window=5,dilation=2",
}


def _pattern(name: str, causal: bool) -> P.Pattern:
    p = parse_spec(SPECS[name], block_size=8, seed=3)[0][0]
    return p.causal() if causal else p


def test_every_static_pattern_has_a_spec_here():
    """Every registered pattern with a fixed rule is tested below (the dynamic ones,
    whose keys depend on the content, run on their own kernels: tests/test_routed.py)."""
    dynamic = {"topk", "moba", "nsa"}
    assert all(isinstance(parse_spec(name)[0][0], D.Dynamic) for name in dynamic)
    assert set(pattern_names()) - dynamic <= set(SPECS), "a new pattern needs a SPECS entry"


@pytest.mark.parametrize("name", sorted(SPECS))
def test_plan_holds_exactly_the_patterns_pairs(name):
    """The tiles' masks put together are the pattern's [n, n] mask (no pair lost, none
    added); every listed tile holds an allowed pair; the per-key-tile lists are the
    transpose of the per-query-tile lists, with the same masks."""
    for causal in (False, True):
        p = _pattern(name, causal)
        # (200, 16, 32): tiles at one offset share one evaluation (tiles._tile_keys)
        for n, bq, bk in [(50, 16, 16), (37, 8, 16), (64, 16, 8), (50, 8, 8), (200, 16, 32)]:
            plan = tile_plan(p, n, bq, bk)
            np.testing.assert_array_equal(plan.dense(), p.mask(n), err_msg=f"{p}, n={n}")
            assert plan.pairs == p.mask(n).sum()
            grid = plan.tile_mask()
            padded = np.zeros((plan.m, plan.m), bool)
            padded[:n, :n] = p.mask(n)
            some = padded.reshape(plan.m // bq, bq, plan.m // bk, bk).any(axis=(1, 3))
            np.testing.assert_array_equal(grid >= 0, some)
            by_key = np.full_like(grid, -1)
            for b, count in enumerate(plan.q_count):
                by_key[plan.q_tiles[b, :count], b] = plan.q_masks[b, :count]
            np.testing.assert_array_equal(by_key, grid)
            assert (plan.masks[0] == 1).all()


@pytest.mark.parametrize(
    "name", ["strided", "sparse_strided", "dilated", "union", "fixed", "fixed_wide"]
)
def test_regrouped_parts_hold_exactly_the_patterns_pairs(name):
    """A stride's pairs regrouped by residue plus the rest in the original order: no pair
    in two parts, none lost, none added; and the regrouping pays (fewer tiles)."""
    for causal in (False, True):
        p = _pattern(name, causal)
        for n, bq, bk in [(50, 16, 16), (37, 8, 16), (200, 16, 32)]:
            parts = pattern_parts(p, n, bq, bk, regroup=True)
            assert any(part.slots is not None for part in parts)
            held = np.zeros((n, n), int)
            for part in parts:
                dense = part.plan.dense()
                if part.slots is None:
                    held += dense
                    continue
                rows, cols = np.nonzero(dense)
                assert (part.slots[rows] >= 0).all() and (part.slots[cols] >= 0).all()
                np.add.at(held, (part.slots[rows], part.slots[cols]), 1)
            assert held.max() <= 1, f"{p}: a pair in two parts"
            np.testing.assert_array_equal(held > 0, p.mask(n), err_msg=f"{p}, n={n}")
    strided = P.sparse_transformer_strided(128).causal()
    visited = sum(part.plan.tiles for part in pattern_parts(strided, 16384, 64, 64))
    assert visited < tile_plan(strided, 16384, 64, 64).tiles / 10
    short = pattern_parts(strided, 256, 64, 64)  # runs of 2 positions: not regrouped
    assert len(short) == 1 and short[0].slots is None


def test_plan_keeps_few_masks_and_few_tiles_at_length():
    """At 16k tokens a window's plan has a handful of distinct masks and visits about
    (window / tile + 2) key tiles per query tile, not all of them."""
    plan = tile_plan(P.longformer(256, (0,)), 16384, 128, 128)
    assert len(plan.masks) <= 8
    tiles = 16384 // 128
    assert plan.tiles <= tiles * 6 + 2 * tiles  # the band's 5-6, plus the global row/column


def _mask(pattern, n, segments=None):
    mask = pattern.mask(n)[None, None]
    if segments is not None:
        seg = np.asarray(segments)
        mask = mask & ((seg[:, :, None] == seg[:, None, :]) & (seg[:, None, :] != 0))[:, None]
    return mask


def _errors(pattern, q, k, v, w, segments=None, **kw):
    """Relative errors of the values and dq, dk, dv against float64 (the reference's
    gradients from jax under x64, of the same masked dense formula)."""
    mask = _mask(pattern, q.shape[1], segments)

    def mine(*a):
        return block_sparse_attention(*a, pattern, segments=segments, **kw)

    f64 = [np.asarray(x, np.float64) for x in (q, k, v)]
    errors = [relative_error(mine(q, k, v), dense_with_mask(*f64, mask, np))]
    grads = jax.grad(lambda *a: jnp.sum(mine(*a).astype(jnp.float32) * w), argnums=(0, 1, 2))
    with jax.enable_x64(True):
        wide = [jnp.asarray(np.asarray(x, np.float64)) for x in (q, k, v, w)]
        reference = lambda *a: jnp.sum(dense_with_mask(*a, mask, jnp) * wide[3])  # noqa: E731
        want = jax.grad(reference, argnums=(0, 1, 2))(*wide[:3])
    errors += [relative_error(g, r) for g, r in zip(grads(q, k, v), want, strict=True)]
    if segments is not None:  # padding queries give exactly 0
        out = np.asarray(mine(q, k, v), np.float32)
        assert not np.any(out[np.asarray(segments) == 0])
    return errors


# On CPU the kernel runs in float32 through the interpreter: the only differences from
# float64 are float32 rounding (observed 2e-7 to 9e-7 of the largest value, as for the
# band kernel); the bound is 1e-5, 80 float32 epsilons, for another machine's order.
TOL = 1e-5


@pytest.mark.parametrize(
    "name,causal",
    [("bigbird", False), ("sparse_strided", True), ("global", False)],
)
def test_kernel_matches_float64(name, causal):
    # n = 50 is no multiple of the tiles (padded keys must stay masked); unequal tiles.
    q, k, v, w = random_qkvw(jnp.float32, 1, 50, 2, 16)
    # regroup=True: the strided pattern as two parts (window, stride regrouped)
    errors = _errors(_pattern(name, causal), q, k, v, w, block_q=16, block_k=32, regroup=True)
    assert max(errors) < TOL, errors


@pytest.mark.slow
@pytest.mark.parametrize("causal", [False, True], ids=["both ways", "causal"])
@pytest.mark.parametrize("name", sorted(SPECS))
def test_kernel_matches_float64_every_pattern(name, causal):
    q, k, v, w = random_qkvw(jnp.float32, 2, 72, 2, 16, seed=1)
    for bq, bk, regroup in ((16, 16, False), (32, 16, False), (16, 16, True)):
        errors = _errors(
            _pattern(name, causal), q, k, v, w, block_q=bq, block_k=bk, regroup=regroup
        )
        assert max(errors) < TOL, (bq, bk, regroup, errors)


def test_packed_rows_and_padding():
    """Two examples per row, then padding (id 0), a causal Longformer, head size 24
    (padded to 32 inside): no query sees another example or padding."""
    q, k, v, w = random_qkvw(jnp.float32, 2, 48, 2, 24, seed=2)
    seg = np.zeros((2, 48), np.int32)
    seg[0, :20], seg[0, 20:40] = 1, 2
    seg[1, :30], seg[1, 30:44] = 1, 2
    errors = _errors(
        _pattern("longformer", True), q, k, v, w, segments=jnp.asarray(seg), block_q=16,
        block_k=16,
    )  # fmt: skip
    assert max(errors) < TOL, errors


def test_packed_rows_regrouped():
    """Segment ids follow the positions into the regrouped order: the Sparse
    Transformer's strided pattern (two parts) on packed rows with padding."""
    q, k, v, w = random_qkvw(jnp.float32, 1, 64, 2, 16, seed=5)
    seg = np.zeros((1, 64), np.int32)
    seg[0, :25], seg[0, 25:60] = 1, 2
    errors = _errors(
        _pattern("sparse_strided", True), q, k, v, w, segments=jnp.asarray(seg), block_q=16,
        block_k=16, regroup=True,
    )  # fmt: skip
    assert max(errors) < TOL, errors


def test_a_dropped_tile_is_caught():
    """The checks above have teeth: the kernel run on a plan with one listed tile
    removed from one query tile's list is far from the reference."""
    pattern = _pattern("bigbird", False)
    q, k, v, _ = random_qkvw(jnp.float32, 1, 48, 1, 16, seed=4)
    plan = tile_plan(pattern, 48, 16, 16)
    count = plan.kv_count.copy()
    count[1] -= 1  # query tile 1 loses its last key tile
    broken = dataclasses.replace(plan, kv_count=count)
    ref = dense_with_mask(*(np.asarray(x, np.float64) for x in (q, k, v)), _mask(pattern, 48), np)
    good = block_sparse_attention(q, k, v, pattern, block_q=16, block_k=16)
    bad = block_sparse_attention(q, k, v, pattern, block_q=16, block_k=16, plan=broken)
    assert relative_error(good, ref) < TOL
    assert relative_error(bad, ref) > 100 * TOL


def test_bad_arguments_are_named():
    q = jnp.zeros((1, 32, 1, 16))
    with pytest.raises(ValueError, match="block_k=24"):
        block_sparse_attention(q, q, q, P.Local(4), block_k=24)
    with pytest.raises(ValueError, match="plan is for n=64"):
        plan = tile_plan(P.Local(4), 64, 16, 16)
        block_sparse_attention(q, q, q, P.Local(4), block_q=16, block_k=16, plan=plan)
    with pytest.raises(ValueError, match="top-k"):
        block_sparse_attention(q, q, q, D.TopK(4))


def test_kernels_lower_to_triton():
    """The three kernels lower to Triton's IR here, without a GPU (jax.export for the
    cuda platform runs the lowering a GPU's jit does), so a construct Triton cannot
    express (the tables' scalar loads, the masks' int8 tiles) fails on CPU."""
    seg = jnp.ones((1, 256), jnp.int32)
    pattern = P.bigbird(64, 3, 1, 1)

    def loss(q, k, v):
        plain = block_sparse_attention(q, k, v, pattern, interpret=False)
        packed = block_sparse_attention(q, k, v, pattern.causal(), segments=seg, interpret=False)
        strided = block_sparse_attention(q, k, v, P.sparse_transformer_strided(16).causal(),
                                         interpret=False, regroup=True)  # fmt: skip
        return jnp.sum(plain) + jnp.sum(packed) + jnp.sum(strided)

    x = jax.ShapeDtypeStruct((1, 256, 2, 64), jnp.bfloat16)
    text = triton_lowering(loss, x, x, x)
    for name in ("forward", "dkdv", "dq"):  # plain, packed, and strided's two parts
        assert text.count(f'name = "block_sparse_attention_{name}"') == 4


# On a GPU: compiled by Triton, bfloat16 inputs with float32 accumulation, n = 2048.
# bfloat16 rounds inputs and probabilities by up to 2^-8 relative; the bound is
# 4 * 2^-8 as for cuDNN and the band kernel.
@pytest.mark.gpu
@pytest.mark.parametrize(
    "pattern",
    [
        P.bigbird(64, 3, 2, 3),
        P.sparse_transformer_strided(45).causal(),
        P.longformer(256, (0, 1000)),
        P.Fixed(64, 4).causal(),
        P.Dilated(32, 4),
    ],
    ids=["bigbird", "strided causal", "longformer", "fixed causal", "dilated"],
)
def test_kernel_on_gpu_bfloat16(pattern):
    q, k, v, w = random_qkvw(jnp.bfloat16, 2, 2048, 4, 64)
    errors = _errors(pattern, q, k, v, w.astype(jnp.float32))
    assert max(errors) < 4 * 2.0**-8, errors


@pytest.mark.gpu
def test_kernel_on_gpu_packed_rows():
    q, k, v, w = random_qkvw(jnp.bfloat16, 2, 1024, 4, 64, seed=3)
    seg = np.zeros((2, 1024), np.int32)
    seg[:, :300], seg[:, 300:700], seg[:, 700:1000] = 1, 2, 3
    errors = _errors(P.bigbird(64, 3, 1, 2).causal(), q, k, v, w.astype(jnp.float32),
                     segments=jnp.asarray(seg))  # fmt: skip
    assert max(errors) < 4 * 2.0**-8, errors
