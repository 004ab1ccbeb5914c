"""Training-step speed against google/flax's examples/wmt, in the same process; MFU.

  python benchmarks/train_step.py [--rounds 5] [--steps 3] [--skip_base] [--skip_real]

Ours and the peer (benchmarks/peer.py: flax's own examples/wmt models.py, fetched from
the installed flax version's source distribution) train on the same packed 32x64
synthetic batch (segment ids and positions), the same shapes and the same work:
"tiny" = 256 wide, 3+3 layers, 4 heads, FFN 1024, vocab 8000; "base-like" =
512/2048/8 heads/6+6, same vocabulary; shared embeddings with logits through
the embedding; dropout 0.1 on embeddings, sublayer outputs, attention weights and
FFN hidden units (the peer's defaults); label smoothing 0.1; Adam 0.9/0.98/1e-9 under
a warm-up schedule, no clipping; state donated. Ours keeps the paper's post-LN (the
peer is pre-LN: the same operations in another order).

Rounds alternate: a matmul-peak measurement, then a block of --steps steps of one,
then of the other (the order flips every round), so the machine's drift (its peak
swings up to 2x within a minute) falls on both. Reported: peer step / our step per
round, and its median over the rounds. MFU = analytic model FLOPs of a step
(flaxformer_lite/training/flops.py) / step time / the best of all the 2048^2 fp32
matmul measurements of this process. "ours (splits 2)" is train.concurrent_splits=2
(ende_small's CPU setting: the batch's halves as independent chains on both cores).
Real-vs-synthetic: our tiny step fed by the real pipeline (ding_de_en, packed,
prefetching) against the same compiled step fed one in-memory batch, interleaved.
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

import peer  # noqa: E402
from common import BASE_LIKE, TINY  # noqa: E402

from flaxformer_lite.config.experiment import OptimizerConfig  # noqa: E402
from flaxformer_lite.config.model import ModelConfig  # noqa: E402
from flaxformer_lite.data import packing, pipeline, sources  # noqa: E402
from flaxformer_lite.model.transformer import Transformer  # noqa: E402
from flaxformer_lite.training import flops, steps  # noqa: E402
from flaxformer_lite.training.state import create_train_state, make_optimizer  # noqa: E402

BATCH, LENGTH = 32, 64
SPLITS = 2  # train.concurrent_splits of configs/ende_small.py
# The peer's optimizer: Adam 0.9/0.98/1e-9, no clipping, a warm-up schedule.
OPTIMIZER = OptimizerConfig(schedule="noam", warmup_steps=1000, clip_grad_norm=0.0)
LEVERS = "## What each change bought"  # train_step.md keeps this section when rewritten
SAME_DROPOUT = dict(attention_dropout=0.1, ffn_dropout=0.1)  # as the peer's defaults


def compiled_step(config: ModelConfig, splits: int = 1):
    """(step(state, batch) -> (state, metrics), state) of ours."""
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


class Runner:
    """A compiled train step with its state, run a block of steps at a time."""

    def __init__(self, name: str, fn, state, extra=()):
        self.name, self.fn, self.state, self.extra = name, fn, state, extra

    def run(self, batches) -> list[float]:
        """Per-step wall times; each step includes transferring its batch."""
        times = []
        for get in batches:
            t = time.perf_counter()
            batch = {k: jax.device_put(v) for k, v in get().items()}
            self.state, metrics = self.fn(self.state, batch, *self.extra)
            jax.block_until_ready(metrics["loss"])
            times.append(time.perf_counter() - t)
        return times


def ours(config: ModelConfig, splits: int) -> Runner:
    fn, state = compiled_step(config.replace(**SAME_DROPOUT), splits)
    return Runner(f"ours (splits {splits})", fn, state)


def the_peer(config: ModelConfig) -> Runner:
    fn, state, rng = peer.compiled_train_step(config, LENGTH)
    return Runner("flax examples/wmt", fn, state, (rng,))


def side_by_side(config: ModelConfig, label: str, runners: list[Runner], rounds: int, n: int):
    """Alternating rounds of ``n`` steps of each runner; the last runner is the peer."""
    synthetic = pipeline.synthetic_batch(BATCH, LENGTH, config.vocab_size)
    for r in runners:
        r.run([lambda: synthetic] * 2)  # compile + warm
    step_flops = flops.train_step_flops(config, BATCH, LENGTH, LENGTH)
    per_round = {r.name: [] for r in runners}
    peaks = []
    for i in range(rounds):
        peaks.append(flops.matmul_peak_flops())
        for r in runners if i % 2 == 0 else runners[::-1]:
            per_round[r.name].append(statistics.median(r.run([lambda: synthetic] * n)))
    peer_times = per_round[runners[-1].name]
    rows = []
    for r in runners:
        times = per_round[r.name]
        ratios = [p / t for p, t in zip(peer_times, times, strict=True)]
        step = statistics.median(times)
        rows.append(
            {
                "config": label,
                "model": r.name,
                "step_s": step,
                "step_s_rounds": times,
                "speed_vs_peer": statistics.median(ratios),
                "speed_vs_peer_rounds": ratios,
                "target_tokens_per_s": int((synthetic["targets"] != 0).sum()) / step,
                "model_tflops_per_s": step_flops / step / 1e12,
            }
        )
    return rows, peaks


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
    iterator = packing.train_iterator(examples, batch_size=BATCH, max_length=LENGTH, seed=0)
    runner = ours(TINY, SPLITS)
    synthetic = pipeline.synthetic_batch(BATCH, LENGTH, TINY.vocab_size)
    runner.run([lambda: synthetic] * 2)
    real_t, synth_t = [], []
    block = 4
    for _ in range(max(n // block, 1)):
        real_t += runner.run([lambda: next(iterator)] * block)
        synth_t += runner.run([lambda: synthetic] * block)
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
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--steps", type=int, default=3, help="steps per block")
    parser.add_argument("--skip_base", action="store_true")
    parser.add_argument("--skip_real", action="store_true")
    parser.add_argument("--data_dir", default="data/tfds")
    parser.add_argument("--out", default=str(ROOT / "benchmarks" / "results"))
    args = parser.parse_args()

    peer.modules()  # fetch the peer first: a download failure stops before any timing
    rows, peaks = side_by_side(
        TINY, "tiny", [ours(TINY, SPLITS), ours(TINY, 1), the_peer(TINY)], args.rounds, args.steps
    )
    if not args.skip_base:
        more, more_peaks = side_by_side(
            BASE_LIKE,
            "base-like",
            [ours(BASE_LIKE, SPLITS), ours(BASE_LIKE, 1), the_peer(BASE_LIKE)],
            args.rounds,
            max(args.steps - 1, 1),
        )
        rows += more
        peaks += more_peaks
    peak = max(peaks)
    for r in rows:
        r["mfu"] = r["model_tflops_per_s"] * 1e12 / peak
    result = {
        "device": jax.devices()[0].device_kind,
        "batch": [BATCH, LENGTH],
        "rounds": args.rounds,
        "steps_per_block": args.steps,
        "peak_tflops": peak / 1e12,
        "peaks_tflops": [p / 1e12 for p in peaks],
        "configs": rows,
    }
    if not args.skip_real:
        result["real_vs_synthetic"] = real_vs_synthetic(args.steps * 8, args.data_dir)

    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "train_step.json").write_text(json.dumps(result, indent=2))
    lines = [
        f"`python benchmarks/train_step.py --rounds {args.rounds} --steps {args.steps}`; "
        f"{result['device']}; speed = peer step time / our step time, median of "
        f"{args.rounds} alternating rounds (each round's ratio in brackets); MFU against the "
        f"best 2048^2 fp32 matmul of this process ({peak / 1e9:.0f} GFLOP/s; all: "
        + ", ".join(f"{p / 1e9:.0f}" for p in peaks)
        + ")",
        "",
        "| shape | model | step (s) | speed vs peer | target tokens/s | MFU |",
        "|---|---|---|---|---|---|",
    ]
    for r in rows:
        lines.append(
            f"| {r['config']} | {r['model']} | {r['step_s']:.3f} | "
            f"**{r['speed_vs_peer']:.2f}x** "
            f"({', '.join(f'{x:.2f}' for x in r['speed_vs_peer_rounds'])}) | "
            f"{r['target_tokens_per_s']:.0f} | {r['mfu']:.2f} |"
        )
    if "real_vs_synthetic" in result:
        rv = result["real_vs_synthetic"]
        lines += [
            "",
            f"real data / synthetic step time (ours, tiny): {rv['ratio']:.3f} "
            f"({rv['real_step_s']:.3f} s vs {rv['synthetic_step_s']:.3f} s, "
            f"median of {rv['steps_each']} steps each)",
        ]
    text = "\n".join(lines)
    print(text)
    # The hand-written record below the measurements (what each change bought) stays.
    target = out / "train_step.md"
    kept = target.read_text().partition(LEVERS)[2] if target.exists() else ""
    target.write_text(text + "\n" + (f"\n{LEVERS}{kept}" if kept else ""))


if __name__ == "__main__":
    np.set_printoptions(precision=3)
    main()
