"""NSA's fused compressed branch (sparse/ops/nsa/compressed_triton.py) and its selection on the
fused
routing: through Pallas' interpreter on CPU, against the XLA branch in float64 (values
and the gradients of the queries and the compressed keys and values), causal and not,
packed and padded rows, several query tiles and chunks of compressed blocks; the
selection is the XLA one (a block partly of another segment ranked last); a kernel that
sees a block one token early, or stops a chunk short, fails; the kernels lower to
Triton for an H100; on a GPU (marked gpu), compiled in bfloat16."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from flaxformer_lite.sparse.ops.moba import routing_triton as route_gpu
from flaxformer_lite.sparse.ops.moba.xla import _present
from flaxformer_lite.sparse.ops.nsa import compressed_triton as compressed_gpu
from flaxformer_lite.sparse.ops.nsa import xla as nsa
from tests.fixtures import triton_lowering
from tests.oracles import relative_error

# float32 through the interpreter against float64: float32 rounding only, as for the
# band and routed kernels (observed below 1e-6 relative); bound 1e-5.
TOL = 1e-5
BLOCK, N = 16, 304  # 19 blocks: two chunks of 16 compressed blocks, a partial last one
SEGMENTS = np.zeros((2, N), np.int32)
SEGMENTS[0, :100], SEGMENTS[0, 100:290], SEGMENTS[1] = 1, 2, 1  # packed + padded; one


def _inputs(dtype, packed, seed=0, b=2, h=1, d=16):
    keys = jax.random.split(jax.random.key(seed), 4)
    q = jax.random.normal(keys[0], (b, h, N, d), jnp.float32).astype(dtype)
    kc, vc = (jax.random.normal(x, (b, h, N // BLOCK, d)).astype(dtype) for x in keys[1:3])
    w = jax.random.normal(keys[3], (b, h, N, d), jnp.float32)
    seg = jnp.asarray(SEGMENTS) if packed else None
    return q, kc, vc, w, _present(N, N, seg, b), seg


def _xla(q, kc, vc, present, seg, causal, others=0):
    """The XLA branch (sparse/ops/nsa/xla.py) on scaled queries: (output, routing)."""
    return nsa._compressed(q * 0.25, kc, vc, present, seg, BLOCK, causal, others)


def _errors(causal, packed, grads=True):
    """Relative errors of the kernel's output (and the gradients of q, kc, vc) against
    the XLA branch in float64."""
    q, kc, vc, w, present, seg = _inputs(jnp.float32, packed)

    def mine(q, kc, vc):
        out = compressed_gpu.compressed_attention(q, kc, vc, present, seg, BLOCK, causal,
                                                  scale=0.25, block_q=32, block_k=16)  # fmt: skip
        return jnp.sum(out * w), out

    with jax.enable_x64(True):
        x64 = [jnp.asarray(np.asarray(x), jnp.float64) for x in (q, kc, vc, w)]

        def ref(q, kc, vc):
            out = _xla(q, kc, vc, present, seg, causal)[0]
            return jnp.sum(out * x64[3]), out

        if not grads:
            return [relative_error(mine(q, kc, vc)[1], ref(*x64[:3])[1])]
        (_, want), grads_want = jax.value_and_grad(ref, argnums=(0, 1, 2), has_aux=True)(*x64[:3])
    (_, got), grads = jax.value_and_grad(mine, argnums=(0, 1, 2), has_aux=True)(q, kc, vc)
    return [relative_error(got, want)] + [
        relative_error(a, b) for a, b in zip(grads, grads_want, strict=True)
    ]


@pytest.mark.parametrize(
    "causal,packed",
    [(True, True), pytest.param(False, True, marks=pytest.mark.slow),
     pytest.param(True, False, marks=pytest.mark.slow)],
)  # fmt: skip
def test_the_kernel_equals_the_xla_branch(causal, packed):
    errors = _errors(causal, packed)
    assert max(errors) < TOL, errors


def test_a_block_seen_early_or_a_chunk_left_unread_is_caught(monkeypatch):
    """A query that sees the block ending one token after it (a future key), or tiles
    that stop one chunk of compressed blocks short, no longer equal the XLA branch."""
    real_visible, real_seen = compressed_gpu._visible, compressed_gpu._chunks_seen

    def early(i, j, *args, **kw):
        return real_visible(i + 1, j, *args, **kw)

    monkeypatch.setattr(compressed_gpu, "_visible", early)
    assert max(_errors(True, False, grads=False)) > 100 * TOL
    monkeypatch.setattr(compressed_gpu, "_visible", real_visible)
    monkeypatch.setattr(compressed_gpu, "_chunks_seen", lambda *a: real_seen(*a) - 1)
    assert max(_errors(False, True, grads=False)) > 100 * TOL


@pytest.mark.parametrize("causal", [pytest.param(True, marks=pytest.mark.slow), False])
def test_the_fused_selection_is_the_xla_selection(causal):
    """float64 (no near-ties), packed rows: the blocks NSA's selection takes over the
    compressed keys, a block partly of another segment after all others."""
    with jax.enable_x64(True):
        q, kc, vc, _, present, seg = _inputs(jnp.float64, True, seed=1)
        want = _xla(q, kc, vc, present, seg, causal, others=5)[1]
        table, valid = route_gpu.fused_routing(q, kc, present, seg, BLOCK, 5, causal,
                                               whole_first=True)  # fmt: skip
    assert (np.asarray(valid) == np.asarray(want.valid)).all()
    live = np.asarray(valid)
    assert (np.asarray(table)[live] == np.asarray(want.table)[live]).all()
    assert 0.3 < live.mean() < 1
    if not causal:  # block 6 (96-111) spans both segments, ranked after the five whole
        # blocks every query before it has: never chosen there
        assert not (np.asarray(table)[0, :, :96][live[0, :, :96]] == 6).any()


@pytest.mark.slow  # ~25 s: every branch in the interpreter
def test_nsa_on_the_fused_branch_equals_nsa_on_xla():
    """The whole of NSA with kernel=triton (every branch in the interpreter) against
    kernel=xla: values and gradients of the inputs and the learned parts."""
    keys = jax.random.split(jax.random.key(2), 4)
    q, k, v, w = (jax.random.normal(x, (1, 70, 2, 16)) for x in keys)
    params = dict(nsa.init_params(2, 16, 16))
    params["gate_w"] = 0.3 * jax.random.normal(keys[0], (2, 16, 3))

    def loss(kernel):
        def f(q, k, v, p):
            out = nsa.nsa_attention(q, k, v, p, 3, 20, block=16, causal=True, kernel=kernel)
            return jnp.sum(out * w)

        return jax.value_and_grad(f, argnums=(0, 1, 2, 3))(q, k, v, params)

    (a, ga), (b, gb) = loss("triton"), loss("xla")
    assert abs(float(a - b)) < TOL * abs(float(b))
    for x, y in zip(jax.tree.leaves(ga), jax.tree.leaves(gb), strict=True):
        assert relative_error(x, y) < TOL


def test_bad_arguments_are_named():
    x = jnp.zeros((1, 64, 1, 16))
    with pytest.raises(ValueError, match="route='fast'"):
        nsa.nsa_attention(x, x, x, nsa.init_params(1, 16, 16), 2, 8, block=16, route="fast")
    q = jnp.zeros((1, 1, 64, 16))
    with pytest.raises(ValueError, match="nsa_compressed: queries"):
        compressed_gpu.compressed_attention(q, q[:, :, :3], q[:, :, :3], q[0, 0, :, 0] > 0,
                                            None, 16, True)  # fmt: skip
    with pytest.raises(ValueError, match="block_k=24 must be a power of two"):
        compressed_gpu.compressed_attention(q, q[:, :, :4], q[:, :, :4],
                                            jnp.ones((1, 64), bool), None, 16, True,
                                            block_k=24)  # fmt: skip


def test_the_kernels_lower_to_triton():
    seg = jnp.ones((1, 512), jnp.int32)

    def loss(q, k, v):
        params = nsa.init_params(2, 64, 64)
        a = nsa.nsa_attention(q, k, v, params, 4, 64, block=64, causal=True, kernel="triton",
                              interpret=False)  # fmt: skip
        b = nsa.nsa_attention(q, k, v, params, 4, 64, block=64, segments=seg,
                              kernel="triton", interpret=False)  # fmt: skip
        return jnp.sum(a.astype(jnp.float32)) + jnp.sum(b.astype(jnp.float32))

    x = jax.ShapeDtypeStruct((1, 512, 2, 64), jnp.bfloat16)
    text = triton_lowering(loss, x, x, x)
    for name in ("forward", "dq", "dkdv"):
        assert text.count(f'name = "{compressed_gpu.NAME}_{name}"') == 2
    assert text.count(f'name = "{route_gpu.NAME}"') == 2


# On a GPU: compiled by Triton, bfloat16 inputs with float32 accumulation, n = 4,096
# (64 blocks of 64); bound 4 * 2^-8 as for cuDNN and the other kernels.
@pytest.mark.gpu
@pytest.mark.parametrize("causal", [True, False])
def test_the_kernel_on_gpu_bfloat16(causal):
    keys = jax.random.split(jax.random.key(3), 4)
    q = jax.random.normal(keys[0], (2, 4, 4096, 64)).astype(jnp.bfloat16)
    kc, vc = (jax.random.normal(x, (2, 4, 64, 64)).astype(jnp.bfloat16) for x in keys[1:3])
    w = jax.random.normal(keys[3], (2, 4, 4096, 64))
    present = jnp.ones((2, 4096), bool)

    def mine(q, kc, vc):
        out = compressed_gpu.compressed_attention(q, kc, vc, present, None, 64, causal,
                                                  scale=0.125)  # fmt: skip
        return jnp.sum(out.astype(jnp.float32) * w)

    def ref(q, kc, vc):
        return jnp.sum(nsa._compressed(q * 0.125, kc, vc, present, None, 64, causal, 0)[0] * w)

    got = jax.grad(mine, argnums=(0, 1, 2))(q, kc, vc)
    want = jax.grad(ref, argnums=(0, 1, 2))(*(x.astype(jnp.float32) for x in (q, kc, vc)))
    for x, y in zip(got, want, strict=True):
        assert relative_error(x, y) < 4 * 2.0**-8
