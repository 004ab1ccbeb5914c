"""What the test suite's XLA flags cost and save on CPU: compile time, eager dispatch,
and the run time of the compiled program.

  python benchmarks/compile_flags.py [--rounds 3]

The suite (tests/conftest.py) compiles thousands of programs and runs most of them a
few times, so it trades run-time optimisation for compile time. Each flag set below
runs in a fresh process (no persistent cache, one CPU device), ``--rounds`` times,
interleaved: the CPU seconds (all threads) to initialise a 2+2-layer, 32-wide
Transformer op by op (the eager path many tests take: one small compile per new op
and shape), to compile the gradient of its loss on 8 x 32 tokens, and to run that
program 20 times. The table gives medians and each set's ratio to the suite's former
flags (``-O0`` alone), measured side by side. Writes
benchmarks/results/compile_flags.{json,md}.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

FLAG_SETS = {
    "XLA's defaults": "",
    "-O0 (the suite's former flags)": "--xla_backend_optimization_level=0",
    "-O0, classic emitters (the suite's flags)": (
        "--xla_backend_optimization_level=0 --xla_cpu_use_fusion_emitters=false"
    ),
}
BASELINE = "-O0 (the suite's former flags)"
PHASES = ("eager_init", "compile", "run20")


def child() -> None:
    """One measurement in this process: prints a JSON line of CPU seconds per phase."""
    import jax
    import jax.numpy as jnp

    from flaxformer_lite import ModelConfig, Transformer
    from flaxformer_lite.model.partitioning import unbox

    jax.config.update("jax_enable_compilation_cache", False)
    config = ModelConfig(vocab_size=100, d_model=32, num_heads=2, d_ff=64,
                         num_encoder_layers=2, num_decoder_layers=2, max_len=32)  # fmt: skip
    model = Transformer(config)
    src = jnp.ones((8, 32), jnp.int32)
    start = time.process_time()
    params = jax.block_until_ready(unbox(model.init(jax.random.key(0), src, src))["params"])
    eager = time.process_time()

    def loss(p, key):
        out = model.apply({"params": p}, src, src, deterministic=False, rngs={"dropout": key})
        return out.astype(jnp.float32).mean()

    lowered = jax.jit(jax.value_and_grad(loss)).lower(params, jax.random.key(1))
    traced = time.process_time()
    compiled = lowered.compile()
    done = time.process_time()
    for i in range(20):
        out = compiled(params, jax.random.key(i))
    jax.block_until_ready(out)
    ran = time.process_time()
    print(json.dumps({"eager_init": eager - start, "compile": done - traced, "run20": ran - done}))


def measure(flags: str) -> dict[str, float]:
    env = dict(os.environ, XLA_FLAGS=flags, JAX_PLATFORMS="cpu")
    env.pop("JAX_COMPILATION_CACHE_DIR", None)
    out = subprocess.run(
        [sys.executable, __file__, "--child"], env=env, cwd=ROOT, capture_output=True,
        text=True, check=True,
    )  # fmt: skip
    return json.loads(out.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        child()
        return
    runs: dict[str, list[dict[str, float]]] = {name: [] for name in FLAG_SETS}
    for r in range(args.rounds):
        for name, flags in FLAG_SETS.items():
            runs[name].append(measure(flags))
            print(f"round {r + 1}: {name}: {runs[name][-1]}", flush=True)
    medians = {
        name: {p: statistics.median(x[p] for x in rs) for p in PHASES} for name, rs in runs.items()
    }
    base = medians[BASELINE]
    lines = [
        f"CPU seconds (median of {args.rounds} fresh processes each); ratio to {BASELINE} "
        "in parentheses.",
        "",
        "| flags | eager init (op by op) | compile (train-step gradient) | 20 runs |",
        "|---|---:|---:|---:|",
    ]
    for name, m in medians.items():
        cells = [f"{m[p]:.2f} ({m[p] / base[p]:.2f}x)" for p in PHASES]
        lines.append(f"| {name} | " + " | ".join(cells) + " |")
    table = "\n".join(lines)
    print(table)
    out = ROOT / "benchmarks" / "results"
    out.mkdir(parents=True, exist_ok=True)
    (out / "compile_flags.json").write_text(
        json.dumps({"flags": FLAG_SETS, "runs": runs, "medians": medians}, indent=2) + "\n"
    )
    (out / "compile_flags.md").write_text(table + "\n")


if __name__ == "__main__":
    main()
