"""The decoder-only LM's cached generation: new tokens per second at batch 1 and 16.

  python benchmarks/lm_generate.py              # configs/lm_small.py's model
  python benchmarks/lm_generate.py --tiny       # seconds, any machine

configs/lm_small.py's model (256 wide, 4 layers, 8k vocabulary) with random weights (a
step costs the same whatever the weights), a prompt of ``--prompt`` tokens forced after
BOS, then exactly ``--new`` tokens (no EOS can end a row early), greedy and sampled at
temperature 1 (:func:`~flaxformer_lite.inference.decoding.sample`, the search behind
``main generate``). Each program is timed warm, median of ``--rounds``, in one
process; cold is the first call (tracing and compiling included). The cached search is
checked against the model's full forward first: the greedy tokens are the argmax of the
logits of the whole generated row. Writes benchmarks/results/lm_generate.{json,md}.
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
import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from flaxformer_lite.config.model import ModelConfig  # noqa: E402
from flaxformer_lite.inference import decoding  # noqa: E402
from flaxformer_lite.model.lm import LanguageModel  # noqa: E402
from flaxformer_lite.model.partitioning import unbox  # noqa: E402

LM_SMALL = dict(vocab_size=8000, d_model=256, num_heads=4, d_ff=1024, num_encoder_layers=0,
                num_decoder_layers=4, max_len=256, ln_position="pre")  # fmt: skip
TINY = dict(vocab_size=200, d_model=32, num_heads=2, d_ff=64, num_encoder_layers=0,
            num_decoder_layers=1, max_len=64, ln_position="pre")  # fmt: skip


def _generate(model, params, prompt, new: int, temperature: float):
    b, p = prompt.shape
    prefix = jnp.zeros((b, p + new), jnp.int32).at[:, :p].set(prompt)
    return decoding.sample(
        model, params, None, max_length=p + new, eos_id=-1, bos_id=model.config.bos_id,
        rng=jax.random.key(1), temperature=temperature, prefix=prefix,
    )  # fmt: skip


def _check(model, params, prompt, new: int) -> None:
    """Greedy cached tokens == argmax of the full forward over the generated row."""
    out = _generate(model, params, prompt, new, 0.0)
    logits = model.apply({"params": params}, out)  # position i predicts out[:, i]
    p = prompt.shape[1]
    want = np.asarray(jnp.argmax(logits[:, p:], axis=-1))
    got = np.asarray(out[:, p:])
    if not (want == got).all():
        raise SystemExit(f"cached generation differs from the full forward: {got} vs {want}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tiny", action="store_true")
    parser.add_argument("--batches", default="1,16")
    parser.add_argument("--prompt", type=int, default=16)
    parser.add_argument("--new", type=int, default=112)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--out", default=str(ROOT / "benchmarks" / "results"))
    args = parser.parse_args()
    model = LanguageModel(ModelConfig(**(TINY if args.tiny else LM_SMALL)))
    vocab = model.config.vocab_size
    params = unbox(model.init(jax.random.key(0), jnp.ones((1, 8), jnp.int32)))["params"]
    rows = []
    for b in (int(x) for x in args.batches.split(",")):
        prompt = jax.random.randint(jax.random.key(b), (b, args.prompt), 4, vocab)
        _check(model, params, prompt, min(args.new, 16))
        for temperature in (0.0, 1.0):
            start = time.perf_counter()
            jax.block_until_ready(_generate(model, params, prompt, args.new, temperature))
            cold = time.perf_counter() - start
            times = []
            for _ in range(args.rounds):
                start = time.perf_counter()
                jax.block_until_ready(_generate(model, params, prompt, args.new, temperature))
                times.append(time.perf_counter() - start)
            warm = statistics.median(times)
            steps = args.prompt + args.new
            row = {
                "batch": b,
                "mode": "greedy" if temperature == 0 else "sampled",
                "seconds": warm,
                "cold_seconds": cold,
                "tokens_per_s": b * args.new / warm,
                "ms_per_step": 1e3 * warm / steps,
            }
            rows.append(row)
            print(
                f"batch {b:3d} {row['mode']:8s} {row['tokens_per_s']:9.0f} new tokens/s "
                f"({row['ms_per_step']:.2f} ms a step; cold {cold:.2f} s)",
                flush=True,
            )
    name = "tiny" if args.tiny else "configs/lm_small.py"
    lines = [
        f"`python benchmarks/lm_generate.py {' '.join(sys.argv[1:])}`: {name}'s model, random "
        f"weights, {args.prompt}-token prompts, {args.new} new tokens each; "
        f"{platform.machine()} CPU, {len(jax.devices())} device(s); warm medians of {args.rounds}",
        "",
        "| batch | mode | new tokens/s | ms a step | first call (s) |",
        "|---:|---|---:|---:|---:|",
    ] + [
        f"| {r['batch']} | {r['mode']} | {r['tokens_per_s']:,.0f} | {r['ms_per_step']:.2f} | "
        f"{r['cold_seconds']:.2f} |"
        for r in rows
    ]
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    stem = "lm_generate_tiny" if args.tiny else "lm_generate"
    (out / f"{stem}.md").write_text("\n".join(lines) + "\n")
    (out / f"{stem}.json").write_text(json.dumps(rows, indent=1) + "\n")


if __name__ == "__main__":
    main()
