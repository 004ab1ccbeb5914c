"""Why the blocked kernels stay near a third of the matmul peak on XLA:CPU.

Times single fp32 products of the shapes our kernels use, then the local pattern's
forward at 8k tokens two ways: three 128-key blocks per 128-query block (what
sparse/ops/block_sparse/xla_blocks.py reads) and a group of g query blocks against their joint key
span of g + 2 blocks (larger products, part of them outside the band).

    python experiments/performance/block_products.py

Prints GFLOP/s (best of 5 after a compile run) and the forward's share of the
2048^2 peak measured first in the same process.
"""

import time

import jax
import jax.numpy as jnp
import numpy as np

from flaxformer_lite.training.flops import matmul_peak_flops


def best(fn, *args, reps=5):
    jax.block_until_ready(fn(*args))
    times = []
    for _ in range(reps):
        start = time.perf_counter()
        jax.block_until_ready(fn(*args))
        times.append(time.perf_counter() - start)
    return min(times)


def main():
    rng = np.random.default_rng(0)

    def normal(*shape):
        return jnp.asarray(rng.standard_normal(shape, dtype=np.float32))

    matmul = jax.jit(lambda a, b: a @ b)
    peak = matmul_peak_flops()
    print(f"2048^2 peak: {peak / 1e9:.0f} GFLOP/s")
    for m, k, n in [(1024, 64, 1024), (2048, 256, 256), (2048, 256, 8000), (128, 64, 384)]:
        seconds = best(matmul, normal(m, k), normal(k, n))
        print(f"[{m}x{k}].[{k}x{n}]: {2 * m * k * n / seconds / 1e9:.0f} GFLOP/s")
    for blocks in (8, 64):  # one group of 8 query blocks, or all 64 of an 8k sequence
        q, keys = normal(1, 8, blocks, 128, 64), normal(1, 8, blocks, 384, 64)
        qk = jax.jit(lambda q, k: jnp.einsum("bhxqd,bhxkd->bhxqk", q, k))
        seconds = best(qk, q, keys)
        flops = 2 * 8 * blocks * 128 * 64 * 384
        print(f"{8 * blocks} batched [128x64].[64x384]: {flops / seconds / 1e9:.0f} GFLOP/s")

    n, h, block, d = 8192, 8, 128, 64
    nb = n // block
    q, k, v = normal(1, h, n, d), normal(1, h, n, d), normal(1, h, n, d)
    kp = jnp.pad(k, ((0, 0), (0, 0), (block, block), (0, 0)))
    vp = jnp.pad(v, ((0, 0), (0, 0), (block, block), (0, 0)))
    band_flops = 2 * 2 * h * n * 3 * block * d  # QK^T and PV over the 3 band blocks

    def attend(qs, ks, vs):
        s = jnp.einsum("bhxqd,bhxkd->bhxqk", qs, ks)
        p = jnp.exp(s - s.max(-1, keepdims=True))
        return jnp.einsum("bhxqk,bhxkv->bhxqv", p, vs), p.sum(-1)

    @jax.jit
    def three_blocks(q, kp, vp):
        def stacked(x):
            return jnp.concatenate(
                [x[:, :, o * block : o * block + n].reshape(1, h, nb, block, d) for o in range(3)],
                3,
            )

        return attend(q.reshape(1, h, nb, block, d), stacked(kp), stacked(vp))

    def joint_span(g):
        groups = nb // g
        idx = np.arange(groups)[:, None] * g * block + np.arange((g + 2) * block)[None]

        @jax.jit
        def fn(q, kp, vp):
            return attend(q.reshape(1, h, groups, g * block, d), kp[:, :, idx], vp[:, :, idx])

        return fn

    print(f"local window at {n} tokens, forward, {h} heads:")
    seconds = best(three_blocks, q, kp, vp)
    print(
        f"  3 key blocks per query block: {seconds * 1e3:.0f} ms, {band_flops / seconds / peak:.0%}"
    )
    for g in (2, 4, 8):
        seconds = best(joint_span(g), q, kp, vp)
        print(
            f"  {g} query blocks against {g + 2} key blocks: {seconds * 1e3:.0f} ms, "
            f"{band_flops / seconds / peak:.0%} (useful products only)"
        )


if __name__ == "__main__":
    main()
