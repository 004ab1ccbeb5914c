"""Time and memory of the four score functions, vs d_k and vs length, in one process.

  .venv/bin/python experiments/score_functions/bench.py [--quick]

One multi-head self-attention layer (projections included, the same for all four),
forward + backward of a scalar loss, batch 4, 4 heads, float32, jit-compiled.
Time: median over alternating rounds (the score functions take turns, so a machine
that slows down slows all of them); reported as a ratio to ``scaled_dot`` measured
in the same round. Memory: XLA's temporary buffers of the compiled program
(``memory_analysis()``), which does not depend on the machine's load.
Writes bench.json next to this file (read by plot.py).
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import jax
import jax.numpy as jnp

from flaxformer_lite.config.model import ModelConfig
from flaxformer_lite.model.multihead import MultiHeadAttention
from flaxformer_lite.model.partitioning import unbox

HERE = Path(__file__).resolve().parent
SCORES = ("scaled_dot", "dot", "additive", "bilinear")
HEADS, BATCH = 4, 4


def program(score_fn: str, d_k: int, length: int):
    config = ModelConfig(
        vocab_size=16, d_model=HEADS * d_k, num_heads=HEADS, d_ff=16, max_len=length,
        num_encoder_layers=1, num_decoder_layers=1, score_fn=score_fn,
        embedding_dropout=0.0, residual_dropout=0.0,
    )  # fmt: skip
    layer = MultiHeadAttention(config, self_attention=True)
    x = jax.random.normal(jax.random.key(0), (BATCH, length, HEADS * d_k))
    params = unbox(layer.init(jax.random.key(1), x))["params"]

    def loss(p, x):
        return jnp.sum(layer.apply({"params": p}, x) ** 2)

    step = jax.jit(jax.grad(loss, argnums=(0, 1)))
    compiled = step.lower(params, x).compile()
    memory = compiled.memory_analysis()
    temp = getattr(memory, "temp_size_in_bytes", None) if memory is not None else None
    return step, (params, x), temp


def time_once(step, args, reps: int) -> float:
    jax.block_until_ready(step(*args))
    start = time.perf_counter()
    for _ in range(reps):
        out = step(*args)
    jax.block_until_ready(out)
    return (time.perf_counter() - start) / reps


def measure(d_k: int, length: int, rounds: int, reps: int) -> dict:
    programs = {s: program(s, d_k, length) for s in SCORES}
    times: dict[str, list[float]] = {s: [] for s in SCORES}
    for _ in range(rounds):
        for s in SCORES:
            step, args, _ = programs[s]
            times[s].append(time_once(step, args, reps))
    out = {}
    for s in SCORES:
        ratios = [t / b for t, b in zip(times[s], times["scaled_dot"], strict=True)]
        out[s] = {
            "seconds_median": statistics.median(times[s]),
            "time_vs_scaled_dot": statistics.median(ratios),
            "temp_bytes": programs[s][2],
        }
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="fewer sizes and rounds")
    args = parser.parse_args()
    rounds, reps = (2, 2) if args.quick else (5, 3)
    dks = (16, 32) if args.quick else (16, 32, 64, 128)
    lengths = (64, 128) if args.quick else (64, 128, 256, 512)
    result = {"heads": HEADS, "batch": BATCH, "rounds": rounds, "vs_d_k": {}, "vs_length": {}}
    for d_k in dks:
        result["vs_d_k"][d_k] = measure(d_k, 128, rounds, reps)
        print(f"d_k {d_k}, length 128:", _line(result["vs_d_k"][d_k]), flush=True)
    for length in lengths:
        result["vs_length"][length] = measure(32, length, rounds, reps)
        print(f"d_k 32, length {length}:", _line(result["vs_length"][length]), flush=True)
    (HERE / "bench.json").write_text(json.dumps(result, indent=2) + "\n")


def _line(row: dict) -> str:
    return "  ".join(
        f"{s} {r['time_vs_scaled_dot']:.2f}x {r['temp_bytes'] / 2**20:.1f} MiB"
        for s, r in row.items()
    )


if __name__ == "__main__":
    main()
