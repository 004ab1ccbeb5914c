"""Compile time of the training step, layers scanned (``model.scan_layers``) against
unrolled, for deep models: 6+6, 12+12 and 24+24 layers of paper_base's width (512
wide, 8 heads, d_ff 2048), batch 8 x 128 tokens, in one process (same machine, same
XLA), compiled from scratch (no persistent cache). Also the step time once compiled,
so a scan's cost in speed is visible. Writes benchmarks/results/scan_layers.md.

  python benchmarks/scan_layers.py [--layers 6,12,24] [--repeats 3]

Goal: >= 3x faster to compile at 24+24.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402

from flaxformer_lite.config.model import PRESETS  # noqa: E402
from flaxformer_lite.model.partitioning import unbox  # noqa: E402
from flaxformer_lite.model.transformer import Transformer  # noqa: E402

jax.config.update("jax_enable_compilation_cache", False)


def _step(model):
    def loss(params, src, tgt):
        logits = model.apply(
            {"params": params}, src, tgt, deterministic=False, rngs={"dropout": jax.random.key(1)}
        )
        return jnp.mean(jax.nn.logsumexp(logits, axis=-1))

    return jax.jit(jax.value_and_grad(loss))


def measure(layers: int, scan: bool, repeats: int) -> dict:
    config = PRESETS["paper_base"].replace(
        num_encoder_layers=layers, num_decoder_layers=layers, vocab_size=8000, scan_layers=scan
    )
    model = Transformer(config)
    src = jnp.ones((8, 128), jnp.int32)
    tgt = jnp.ones((8, 128), jnp.int32)
    params = jax.jit(lambda: unbox(model.init(jax.random.key(0), src, tgt))["params"])()
    start = time.perf_counter()
    compiled = _step(model).lower(params, src, tgt).compile()
    seconds = time.perf_counter() - start
    jax.block_until_ready(compiled(params, src, tgt))
    times = []
    for _ in range(repeats):
        t = time.perf_counter()
        jax.block_until_ready(compiled(params, src, tgt))
        times.append(time.perf_counter() - t)
    return {"compile_s": seconds, "step_s": statistics.median(times)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--layers", default="6,12,24")
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    device = jax.devices()[0]
    lines = [
        "# Compile time of the training step: layers scanned vs unrolled",
        "",
        f"`python benchmarks/scan_layers.py --layers {args.layers}` on {device.device_kind} "
        f"({jax.default_backend()}); batch 8 x 128 tokens, paper_base width, vocab 8000",
        "",
        "| layers | unrolled compile (s) | scanned compile (s) | compile ratio | "
        "unrolled step (s) | scanned step (s) | step ratio |",
        "|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for n in (int(x) for x in args.layers.split(",")):
        plain, scanned = measure(n, False, args.repeats), measure(n, True, args.repeats)
        line = (
            f"| {n}+{n} | {plain['compile_s']:.1f} | {scanned['compile_s']:.1f} | "
            f"**{plain['compile_s'] / scanned['compile_s']:.1f}x** | {plain['step_s']:.2f} | "
            f"{scanned['step_s']:.2f} | {scanned['step_s'] / plain['step_s']:.2f} |"
        )
        print(line, flush=True)
        lines.append(line)
    out = ROOT / "benchmarks" / "results" / "scan_layers.md"
    out.write_text("\n".join(lines) + "\n")
    print(f"wrote {out.relative_to(ROOT)}")


if __name__ == "__main__":
    main()
