"""What MoBA's routing costs beside its attention, and how its top-k is taken.

  python benchmarks/routing_cost.py            # on a GPU: n = 65,536, 8 heads of 64
  python benchmarks/routing_cost.py --lengths 65536,16384
  python benchmarks/routing_cost.py --tiny     # anywhere: n = 512

Times (best of three rounds, in one process) the routing alone (``moba:block=64,k=8``,
causal: every query scores every earlier block's mean key and keeps 7) and MoBA's
forward+backward on the fused kernel (``kernel="triton"``, routing included), for the
XLA routing's two ways of taking the top blocks (``sparse.routed.top_blocks``: XLA's
``top_k``, or seven passes of an argmax; ``ROUTE_ELEMENTS`` scores per step) and for
the fused routing kernel (``sparse.route_gpu``: no scores in memory). Prints one line
per variant; the record is in experiments/performance/gpu/README.md.
"""

from __future__ import annotations

import argparse
import functools
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402

from flaxformer_lite.sparse.ops.moba import xla as routed  # noqa: E402


def timed(f, *args, reps: int = 10) -> float:
    """Best of three rounds of ``reps`` calls, in ms (after a warm-up call)."""
    jax.block_until_ready(f(*args))
    best = float("inf")
    for _ in range(3):
        start = time.perf_counter()
        for _ in range(reps):
            out = f(*args)
        jax.block_until_ready(out)
        best = min(best, (time.perf_counter() - start) / reps)
    return 1e3 * best


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tiny", action="store_true", help="n = 512 (a CPU)")
    parser.add_argument("--lengths", default="65536", help="comma-separated lengths")
    args = parser.parse_args()
    for n in [512] if args.tiny else [int(x) for x in args.lengths.split(",")]:
        run(n)


def run(n: int) -> None:
    keys = jax.random.split(jax.random.key(0), 3)
    q, k, v = (jax.random.normal(x, (1, n, 8, 64), jnp.bfloat16) for x in keys)
    top_blocks = routed.top_blocks
    for route, by, elements in (("xla", "top_k", 1 << 22), ("xla", "argmax", 1 << 22),
                                ("fused", "-", 0)):  # fmt: skip
        routed.top_blocks = functools.partial(top_blocks, by=by if by != "-" else None)
        routed.ROUTE_ELEMENTS = elements or routed.ROUTE_ELEMENTS
        kw = dict(block=64, causal=True, route=route)
        routing = jax.jit(
            lambda q, k, kw=kw: routed.moba_attention(q, k, k, 8, routing_only=True, **kw).table
        )
        loss = lambda q, k, v, kw=kw: (
            routed.moba_attention(q, k, v, 8, kernel="triton", **kw).astype(jnp.float32).sum()
        )  # noqa: E731
        step = jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2)))
        ms = timed(routing, q, k), timed(step, q, k, v, reps=3)
        how = "fused kernel" if route == "fused" else f"XLA, top by {by}, {elements:,} per step"
        print(f"n={n} routing ({how}): routing {ms[0]:.2f} ms, moba fwd+bwd {ms[1]:.2f} ms",
              flush=True)  # fmt: skip
    routed.top_blocks = top_blocks


if __name__ == "__main__":
    main()
