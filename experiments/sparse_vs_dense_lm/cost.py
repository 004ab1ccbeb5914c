"""Cost of one training step of the sparse-vs-dense LM, per pattern and context, in one process.

  .venv/bin/python experiments/sparse_vs_dense_lm/cost.py [--lengths 1024,2048,4096] [--rounds 3]

The model and batch of config.py at each context (4,096 tokens a step: 4 rows of
1,024, 2 of 2,048, 1 of 4,096), one jit-compiled train step (forward, backward,
Adam) per attention pattern of run.sh. Memory: XLA's peak buffers of the compiled
step (arguments + outputs + temporaries, less donated), which does not depend on
the machine's load. Time: the patterns take turns for ``--rounds`` rounds, and each
step time is reported as a ratio to dense's in the same round (the median over
rounds), so a machine that slows down slows all of them. Writes cost.json here.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import jax

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))

from long_lm import compiled_step  # noqa: E402

from flaxformer_lite.config import files  # noqa: E402


def patterns(length: int) -> dict[str, str]:
    """run.sh's patterns: local reads 128 keys, moba at most 128 (4 blocks of 32), nsa 64
    chosen + 65 in its window + the block summaries; Sparse Transformer's stride ~ sqrt(n)."""
    stride = 32 if length <= 1024 else 64
    return {
        "dense": "dense",
        "local": "local:window=127",
        "strided": f"sparse_strided:stride={stride}",
        "bigbird": "bigbird:block=64,window=3,global=1,random=1",
        "topk": "topk:k=128",
        "moba": "moba:block=32,k=4",
        "nsa": "nsa:block=32,k=2,window=64",
    }


def measure(length: int, rounds: int) -> dict:
    config = files.load_config(str(HERE / "config.py"), str(length))
    programs = {}
    for name, spec in patterns(length).items():
        fn, state, batch, peak = compiled_step(config, spec, length)
        state, metrics = fn(state, batch)  # the first call (allocation) is not timed
        jax.block_until_ready(metrics)
        programs[name] = {"fn": fn, "state": state, "batch": batch, "bytes": peak, "times": []}
    for _ in range(rounds):
        for p in programs.values():
            start = time.perf_counter()
            p["state"], metrics = p["fn"](p["state"], p["batch"])
            jax.block_until_ready(metrics)
            p["times"].append(time.perf_counter() - start)
    dense = programs["dense"]
    out = {"rows": config.train.batch_size, "patterns": patterns(length)}
    for name, p in programs.items():
        ratios = [t / d for t, d in zip(p["times"], dense["times"], strict=True)]
        out[name] = {
            "step_seconds_median": statistics.median(p["times"]),
            "time_vs_dense": statistics.median(ratios),
            "peak_bytes": p["bytes"],
            "memory_vs_dense": p["bytes"] / dense["bytes"],
        }
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--lengths", default="1024,2048,4096")
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    result = {"tokens_per_step": 4096, "rounds": args.rounds, "lengths": {}}
    for length in (int(x) for x in args.lengths.split(",")):
        row = measure(length, args.rounds)
        result["lengths"][str(length)] = row
        print(
            f"context {length}: "
            + "  ".join(
                f"{n} {row[n]['time_vs_dense']:.2f}x time {row[n]['peak_bytes'] / 2**20:.0f} MiB"
                for n in patterns(length)
            ),
            flush=True,
        )
    (HERE / "cost.json").write_text(json.dumps(result, indent=2) + "\n")


if __name__ == "__main__":
    main()
