"""`make demo` (interim): one jitted forward/backward pass of the paper's model.

  python -m flaxformer_lite.demo [--preset paper_base] [--batch 8] [--length 32]

Builds the preset, runs a random batch through it, and prints the parameter
count, the label-smoothed cross-entropy, the gradient norm and the timings.
The training issue replaces this with training on the real corpus.
"""

from __future__ import annotations

import argparse
import time

import jax
import jax.numpy as jnp
import optax

from flaxformer_lite import Transformer, get_preset
from flaxformer_lite.config import PRESETS


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--preset", default="paper_base", choices=sorted(PRESETS))
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--length", type=int, default=32)
    args = parser.parse_args(argv)
    if args.batch < 1 or args.length < 2:
        parser.error(f"--batch={args.batch} must be >= 1 and --length={args.length} >= 2")

    config = get_preset(args.preset)
    model = Transformer(config)
    rng_params, rng_data, rng_dropout = jax.random.split(jax.random.key(0), 3)
    shape = (args.batch, args.length)
    inputs = jax.random.randint(rng_data, shape, 3, config.vocab_size)
    targets = jnp.roll(inputs, 1, axis=1)
    params = jax.jit(model.init)(rng_params, inputs, targets)["params"]
    n_params = sum(p.size for p in jax.tree.leaves(params))

    def loss_fn(p):
        logits = model.apply(
            {"params": p}, inputs, targets, deterministic=False, rngs={"dropout": rng_dropout}
        )
        labels = optax.smooth_labels(jax.nn.one_hot(targets, config.vocab_size), 0.1)
        return optax.softmax_cross_entropy(logits, labels).mean()

    step = jax.jit(jax.value_and_grad(loss_fn))
    t0 = time.perf_counter()
    loss, grads = jax.block_until_ready(step(params))
    compile_s = time.perf_counter() - t0
    t0 = time.perf_counter()
    loss, grads = jax.block_until_ready(step(params))
    step_s = time.perf_counter() - t0
    grad_norm = jnp.sqrt(sum(jnp.sum(jnp.square(g)) for g in jax.tree.leaves(grads)))

    platform = jax.devices()[0].platform
    uniform = float(jnp.log(config.vocab_size))
    print(f"preset            {args.preset} ({n_params:,} parameters, {platform})")
    print(f"batch             {args.batch} x {args.length} source and target tokens")
    print(f"loss (ls=0.1)     {float(loss):.4f}   (uniform guess: {uniform:.4f})")
    print(f"gradient norm     {float(grad_norm):.4f}")
    print(f"forward+backward  {step_s * 1000:.0f} ms  (first call, compiling: {compile_s:.1f} s)")
    if not jnp.isfinite(loss):
        raise SystemExit("error: the loss is not finite")


if __name__ == "__main__":
    main()
