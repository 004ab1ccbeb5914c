"""The fused routed block kernel (sparse/ops/chosen_blocks/pallas_triton_tiles.py): data-dependent
tile lists per
batch row and head, through Pallas' interpreter on CPU, against float64 dense attention
under the mask the routing chose (values and dq, dk, dv), causal and not, packed rows,
lengths no multiple of a block, both query-tile sizes; MoBA and NSA on it equal their
XLA kernels; a dropped tile is caught; the lists are each other's transpose; the
kernels lower to Triton for an H100; on a GPU (marked gpu), compiled in bfloat16."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from flaxformer_lite.model import head_groups, kernels
from flaxformer_lite.sparse.grammar import dynamic as D
from flaxformer_lite.sparse.ops.chosen_blocks import pallas_triton_gather as routed_gather_gpu
from flaxformer_lite.sparse.ops.chosen_blocks import pallas_triton_tiles as routed_gpu
from flaxformer_lite.sparse.ops.chosen_blocks.pallas_triton_gather import routed_gather_attention
from flaxformer_lite.sparse.ops.chosen_blocks.pallas_triton_tiles import (
    routed_block_attention,
    tile_lists,
)
from flaxformer_lite.sparse.ops.moba import xla as routed
from flaxformer_lite.sparse.ops.nsa import xla as nsa
from tests.fixtures import triton_lowering
from tests.oracles import dense_with_mask, random_qkvw, relative_error

# float32 through the interpreter against float64: float32 rounding only (observed
# 1e-7 to 4e-7 relative, as for the block-sparse and band kernels); bound 1e-5.
TOL = 1e-5
SEGMENTS = np.array([[1] * 30 + [2] * 35 + [0] * 5, [1] * 70])  # packed + padded; plain


def _routing(q, k, top_k, block, causal, segments=None, block_gate=False):
    return routed.moba_attention(
        q,
        k,
        k,
        top_k,
        block=block,
        causal=causal,
        segments=segments,
        block_gate=block_gate,
        routing_only=True,
    )


# The two kernels: query tiles over the union of their queries' blocks; key blocks over
# the queries that chose them (gathered rows).
KERNELS = {"tiles": routed_block_attention, "gather": routed_gather_attention}


def _errors(q, k, v, w, routing, block, causal, segments=None, block_q=None, kernel="tiles"):
    """Relative errors of the kernel's output and three gradients against float64."""
    n = q.shape[1]
    mask = np.asarray(routed.routed_mask(routing, block, n, causal, segments))
    args64 = [np.asarray(x, np.float64) for x in (q, k, v)]

    def ref(q, k, v):
        return jnp.sum(dense_with_mask(q, k, v, mask, jnp) * w.astype(jnp.float64))

    def mine(q, k, v):
        kw = {} if block_q is None else {"block_q": block_q}
        out = KERNELS[kernel](q, k, v, routing.table, routing.valid, block=block,
                              causal=causal, segments=segments, **kw)  # fmt: skip
        return jnp.sum(out.astype(jnp.float32) * w), out

    with jax.enable_x64(True):
        want = jax.value_and_grad(ref, argnums=(0, 1, 2))(*(jnp.asarray(x) for x in args64))
        out64 = dense_with_mask(*args64, mask, np)
    (_, out), grads = jax.value_and_grad(mine, argnums=(0, 1, 2), has_aux=True)(q, k, v)
    return [relative_error(out, out64)] + [
        relative_error(a, b) for a, b in zip(grads, want[1], strict=True)
    ]


@pytest.mark.parametrize(
    "kernel,causal,packed,block_q",
    [("gather", True, True, 16), ("tiles", True, True, 32)]
    + [pytest.param(*c, marks=pytest.mark.slow) for c in (
        ("gather", False, False, 32), ("gather", True, False, 16), ("gather", False, True, 32),
        ("tiles", False, False, 16), ("tiles", True, False, 16), ("tiles", False, True, 16))],
)  # fmt: skip
def test_kernel_matches_float64_under_the_routings_mask(kernel, causal, packed, block_q):
    # n = 70: the last block of 32 is partial (its padded keys must stay masked)
    q, k, v, w = random_qkvw(jnp.float32, 2, 70, 2, 16, seed=1)
    seg = jnp.asarray(SEGMENTS) if packed else None
    routing = _routing(q, k, 3, 32, causal, seg)
    errors = _errors(q, k, v, w, routing, 32, causal, seg, block_q, kernel)
    assert max(errors) < TOL, errors


@pytest.mark.slow  # ~5 s in the interpreter
def test_a_block_gate_and_the_limits():
    """One choice per query block (a tile visits exactly k blocks), and k = 1 (own block
    only: block-local attention)."""
    q, k, v, w = random_qkvw(jnp.float32, 1, 64, 2, 16, seed=2)
    for top_k, gate in ((3, True), (1, False)):
        routing = _routing(q, k, top_k, 16, False, block_gate=gate)
        for kernel in KERNELS:
            assert max(_errors(q, k, v, w, routing, 16, False, kernel=kernel)) < TOL


def test_the_lists_are_the_routings_tiles_and_each_others_transpose():
    q, k, _, _ = random_qkvw(jnp.float32, 1, 128, 2, 16, seed=3)
    routing = _routing(q, k, 3, 16, True)
    chosen = jnp.where(routing.valid, routing.table, -1).reshape(2, 128, -1)
    (fc, ft), (bc, bt) = (
        (np.asarray(x) for x in tile_lists(chosen, 16, 16)[0]),
        (np.asarray(x) for x in tile_lists(chosen, 16, 16)[1]),
    )
    mask = np.asarray(routed.routed_mask(routing, 16, 128, True))[0]  # [h, n, n]
    for r in range(2):
        visited = {(t, int(j)) for t in range(8) for j in ft[r, t, : fc[r, t]]}
        needed = {(t, j) for t in range(8) for j in range(8)
                  if mask[r, t * 16 : t * 16 + 16, j * 16 : j * 16 + 16].any()}  # fmt: skip
        assert visited == needed  # every tile with a chosen pair, no other
        assert visited == {(int(t), j) for j in range(8) for t in bt[r, j, : bc[r, j]]}


@pytest.mark.slow  # ~4 s
def test_a_dropped_tile_is_caught(monkeypatch):
    q, k, v, w = random_qkvw(jnp.float32, 1, 64, 1, 16, seed=4)
    routing = _routing(q, k, 3, 16, False)
    assert max(_errors(q, k, v, w, routing, 16, False)) < TOL
    real = routed_gpu.tile_lists

    def drop_one(*args):
        (count, tiles), backward = real(*args)
        return (count.at[0, 2].add(-1), tiles), backward  # query tile 2 loses a key block

    def shift_one(*args):
        order, offsets = real_entries(*args)
        return order, offsets.at[0, 2].add(1)  # block 2's first entry read with block 1

    real_entries = routed_gather_gpu.entries
    monkeypatch.setattr(routed_gpu, "tile_lists", drop_one)
    monkeypatch.setattr(routed_gather_gpu, "entries", shift_one)
    want = dense_with_mask(q, k, v, routed.routed_mask(routing, 16, 64, False), jnp)
    for kernel in KERNELS.values():
        got = kernel(q, k, v, routing.table, routing.valid, block=16, causal=False)
        assert relative_error(got, want) > 100 * TOL


@pytest.mark.slow  # ~9 s in the interpreter (the band kernel too)
def test_moba_and_nsa_on_it_equal_their_xla_kernels(monkeypatch):
    """The model's dispatch under attention_impl=cudnn (the interpreter here) against
    the XLA kernels of attention_impl=blocked, values and gradients."""
    monkeypatch.setattr(kernels, "platform_mode", lambda impl: "xla")
    q, k, v, w = random_qkvw(jnp.float32, 2, 70, 4, 16, seed=5)
    seg = jnp.asarray(SEGMENTS)
    patterns = [D.MoBA(16, 3).causal(), D.NSA(16, 2, 20).causal()]
    params = {1: {**nsa.init_params(2, 16, 16)}}
    params[1]["gate_w"] = 0.3 * jax.random.normal(jax.random.key(0), (2, 16, 3))

    def run(impl):
        def loss(q, k, v):
            out = head_groups.multihead_sparse_attention(
                q, k, v, patterns, impl=impl, segments=seg, nsa_params=params
            )
            return jnp.sum(out * w)

        return jax.value_and_grad(loss, argnums=(0, 1, 2))(q, k, v)

    (a, ga), (b, gb) = run("cudnn"), run("blocked")
    assert abs(float(a - b)) < TOL * abs(float(b))
    for x, y in zip(ga, gb, strict=True):
        assert relative_error(x, y) < TOL


@pytest.mark.parametrize("limit", [routed_gather_gpu.KEY_LIMIT, 0])  # one key; argsort
def test_the_entries_are_the_stable_order_by_block(monkeypatch, limit):
    monkeypatch.setattr(routed_gather_gpu, "KEY_LIMIT", limit)
    blocks = np.random.default_rng(0).integers(-1, 9, size=(3, 50, 4)).astype(np.int32)
    order, offsets = routed_gather_gpu.entries(jnp.asarray(blocks), 9)
    flat = np.where(blocks >= 0, blocks, 9).reshape(3, -1)
    assert (np.asarray(order) == np.argsort(flat, axis=-1, kind="stable")).all()
    below = (flat[:, :, None] < np.arange(10)[None, None]).sum(1)  # entries before block j
    assert (np.asarray(offsets) == below).all()


def test_bad_arguments_are_named():
    q = jnp.zeros((1, 32, 1, 16))
    table = jnp.zeros((1, 1, 32, 1), jnp.int32)
    with pytest.raises(ValueError, match="block_q=32 must divide block=16"):
        routed_block_attention(q, q, q, table, table > 0, block=16, causal=False, block_q=32)
    with pytest.raises(ValueError, match=r"not \[b, h, 64, R\]"):
        routed_block_attention(q, q, q, table, table > 0, block=64, causal=False, block_q=16)


def test_kernels_lower_to_triton():
    """The tile kernel's three and the gather kernel's two, with and without segment
    ids, lower to Triton's IR without a GPU (the per-row tables, the [tile, R] choices,
    the gathered rows and the masked scatter included)."""
    seg = jnp.ones((1, 256), jnp.int32)

    def loss(q, k, v):
        r = _routing(q.astype(jnp.float32), k.astype(jnp.float32), 3, 64, True)
        a = routed_block_attention(q, k, v, r.table, r.valid, block=64, causal=True,
                                   interpret=False)  # fmt: skip
        b = routed_block_attention(q, k, v, r.table, r.valid, block=64, causal=False,
                                   segments=seg, block_q=64, interpret=False)  # fmt: skip
        c = routed_gather_attention(q, k, v, r.table, r.valid, block=64, causal=True,
                                    segments=seg, interpret=False)  # fmt: skip
        return jnp.sum(a) + jnp.sum(b) + jnp.sum(c)

    x = jax.ShapeDtypeStruct((1, 256, 2, 64), jnp.bfloat16)
    text = triton_lowering(loss, x, x, x)
    for name in ("forward", "dkdv", "dq"):
        assert text.count(f'name = "routed_block_attention_{name}"') == 2
    for name in ("forward", "backward"):
        assert text.count(f'name = "routed_gather_attention_{name}"') == 1


# On a GPU: compiled by Triton, bfloat16 inputs with float32 accumulation, n = 2048;
# bound 4 * 2^-8 as for cuDNN and the other kernels.
@pytest.mark.gpu
@pytest.mark.parametrize("kernel", sorted(KERNELS))
@pytest.mark.parametrize("causal,packed", [(True, False), (False, True)])
def test_kernel_on_gpu_bfloat16(causal, packed, kernel):
    q, k, v, w = random_qkvw(jnp.bfloat16, 2, 2048, 4, 64, seed=6)
    seg = None
    if packed:
        s = np.zeros((2, 2048), np.int32)
        s[:, :700], s[:, 700:1900] = 1, 2
        seg = jnp.asarray(s)
    routing = _routing(q.astype(jnp.float32), k.astype(jnp.float32), 4, 64, causal, seg)
    errors = _errors(q, k, v, w.astype(jnp.float32), routing, 64, causal, seg, kernel=kernel)
    assert max(errors) < 4 * 2.0**-8, errors
