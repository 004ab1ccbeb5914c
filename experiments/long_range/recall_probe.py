"""A quick probe: does the grid's model learn MQAR recall at a given size, vocabulary
and rate? The project's LanguageModel (config.py's recall model: 2 layers, pre-LN,
rotary, unscaled untied embeddings) trained on fresh generated rows each step, outside
the data pipeline, so that a setting can be tried in a minute or two before a sweep.

  .venv/bin/python experiments/long_range/recall_probe.py --symbols 16 --length 64 \\
      --pairs 8 --lr 1e-3 --steps 1000

Prints, every 250 steps, the training loss and the recall accuracy on 512 held-out
rows: over all answers (``acc``; elimination alone reaches ~34% at 8 pairs) and on the
first query of each row (``first``; only recall beats 1/P there). ``--task needle``
trains the needle task instead (one answer a row, ``--pairs`` unused: ``acc`` and
``first`` are the same).
"""

import argparse
import sys
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import optax

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from flaxformer_lite import LanguageModel, ModelConfig  # noqa: E402
from flaxformer_lite.data import synthetic  # noqa: E402
from flaxformer_lite.model.partitioning import unbox  # noqa: E402


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--task", choices=("mqar", "needle"), default="mqar")
    p.add_argument("--symbols", type=int, default=16, help="key (and value) symbols")
    p.add_argument("--length", type=int, default=64)
    p.add_argument("--pairs", type=int, default=8)
    p.add_argument("--steps", type=int, default=1000)
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--d_model", type=int, default=64)
    p.add_argument("--heads", type=int, default=2)
    p.add_argument("--batch", type=int, default=32)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--pattern", default="dense")
    a = p.parse_args()

    def batch(rng, n):
        if a.task == "needle":
            rows = [synthetic.needle_example(rng, a.length, a.symbols) for _ in range(n)]
        else:
            rows = [synthetic.mqar_example(rng, a.length, a.pairs, a.symbols) for _ in range(n)]
        t = np.stack([r["targets"] for r in rows])
        w = np.stack([r["weights"] for r in rows])
        first = np.zeros_like(w)
        first[np.arange(n), np.argmax(w, axis=1)] = 1  # each row's first answer
        return t, w, first

    config = ModelConfig(
        vocab_size=synthetic.VOCAB["mqar"], d_model=a.d_model, num_heads=a.heads,
        d_ff=4 * a.d_model, num_encoder_layers=0, num_decoder_layers=2, max_len=a.length,
        embedding_dropout=0.0, residual_dropout=0.0, ln_position="pre", positional="rotary",
        scale_embeddings=False, tie_embeddings="none", attention_pattern=a.pattern,
        attention_block_size=16,
    )  # fmt: skip
    model = LanguageModel(config)
    rng = np.random.default_rng(a.seed)
    init = jnp.ones((2, a.length), jnp.int32)
    params = unbox(model.init(jax.random.key(a.seed), init))["params"]
    tx = optax.chain(
        optax.clip_by_global_norm(1.0),
        optax.adam(optax.warmup_constant_schedule(0.0, a.lr, 100), b2=0.98),
    )
    opt = tx.init(params)

    @jax.jit
    def step(params, opt, t, w):
        def loss(p):
            logits = model.apply({"params": p}, t)
            nll = optax.softmax_cross_entropy_with_integer_labels(logits, t)
            return (nll * w).sum() / w.sum()

        value, grads = jax.value_and_grad(loss)(params)
        updates, opt = tx.update(grads, opt, params)
        return optax.apply_updates(params, updates), opt, value

    @jax.jit
    def accuracy(params, t, w, first):
        hit = model.apply({"params": params}, t).argmax(-1) == t
        return (hit * w).sum() / w.sum(), (hit * first).sum() / first.sum()

    held_out = batch(np.random.default_rng(10_000 + a.seed), 512)
    start = time.time()
    for i in range(1, a.steps + 1):
        t, w, _ = batch(rng, a.batch)
        params, opt, value = step(params, opt, t, w)
        if i % 250 == 0:
            acc, first = accuracy(params, *held_out)
            print(f"{i} loss {float(value):.3f} acc {float(acc):.3f} first {float(first):.3f} "
                  f"({time.time() - start:.0f} s)", flush=True)  # fmt: skip


if __name__ == "__main__":
    main()
