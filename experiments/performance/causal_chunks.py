"""Chunked dense attention, causal: skipping the chunk pairs above the diagonal.

Times fwd+bwd of ``chunked_attention`` (b=1, 8 heads, head dim 64, fp32) with and
without the skip, in alternating rounds of one process, causal and not (without
causality nothing is skipped: the two programs should be the same).

    python experiments/performance/causal_chunks.py --length 8192 --rounds 3
"""

import argparse
import statistics
import time

import jax
import jax.numpy as jnp
import numpy as np

from flaxformer_lite.model import chunked


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--length", type=int, default=8192)
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    rng = np.random.default_rng(0)
    q, k, v = (
        jnp.asarray(rng.standard_normal((1, args.length, 8, 64), dtype=np.float32))
        for _ in range(3)
    )

    def compiled(skip: bool, causal: bool):
        chunked._SKIP_ABOVE_DIAGONAL = skip  # read while tracing
        loss = lambda q, k, v: chunked.chunked_attention(q, k, v, causal=causal).sum()  # noqa: E731
        fn = jax.jit(jax.grad(loss, argnums=(0, 1, 2)))
        jax.block_until_ready(fn(q, k, v))
        return fn

    fns = {
        (skip, causal): compiled(skip, causal) for skip in (False, True) for causal in (True, False)
    }
    chunked._SKIP_ABOVE_DIAGONAL = True
    ratios = {True: [], False: []}
    for r in range(args.rounds):
        for causal in (True, False):
            seconds = {}
            for skip in (False, True) if r % 2 == 0 else (True, False):
                start = time.perf_counter()
                jax.block_until_ready(fns[(skip, causal)](q, k, v))
                seconds[skip] = time.perf_counter() - start
            ratios[causal].append(seconds[False] / seconds[True])
            print(
                f"round {r} causal={causal}: all pairs {seconds[False]:.2f} s, "
                f"skipping {seconds[True]:.2f} s ({ratios[causal][-1]:.2f}x)",
                flush=True,
            )
    for causal in (True, False):
        print(f"causal={causal}: median speed-up {statistics.median(ratios[causal]):.2f}x")


if __name__ == "__main__":
    main()
