"""Training-step throughput and MFU, and the cost of real data over synthetic batches.

  python benchmarks/train_step.py [--steps 8] [--skip_base] [--skip_real]

MFU = analytic model FLOPs of a step (flaxformer_lite/training/flops.py) /
step time / the FLOP/s of a 2048x2048 float32 jnp.dot measured in this same
process right before each block of steps (this machine's peak swings up to 2x
within a minute, so only same-process, same-moment ratios mean anything).

Configs: "tiny" = 256 wide, 3+3 layers, 4 heads, FFN 1024, vocab 8000, batch
32x64, dropout 0.1 (ende_small's shape; its demo now trains without dropout, and
the benchmark keeps the dropout cost in); "base-like" = 512/2048/8 heads/6+6, same
vocabulary and batch. Each runs with train.concurrent_splits = 2 (ende_small's
setting: the batch's two halves are independent chains that XLA:CPU runs on
both cores); tiny also with 1 for comparison. Real-vs-synthetic: the tiny step fed by the real
pipeline (ding_de_en, packed, prefetching) against the same compiled step fed
one in-memory synthetic batch, interleaved in blocks so drift cancels.
Writes benchmarks/results/train_step.{json,md}.
"""

from __future__ import annotations

import argparse
import functools
import json
import statistics
import sys
import time
from pathlib import Path

import jax
import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

from common import BASE_LIKE, TINY  # noqa: E402

from flaxformer_lite.architectures.transformer import Transformer  # noqa: E402
from flaxformer_lite.config import ModelConfig  # noqa: E402
from flaxformer_lite.data import pipeline, sources  # noqa: E402
from flaxformer_lite.experiment import OptimizerConfig  # noqa: E402
from flaxformer_lite.training import flops, steps  # noqa: E402
from flaxformer_lite.training.state import create_train_state, make_optimizer  # noqa: E402

BATCH, LENGTH = 32, 64
SPLITS = 2  # train.concurrent_splits of configs/ende_small.py
OPTIMIZER = OptimizerConfig(schedule="noam", warmup_steps=300, clip_grad_norm=1.0)


def compiled_step(config: ModelConfig, splits: int = 1):
    model = Transformer(config)
    tx, schedule = make_optimizer(OPTIMIZER, config, 1000)
    state = create_train_state(model, tx, 0, LENGTH)
    fn = jax.jit(
        functools.partial(
            steps.train_step,
            model=model,
            tx=tx,
            schedule=schedule,
            label_smoothing=0.1,
            concurrent_splits=splits,
        ),
        donate_argnums=(0,),
    )
    return fn, state


def time_steps(fn, state, batches) -> tuple[list[float], object]:
    """Per-step wall times; each step includes fetching and transferring its batch."""
    times = []
    for get in batches:
        t = time.perf_counter()
        batch = {k: jax.device_put(v) for k, v in get().items()}
        state, metrics = fn(state, batch)
        jax.block_until_ready(metrics["loss"])
        times.append(time.perf_counter() - t)
    return times, state


def measure(config: ModelConfig, label: str, n: int, rounds: int = 3, splits: int = 1) -> dict:
    """Alternates matmul-peak measurements with blocks of steps; MFU per round, median.

    The peak of this machine drifts within seconds, so each block of steps is
    divided by the peak measured right before it.
    """
    fn, state = compiled_step(config, splits)
    synthetic = pipeline.synthetic_batch(BATCH, LENGTH, config.vocab_size)
    _, state = time_steps(fn, state, [lambda: synthetic] * 2)  # compile + warm
    step_flops = flops.train_step_flops(config, BATCH, LENGTH, LENGTH)
    steps_s, peaks, mfus = [], [], []
    for _ in range(rounds):
        peak = flops.matmul_peak_flops()
        times, state = time_steps(fn, state, [lambda: synthetic] * max(n // rounds, 1))
        step = statistics.median(times)
        steps_s.append(step)
        peaks.append(peak)
        mfus.append(step_flops / step / peak)
    step = statistics.median(steps_s)
    tokens = int((synthetic["targets"] != 0).sum())
    return {
        "config": label,
        "concurrent_splits": splits,
        "step_s": step,
        "target_tokens_per_s": tokens / step,
        "model_tflops_per_s": step_flops / step / 1e12,
        "mfu": statistics.median(mfus),
        "mfu_rounds": mfus,
        "peaks_tflops": [p / 1e12 for p in peaks],
    }


def real_vs_synthetic(n: int, data_dir: str) -> dict:
    from flaxformer_lite.data.tokenizer import Tokenizer, train_tokenizer

    pairs = sources.load_text_pairs("ding_de_en", "train", "en", "de", data_dir)
    tok_path = Path(data_dir) / "bench_tokenizer.model"
    tokenizer = (
        Tokenizer.load(tok_path)
        if tok_path.exists()
        else train_tokenizer((s for p in pairs for s in p), tok_path, TINY.vocab_size)
    )
    examples, _ = pipeline.tokenize_pairs(pairs, tokenizer, LENGTH)
    iterator = pipeline.train_iterator(examples, batch_size=BATCH, max_length=LENGTH, seed=0)
    fn, state = compiled_step(TINY, SPLITS)
    synthetic = pipeline.synthetic_batch(BATCH, LENGTH, TINY.vocab_size)
    _, state = time_steps(fn, state, [lambda: synthetic] * 2)
    real_t, synth_t = [], []
    block = 4
    for _ in range(max(n // block, 1)):
        t, state = time_steps(fn, state, [lambda: next(iterator)] * block)
        real_t += t
        t, state = time_steps(fn, state, [lambda: synthetic] * block)
        synth_t += t
    iterator.close()
    real, synth = statistics.median(real_t), statistics.median(synth_t)
    return {
        "real_step_s": real,
        "synthetic_step_s": synth,
        "ratio": real / synth,
        "steps_each": len(real_t),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--skip_base", action="store_true")
    parser.add_argument("--skip_real", action="store_true")
    parser.add_argument("--data_dir", default="data/tfds")
    parser.add_argument("--out", default=str(ROOT / "benchmarks" / "results"))
    args = parser.parse_args()

    rows = [
        measure(TINY, "tiny", args.steps, splits=SPLITS),
        measure(TINY, "tiny", args.steps, splits=1),
    ]
    if not args.skip_base:
        rows.append(measure(BASE_LIKE, "base-like", max(args.steps // 2, 3), splits=SPLITS))
    result = {"device": jax.devices()[0].device_kind, "batch": [BATCH, LENGTH], "configs": rows}
    if not args.skip_real:
        result["real_vs_synthetic"] = real_vs_synthetic(args.steps * 2, args.data_dir)

    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "train_step.json").write_text(json.dumps(result, indent=2))
    lines = [
        "MFU = model FLOPs / step time / the 2048^2 fp32 matmul peak measured just before; "
        "median of the rounds (peaks seen, GFLOP/s: "
        + ", ".join(f"{p * 1e3:.0f}" for r in rows for p in r["peaks_tflops"])
        + ")",
        "",
        "| config | concurrent splits | step (s) | target tokens/s | model TFLOP/s "
        "| MFU (rounds) |",
        "|---|---|---|---|---|---|",
    ]
    for r in rows:
        lines.append(
            f"| {r['config']} | {r['concurrent_splits']} | {r['step_s']:.3f} | "
            f"{r['target_tokens_per_s']:.0f} | "
            f"{r['model_tflops_per_s']:.3f} | {r['mfu']:.2f} "
            f"({', '.join(f'{m:.2f}' for m in r['mfu_rounds'])}) |"
        )
    if "real_vs_synthetic" in result:
        rv = result["real_vs_synthetic"]
        lines += [
            "",
            f"real data / synthetic step time: {rv['ratio']:.3f} "
            f"({rv['real_step_s']:.3f} s vs {rv['synthetic_step_s']:.3f} s, "
            f"median of {rv['steps_each']} steps each)",
        ]
    text = "\n".join(lines)
    (out / "train_step.md").write_text(text + "\n")
    print(text)


if __name__ == "__main__":
    np.set_printoptions(precision=3)
    main()
