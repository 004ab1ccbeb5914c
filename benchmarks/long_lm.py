"""The long-context LM's training step: sparse (blocked) vs dense attention.

  python benchmarks/long_lm.py [--length 4096] [--steps 3]

Model and batch of configs/lm_long_sparse.py (256 wide, 4 decoder layers, 4
heads, vocab 8000, 2 rows of --length tokens of running text), one jitted
train step with the config's causal strided pattern against the same model with
dense attention: median step time (after a compile run) and XLA's peak buffers
of the compiled step. The two programs are timed alternately, so drift cancels.
Writes benchmarks/results/long_lm.{json,md}.
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

from flaxformer_lite.config import files  # noqa: E402
from flaxformer_lite.config.model import model_config_from  # noqa: E402
from flaxformer_lite.model.build import build_model  # noqa: E402
from flaxformer_lite.training import steps  # noqa: E402
from flaxformer_lite.training.state import create_train_state, make_optimizer  # noqa: E402


def load_config():
    return files.load_config(str(ROOT / "configs" / "lm_long_sparse.py"))


def compiled_step(config, pattern: str, length: int):
    model_config = model_config_from(config).replace(attention_pattern=pattern, max_len=length)
    model = build_model(model_config, "lm")
    tx, schedule = make_optimizer(config.optimizer, model_config, 1000)
    state = create_train_state(model, tx, 0, length)
    fn = jax.jit(
        functools.partial(
            steps.train_step, model=model, tx=tx, schedule=schedule, label_smoothing=0.1
        ),
        donate_argnums=(0,),
    )
    rng = np.random.default_rng(0)
    batch = {
        "targets": rng.integers(4, model_config.vocab_size, (config.train.batch_size, length)),
        "targets_segment_ids": np.ones((config.train.batch_size, length), np.int32),
        "targets_positions": np.broadcast_to(np.arange(length), (config.train.batch_size, length)),
    }
    batch = {k: jax.device_put(np.asarray(v, np.int32)) for k, v in batch.items()}
    compiled = fn.lower(state, batch).compile()
    m = compiled.memory_analysis()
    peak = m.argument_size_in_bytes + m.output_size_in_bytes + m.temp_size_in_bytes
    return compiled, state, batch, int(peak - m.alias_size_in_bytes)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--length", type=int, default=4096)
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--out", default=str(ROOT / "benchmarks" / "results"))
    args = parser.parse_args()
    config = load_config()
    runs = {}
    for label, pattern in (("sparse", config.model.attention_pattern), ("dense", "dense")):
        fn, state, batch, peak = compiled_step(config, pattern, args.length)
        state, metrics = fn(state, batch)
        jax.block_until_ready(metrics)
        runs[label] = {"fn": fn, "state": state, "batch": batch, "bytes": peak, "times": []}
    for _ in range(args.steps):
        for r in runs.values():
            t = time.perf_counter()
            r["state"], metrics = r["fn"](r["state"], r["batch"])
            jax.block_until_ready(metrics)
            r["times"].append(time.perf_counter() - t)
    result = {
        "length": args.length,
        "batch": config.train.batch_size,
        "pattern": config.model.attention_pattern,
        **{f"{k}_step_s": statistics.median(r["times"]) for k, r in runs.items()},
        **{f"{k}_bytes": r["bytes"] for k, r in runs.items()},
    }
    result["speedup"] = result["dense_step_s"] / result["sparse_step_s"]
    result["memory_ratio"] = result["dense_bytes"] / result["sparse_bytes"]
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "long_lm.json").write_text(json.dumps(result, indent=2))
    text = (
        f"lm_long_sparse train step, {result['batch']} x {args.length} tokens: "
        f"sparse ({result['pattern']}) {result['sparse_step_s']:.2f} s, "
        f"{result['sparse_bytes'] / 2**30:.2f} GiB; dense {result['dense_step_s']:.2f} s, "
        f"{result['dense_bytes'] / 2**30:.2f} GiB; dense/sparse time {result['speedup']:.2f}x, "
        f"memory {result['memory_ratio']:.2f}x"
    )
    (out / "long_lm.md").write_text(text + "\n")
    print(text)


if __name__ == "__main__":
    main()
