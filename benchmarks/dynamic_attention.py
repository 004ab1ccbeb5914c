"""Dynamic sparse attention's cost on CPU: MoBA and NSA block routing against dense
attention, top-k and BigBird, causal (a language model's self-attention).

  python benchmarks/dynamic_attention.py [--lengths 4096,16384,65536] [--reps 5]

B=1, 8 heads, head dim 64, float32. Kernels:
  dense          - softmax(QK^T/sqrt(d))V with its n x n weights (compiled for its memory
                   everywhere, run up to --dense_max);
  dense_chunked  - the same by 512 x 512 chunks, online softmax, recomputing backward
                   (model.attention_impl=chunked): O(n) memory, O(n^2) time;
  topk           - each query's 64 best keys (sparse/ops/topk/xla.py: every score computed);
  bigbird        - blocked BigBird, block 64: 3 window, 2 global, 3 random blocks;
  moba           - moba:block=64,k=4 (own block + 3 routed: sparse/ops/moba/xla.py), its chosen
                   blocks read key block by key block (sparse/ops/chosen_blocks/xla_chunks.py);
  moba_rows      - the same, each query's blocks gathered (sparse/ops/chosen_blocks/xla_gather.py);
  nsa            - nsa:block=64,k=4,window=128 (compressed + 4 selected blocks + window).

Per length and kernel: the forward+backward wall time and XLA's peak buffers of that
program (arguments + outputs + temporaries, ``compiled.memory_analysis()``), and the
share of the causal pairs the kernel reads. At each length the kernels run in turn,
--reps rounds, so that a machine whose speed drifts (a shared 2-core VM moved chunked
dense's 16k time between 7.3 and 11.6 s in one afternoon) slows every kernel of a
round alike; in a round each kernel makes one untimed call before its timed one,
because the first call after another program faults its buffers' pages in afresh (at
16k, NSA's first call after a 10 GB program took 3.0 s, the next 1.1 s): the timed
call is the steady state a training step sees. The n^2-memory kernels (topk, plain
dense) run after the rounds, alone, for the same reason. Time: the median over the
rounds. Ratios divide the faster dense kernel's time (and topk's) by the kernel's: per
round against chunked dense (median and, with three rounds or more, the range), of
the medians otherwise. Writes benchmarks/results/dynamic_attention.{json,md}.
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
from flaxformer_lite.sparse.grammar import patterns as P  # noqa: E402
from flaxformer_lite.sparse.ops.block_sparse.xla import sparse_attention  # noqa: E402
from flaxformer_lite.sparse.ops.moba import xla as routed  # noqa: E402
from flaxformer_lite.sparse.ops.nsa import xla as nsa  # noqa: E402
from flaxformer_lite.sparse.ops.topk.xla import topk_attention  # noqa: E402

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


def compile_one(name: str, n: int):
    """(inputs, the compiled forward+backward, its row without times) of a kernel."""
    q, k, v = (
        jax.random.normal(x, (1, n, HEADS, HEAD_DIM))
        for x in jax.random.split(jax.random.key(n), 3)
    )
    f = KERNELS[name]
    w = jnp.cos(jnp.arange(HEAD_DIM, dtype=jnp.float32))
    step = jax.jit(jax.grad(lambda q, k, v: (f(q, k, v) * w).sum(), argnums=(0, 1, 2)))
    compiled = step.lower(q, k, v).compile()
    row = {"kernel": name, "length": n, "bytes": compiled_bytes(compiled), "seconds": None,
           "rounds": [], "keys_read": keys_read(name, n)}  # fmt: skip
    return (q, k, v), compiled, row


ALONE = ("topk", "dense")  # n^2 memory: measured after the rounds, not between them


def _timed(compiled, args) -> float:
    started = time.perf_counter()
    jax.block_until_ready(compiled(*args))
    return time.perf_counter() - started


def run_length(n: int, names: list[str], reps: int, dense_max: int) -> list[dict]:
    """The rows of every kernel at length ``n`` (module doc): ``reps`` rounds of the
    kernels in turn, each an untimed then a timed call; then the :data:`ALONE` ones."""
    runs = [compile_one(name, n) for name in names]
    turns = [r for r in runs if r[2]["kernel"] not in ALONE]
    for _ in range(reps):
        for args, compiled, row in turns:
            jax.block_until_ready(compiled(*args))
            row["rounds"].append(_timed(compiled, args))
    for args, compiled, row in runs:
        if row["kernel"] in ALONE and (row["kernel"] != "dense" or n <= dense_max):
            jax.block_until_ready(compiled(*args))
            row["alone"] = True
            row["rounds"] = [_timed(compiled, args) for _ in range(reps)]
    rows = [row for _, _, row in runs]
    for row in rows:
        if row["rounds"]:
            row["seconds"] = statistics.median(row["rounds"])
    return rows


def ratios(row: dict, base: dict | None) -> list[float]:
    """``base``'s time over ``row``'s: round by round where both ran in the rounds, else
    the ratio of their medians (one value)."""
    if not base or not row["rounds"] or not base["rounds"]:
        return []
    if row.get("alone") or base.get("alone"):
        return [base["seconds"] / row["seconds"]]
    return [b / t for b, t in zip(base["rounds"], row["rounds"], strict=True)]


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


def _ratio(per_round: list[float]) -> str:
    """The median ratio, with its range over the rounds where there are three or more."""
    if not per_round:
        return "-"
    text = f"{statistics.median(per_round):.1f}x"
    if len(per_round) >= 3:
        text += f" ({min(per_round):.1f}-{max(per_round):.1f})"
    return text


def report(rows: list[dict], out: Path, command: str, reps: int) -> None:
    at = {(r["kernel"], r["length"]): r for r in rows}
    lines = [
        "# Dynamic sparse attention on CPU: forward + backward",
        "",
        f"`{command}` on {_cpu()} "
        f"({jax.devices()[0].device_kind}, {len(jax.devices())} device); B=1, {HEADS} heads, "
        f"head dim {HEAD_DIM}, float32, causal. Time: median wall seconds of the jitted "
        f"forward+backward over {reps} rounds in which the kernels of a length run in turn "
        "(each an untimed, then a timed call; topk and plain dense alone, after them); "
        "memory: XLA's peak buffers of that program; ratios against the faster dense "
        "kernel and against top-k at the same length: per round where both ran in the "
        "rounds, median (range), else of the medians.",
        "",
        "| length | kernel | keys read | fwd+bwd | memory | vs dense | vs topk |",
        "|---|---|---:|---:|---:|---:|---:|",
    ]
    for r in rows:
        n = r["length"]
        dense = [at[(k, n)] for k in ("dense", "dense_chunked")
                 if (k, n) in at and at[(k, n)]["seconds"]]  # fmt: skip
        faster = min(dense, key=lambda x: x["seconds"], default=None)
        r["vs_dense"], r["vs_topk"] = ratios(r, faster), ratios(r, at.get(("topk", n)))
        lines.append(
            f"| {n:,} | {r['kernel']} | {r['keys_read']:.1%} | {_t(r['seconds'])} | "
            f"{r['bytes'] / 2**20:,.0f} MiB | {_ratio(r['vs_dense'])} | {_ratio(r['vs_topk'])} |"
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
    parser.add_argument("--reps", type=int, default=5, help="rounds")
    parser.add_argument("--out", default=str(ROOT / "benchmarks" / "results"))
    args = parser.parse_args()
    Path(args.out).mkdir(parents=True, exist_ok=True)  # before the measuring, not after it
    rows = []
    for n in (int(x) for x in args.lengths.split(",")):
        names = [name for name in args.kernels.split(",")
                 if name not in ("dense_chunked", "topk") or n <= args.quadratic_max]  # fmt: skip
        for row in run_length(n, names, args.reps, args.dense_max):
            rows.append(row)
            print(f"L={n:6d} {row['kernel']:14s} fwd+bwd {_t(row['seconds'])} "
                  f"memory {row['bytes'] / 2**20:9.1f} MiB", flush=True)  # fmt: skip
    command = "python benchmarks/dynamic_attention.py " + " ".join(sys.argv[1:])
    report(rows, Path(args.out), command, args.reps)


if __name__ == "__main__":
    main()
