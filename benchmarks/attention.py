"""Dense vs blocked sparse attention: time, peak memory and scaling from 1k to 64k tokens.

  python benchmarks/attention.py [--max_len 65536] [--dense_max 8192] [--reps 3]

B=1, 8 heads, head dim 64, float32, bidirectional. Kernels:
  dense   - the core's softmax(QK^T/sqrt(d))V with its n x n weights;
  local   - blocked band, Local(window=128), kernel block 128 (3 key blocks per query block);
  bigbird - blocked BigBird: block 64, 3 window blocks, 2 global blocks, 3 random blocks;
  local_scan, bigbird_scan - the same with scan_blocks=16 (16 query blocks at a time
            in a lax.map, recomputed in the backward pass: less memory, more time).

  dense_chunked - the same dense attention by 512-query x 512-key chunks with an online
            softmax and a recomputing backward (model.attention_impl=chunked): O(n)
            memory, so it runs where dense cannot (to --chunked_max).

Per length and kernel: forward and forward+backward wall time (median of --reps
after a compile run) and XLA's peak buffer size of the compiled program
(arguments + outputs + temporaries, from ``compiled.memory_analysis()``; the
dense kernel is compiled but not run beyond --dense_max, where its estimate
exceeds this machine's memory). Kernel efficiency = the blocked kernel's
matmul FLOPs (QK^T and PV over the gathered blocks, x3 for fwd+bwd) per second
over the 2048^2 fp32 matmul peak measured in this process just before.
The scaling exponent is the least-squares slope of log time over log length. "vs best
dense" divides by the faster (time) and the smaller (memory) of the two dense kernels
that ran at that length: sparse kernels are compared with the best dense, not the naive one.
Writes benchmarks/results/attention.{json,md}.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from flaxformer_lite.model.attention import dot_product_attention  # noqa: E402
from flaxformer_lite.model.chunked import chunked_attention  # noqa: E402
from flaxformer_lite.sparse.grammar import patterns as P  # noqa: E402
from flaxformer_lite.sparse.ops.block_sparse.xla import block_table, sparse_attention  # noqa: E402
from flaxformer_lite.training.flops import matmul_peak_flops  # noqa: E402

HEADS, HEAD_DIM = 8, 64
_BIGBIRD = P.bigbird(block_size=64, window_blocks=3, global_blocks=2, random_blocks=3)
KERNELS = {  # name: (pattern, kernel block, scan_blocks)
    "dense": None,
    "dense_chunked": None,
    "local": (P.Local(128), 128, None),
    "bigbird": (_BIGBIRD, 64, None),
    "local_scan": (P.Local(128), 128, 16),
    "bigbird_scan": (_BIGBIRD, 64, 16),
}
DENSE = ("dense", "dense_chunked")
SPARSE = [name for name in KERNELS if name not in DENSE]


def kernel_fn(name):
    if name == "dense":
        return lambda q, k, v: dot_product_attention(q, k, v)
    if name == "dense_chunked":
        return lambda q, k, v: chunked_attention(q, k, v)
    pattern, block, scan = KERNELS[name]
    return lambda q, k, v: sparse_attention(q, k, v, pattern, block_size=block, scan_blocks=scan)


def kernel_flops(name: str, n: int) -> float:
    """Matmul FLOPs of one forward pass (QK^T and PV), as the kernel computes them."""
    d = HEAD_DIM
    if name in DENSE:
        return 4.0 * HEADS * n * n * d
    pattern, block, _ = KERNELS[name]
    plans = pattern.plans(n, block)
    nb = -(-n // block)
    pairs = 0.0
    if plans.block_mask is not None:
        pairs += nb * block * block_table(plans.block_mask)[0].shape[1] * block
    pairs += n * plans.columns.size + plans.rows.size * n
    return 4.0 * HEADS * pairs * d


def compiled_bytes(compiled) -> int:
    m = compiled.memory_analysis()
    return int(
        m.argument_size_in_bytes
        + m.output_size_in_bytes
        + m.temp_size_in_bytes
        - m.alias_size_in_bytes
    )


def run_one(name: str, n: int, reps: int, execute: bool) -> dict:
    key = jax.random.key(n)
    q, k, v = (jax.random.normal(kk, (1, n, HEADS, HEAD_DIM)) for kk in jax.random.split(key, 3))
    f = kernel_fn(name)
    fwd = jax.jit(f)
    w = jnp.cos(jnp.arange(HEAD_DIM, dtype=jnp.float32))
    fwdbwd = jax.jit(jax.grad(lambda q, k, v: (f(q, k, v) * w).sum(), argnums=(0, 1, 2)))
    row = {"kernel": name, "length": n}
    for label, fn in (("fwd", fwd), ("fwd_bwd", fwdbwd)):
        compiled = fn.lower(q, k, v).compile()
        row[f"{label}_bytes"] = compiled_bytes(compiled)
        if not execute:
            row[f"{label}_s"] = None
            continue
        jax.block_until_ready(compiled(q, k, v))
        times = []
        for _ in range(reps):
            t = time.perf_counter()
            jax.block_until_ready(compiled(q, k, v))
            times.append(time.perf_counter() - t)
        row[f"{label}_s"] = statistics.median(times)
    return row


def fit_exponent(rows: list[dict], kernel: str, key: str) -> float | None:
    pts = [(r["length"], r[key]) for r in rows if r["kernel"] == kernel and r[key]]
    if len(pts) < 2:
        return None
    x, y = np.log([p[0] for p in pts]), np.log([p[1] for p in pts])
    return float(np.polyfit(x, y, 1)[0])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--min_len", type=int, default=1024)
    parser.add_argument("--max_len", type=int, default=65536)
    parser.add_argument("--dense_max", type=int, default=8192, help="longest dense run")
    parser.add_argument("--dense_compile_max", type=int, default=16384)
    parser.add_argument("--chunked_max", type=int, default=32768, help="longest chunked run")
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--out", default=str(ROOT / "benchmarks" / "results"))
    args = parser.parse_args()

    rows = []
    n = args.min_len
    while n <= args.max_len:
        peak = matmul_peak_flops()
        for name in KERNELS:
            if (name == "dense" and n > args.dense_compile_max) or (
                name == "dense_chunked" and n > args.chunked_max
            ):
                continue
            row = run_one(name, n, args.reps, execute=name != "dense" or n <= args.dense_max)
            row["peak_flops"] = peak
            row["fwd_flops"] = kernel_flops(name, n)
            if row["fwd_bwd_s"]:
                row["efficiency"] = 3 * row["fwd_flops"] / row["fwd_bwd_s"] / peak
                row["fwd_efficiency"] = row["fwd_flops"] / row["fwd_s"] / peak
            rows.append(row)
            print(
                f"L={n:6d} {name:8s} fwd {_t(row['fwd_s'])} fwd+bwd {_t(row['fwd_bwd_s'])} "
                f"peak mem {row['fwd_bwd_bytes'] / 2**20:9.1f} MiB"
                + (f"  kernel {row['efficiency']:.0%} of peak" if row.get("efficiency") else ""),
                flush=True,
            )
        n *= 2

    summary = {}
    for name in SPARSE:
        summary[f"{name}_exponent_fwd_bwd"] = fit_exponent(rows, name, "fwd_bwd_s")
        summary[f"{name}_exponent_fwd"] = fit_exponent(rows, name, "fwd_s")
    at = {(r["kernel"], r["length"]): r for r in rows}

    def best_dense(n: int, key: str) -> float | None:
        values = [at[(k, n)][key] for k in DENSE if (k, n) in at and at[(k, n)][key]]
        return min(values) if values else None

    ref_len = 8192 if ("dense", 8192) in at and at[("dense", 8192)]["fwd_bwd_s"] else None
    if ref_len is None:
        dense_runs = [r["length"] for r in rows if r["kernel"] == "dense" and r["fwd_bwd_s"]]
        ref_len = max(dense_runs) if dense_runs else None
    if ref_len:
        for name in SPARSE:
            s = at[(name, ref_len)]
            summary[f"{name}_speedup_fwd_bwd_vs_best_dense_at_{ref_len}"] = (
                best_dense(ref_len, "fwd_bwd_s") / s["fwd_bwd_s"]
            )
            summary[f"{name}_memory_ratio_vs_best_dense_at_{ref_len}"] = (
                best_dense(ref_len, "fwd_bwd_bytes") / s["fwd_bwd_bytes"]
            )
    if ref_len and ("dense_chunked", ref_len) in at:
        d, c = at[("dense", ref_len)], at[("dense_chunked", ref_len)]
        summary[f"dense_chunked_speedup_over_dense_at_{ref_len}"] = d["fwd_bwd_s"] / c["fwd_bwd_s"]
        summary[f"dense_chunked_memory_ratio_at_{ref_len}"] = (
            d["fwd_bwd_bytes"] / c["fwd_bwd_bytes"]
        )
    summary["dense_chunked_longest_run"] = max(
        (r["length"] for r in rows if r["kernel"] == "dense_chunked" and r["fwd_bwd_s"]),
        default=None,
    )
    for name in [*SPARSE, "dense_chunked"]:
        eff = [r["efficiency"] for r in rows if r["kernel"] == name and r.get("efficiency")]
        if eff:
            summary[f"{name}_efficiency_median"] = statistics.median(eff)

    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "attention.json").write_text(json.dumps({"rows": rows, "summary": summary}, indent=2))
    lines = [
        "B=1, 8 heads, head dim 64, fp32; time = median wall seconds; memory = XLA peak "
        "buffers of the fwd+bwd program; eff = kernel matmul FLOP/s over the same-process "
        "2048^2 matmul peak",
        "",
        "| L | kernel | fwd | fwd+bwd | fwd+bwd memory | vs best dense: time "
        "| vs best dense: memory | kernel eff |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for n in sorted({r["length"] for r in rows}):
        best_time, best_mem = best_dense(n, "fwd_bwd_s"), best_dense(n, "fwd_bwd_bytes")
        for name in KERNELS:
            r = at.get((name, n))
            if r is None:
                continue
            speed = mem = "-"
            if name not in DENSE:
                if best_time and r["fwd_bwd_s"]:
                    speed = f"{best_time / r['fwd_bwd_s']:.1f}x"
                if best_mem:
                    mem = f"{best_mem / r['fwd_bwd_bytes']:.1f}x"
            lines.append(
                f"| {n} | {name} | {_t(r['fwd_s']).strip()} | {_t(r['fwd_bwd_s']).strip()} | "
                f"{r['fwd_bwd_bytes'] / 2**20:.0f} MiB | {speed} | {mem} | "
                + (f"{r['efficiency']:.0%}" if r.get("efficiency") else "-")
                + " |"
            )
    lines.append("")
    for k, v in summary.items():
        lines.append(f"- {k}: {v:.3f}" if isinstance(v, float) else f"- {k}: {v}")
    text = "\n".join(lines)
    (out / "attention.md").write_text(text + "\n")
    print(text)


def _t(seconds) -> str:
    return f"{seconds:8.3f}s" if seconds else "  (n/r) "


if __name__ == "__main__":
    main()
