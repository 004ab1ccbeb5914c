"""Dynamic sparse attention's cost on CPU: MoBA and NSA block routing against dense
attention, top-k and BigBird, causal (a language model's self-attention).

  python benchmarks/dynamic_attention.py [--lengths 4096,16384,65536] [--reps 3]

B=1, 8 heads, head dim 64, float32. Kernels:
  dense          - softmax(QK^T/sqrt(d))V with its n x n weights (compiled for its memory
                   everywhere, run up to --dense_max);
  dense_chunked  - the same by 512 x 512 chunks, online softmax, recomputing backward
                   (model.attention_impl=chunked): O(n) memory, O(n^2) time;
  topk           - each query's 64 best keys (sparse/topk.py: every score computed);
  bigbird        - blocked BigBird, block 64: 3 window, 2 global, 3 random blocks;
  moba           - moba:block=64,k=4 (own block + 3 routed: sparse/routed.py), its chosen
                   blocks read key block by key block (sparse/routed_chunks.py);
  moba_rows      - the same, each query's blocks gathered (sparse/routed_kernel.py);
  nsa            - nsa:block=64,k=4,window=128 (compressed + 4 selected blocks + window).

Per length and kernel: the forward+backward wall time (median of --reps after a
compile run) and XLA's peak buffers of that program (arguments + outputs +
temporaries, ``compiled.memory_analysis()``), and the share of the causal pairs the
kernel reads. Ratios divide the faster dense kernel's time (and topk's) by the
kernel's, measured in this process. Writes benchmarks/results/dynamic_attention.{json,md}.
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import sys
import time
from pathlib import Path

import jax
import jax.numpy as jnp

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from flaxformer_lite.model.attention import dot_product_attention  # noqa: E402
from flaxformer_lite.model.chunked import chunked_attention  # noqa: E402
from flaxformer_lite.model.masks import make_causal_mask  # noqa: E402
from flaxformer_lite.sparse import nsa, routed  # noqa: E402
from flaxformer_lite.sparse import patterns as P  # noqa: E402
from flaxformer_lite.sparse.blocked import sparse_attention  # noqa: E402
from flaxformer_lite.sparse.topk import topk_attention  # noqa: E402

HEADS, HEAD_DIM, BLOCK, K, WINDOW, TOPK = 8, 64, 64, 4, 128, 64
_BIGBIRD = P.bigbird(block_size=BLOCK, window_blocks=3, global_blocks=2, random_blocks=3).causal()
_NSA = nsa.init_params(HEADS, HEAD_DIM, HEAD_DIM)
KERNELS = {
    "dense": lambda q, k, v: dot_product_attention(q, k, v, make_causal_mask(q.shape[1])),
    "dense_chunked": lambda q, k, v: chunked_attention(q, k, v, causal=True),
    "topk": lambda q, k, v: topk_attention(q, k, v, TOPK, causal=True, query_block=128),
    "bigbird": lambda q, k, v: sparse_attention(q, k, v, _BIGBIRD, block_size=BLOCK),
    "moba": lambda q, k, v: routed.moba_attention(q, k, v, K, block=BLOCK, causal=True),
    "moba_rows": lambda q, k, v: routed.moba_attention(
        q, k, v, K, block=BLOCK, causal=True, kernel="xla_rows"
    ),
    "nsa": lambda q, k, v: nsa.nsa_attention(q, k, v, _NSA, K, WINDOW, block=BLOCK, causal=True),
}


def keys_read(name: str, n: int) -> float:
    """The share of the n(n+1)/2 causal pairs a kernel's softmax reads (k blocks of B
    keys; NSA also its window and n/B compressed tokens; top-k its k keys)."""
    causal = n * (n + 1) / 2
    if name in ("dense", "dense_chunked"):
        return 1.0
    if name == "topk":
        return min(n * TOPK, causal) / causal
    if name == "bigbird":
        return float(_BIGBIRD.mask(n).sum()) / causal if n <= 16384 else float("nan")
    pairs = n * min(K * BLOCK, n)  # at most K blocks of B keys per query (moba, moba_rows)
    if name == "nsa":
        pairs += n * (WINDOW + 1) + n * (n // BLOCK) / 2
    return min(pairs / causal, 1.0)


def compiled_bytes(compiled) -> int:
    m = compiled.memory_analysis()
    return int(m.argument_size_in_bytes + m.output_size_in_bytes + m.temp_size_in_bytes
               - m.alias_size_in_bytes)  # fmt: skip


def run_one(name: str, n: int, reps: int, execute: bool) -> dict:
    q, k, v = (
        jax.random.normal(x, (1, n, HEADS, HEAD_DIM))
        for x in jax.random.split(jax.random.key(n), 3)
    )
    f = KERNELS[name]
    w = jnp.cos(jnp.arange(HEAD_DIM, dtype=jnp.float32))
    step = jax.jit(jax.grad(lambda q, k, v: (f(q, k, v) * w).sum(), argnums=(0, 1, 2)))
    compiled = step.lower(q, k, v).compile()
    row = {"kernel": name, "length": n, "bytes": compiled_bytes(compiled), "seconds": None,
           "keys_read": keys_read(name, n)}  # fmt: skip
    if execute:
        jax.block_until_ready(compiled(q, k, v))
        times = []
        for _ in range(reps):
            started = time.perf_counter()
            jax.block_until_ready(compiled(q, k, v))
            times.append(time.perf_counter() - started)
        row["seconds"] = statistics.median(times)
    return row


def _cpu() -> str:
    """The processor's model name (Linux), else the machine type."""
    try:
        for line in open("/proc/cpuinfo"):
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.machine()


def _t(x) -> str:
    return "(not run)" if x is None else f"{x:.3f} s"


def report(rows: list[dict], out: Path, command: str) -> None:
    at = {(r["kernel"], r["length"]): r for r in rows}
    lines = [
        "# Dynamic sparse attention on CPU: forward + backward",
        "",
        f"`{command}` on {_cpu()} "
        f"({jax.devices()[0].device_kind}, {len(jax.devices())} device); B=1, {HEADS} heads, "
        f"head dim {HEAD_DIM}, float32, causal. Time: median wall seconds of the jitted "
        "forward+backward; memory: XLA's peak buffers of that program; ratios against the "
        "faster dense kernel and against top-k at the same length, in this process.",
        "",
        "| length | kernel | keys read | fwd+bwd | memory | vs dense | vs topk |",
        "|---|---|---:|---:|---:|---:|---:|",
    ]
    for r in rows:
        n = r["length"]
        dense = [at[(k, n)]["seconds"] for k in ("dense", "dense_chunked")
                 if (k, n) in at and at[(k, n)]["seconds"]]  # fmt: skip
        topk = at.get(("topk", n), {}).get("seconds")
        ratio = lambda base, s=r["seconds"]: f"{base / s:.1f}x" if base and s else "-"
        lines.append(
            f"| {n:,} | {r['kernel']} | {r['keys_read']:.1%} | {_t(r['seconds'])} | "
            f"{r['bytes'] / 2**20:,.0f} MiB | {ratio(min(dense, default=None))} | {ratio(topk)} |"
        )
    (out / "dynamic_attention.md").write_text("\n".join(lines) + "\n")
    (out / "dynamic_attention.json").write_text(json.dumps(rows, indent=1) + "\n")
    print("\n".join(lines))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--lengths", default="4096,16384,65536")
    parser.add_argument("--kernels", default=",".join(KERNELS))
    parser.add_argument("--dense_max", type=int, default=8192, help="longest plain dense run")
    parser.add_argument("--quadratic_max", type=int, default=16384,
                        help="longest dense_chunked and topk run (their time is n^2)")  # fmt: skip
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--out", default=str(ROOT / "benchmarks" / "results"))
    args = parser.parse_args()
    Path(args.out).mkdir(parents=True, exist_ok=True)  # before the measuring, not after it
    rows = []
    for n in (int(x) for x in args.lengths.split(",")):
        for name in args.kernels.split(","):
            if name in ("dense_chunked", "topk") and n > args.quadratic_max:
                continue
            row = run_one(name, n, args.reps, execute=name != "dense" or n <= args.dense_max)
            rows.append(row)
            print(f"L={n:6d} {name:14s} fwd+bwd {_t(row['seconds'])} "
                  f"memory {row['bytes'] / 2**20:9.1f} MiB", flush=True)  # fmt: skip
    report(rows, Path(args.out), "python benchmarks/dynamic_attention.py " + " ".join(sys.argv[1:]))


if __name__ == "__main__":
    main()
