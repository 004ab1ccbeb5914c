"""Would fusing the tied output projection with the loss pay on CPU?

One train-step chain's tail (tiny config, 2 concurrent splits): ``[1024 x 256]``
hidden states against the ``[8000 x 256]`` embedding table, label smoothing 0.1,
fwd+bwd of the loss with respect to both. "current" is what the train step runs
(``tied_logits`` + ``losses.sums``, each with its hand-written gradient); "fusedC"
walks C tokens at a time and computes the gradient in the forward pass (the loss is
the step's only differentiated output), so no ``[tokens, vocab]`` array exists.

    python experiments/performance/fused_loss.py
"""

import statistics
import time

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from flaxformer_lite.model.embedding import tied_logits
from flaxformer_lite.training import losses

T, D, V, SMOOTHING = 1024, 256, 8000, 0.1


def main():
    rng = np.random.default_rng(0)
    x = jnp.asarray(rng.standard_normal((T, D), dtype=np.float32))
    table = jnp.asarray(rng.standard_normal((V, D), dtype=np.float32) * 0.06)
    labels = jnp.asarray(rng.integers(1, V, T), jnp.int32)
    weights = jnp.asarray((rng.random(T) < 0.9).astype(np.float32))

    def current(x, table):
        s = losses.sums(tied_logits(x[None], table)[0], labels, weights, SMOOTHING)
        return s["loss_sum"] / 1000.0

    def fused(chunk):
        low = SMOOTHING / (V - 1)

        @jax.custom_vjp
        def loss_sum(x, table):
            return forward(x, table)[0]

        def forward(x, table):
            def body(d_table, part):
                xc, lc, wc = part
                z = xc @ table.T
                (smoothed, _, _), lse = losses._statistics(z, lc, SMOOTHING)
                q = jnp.where(jnp.arange(V) == lc[:, None], 1.0 - SMOOTHING, low)
                g = wc[:, None] * (jnp.exp(z - lse[:, None]) - q)
                return d_table + g.T @ xc, ((smoothed * wc).sum(), g @ table)

            parts = (x.reshape(-1, chunk, D), labels.reshape(-1, chunk), weights.reshape(-1, chunk))
            d_table, (sums, dx) = lax.scan(body, jnp.zeros_like(table), parts)
            return sums.sum(), (dx.reshape(T, D), d_table)

        loss_sum.defvjp(forward, lambda res, g: (g * res[0], g * res[1]))
        return lambda x, table: loss_sum(x, table) / 1000.0

    fns = {"current": current, **{f"fused{c}": fused(c) for c in (128, 256, 512, 1024)}}
    fns = {name: jax.jit(jax.value_and_grad(fn, argnums=(0, 1))) for name, fn in fns.items()}
    _, (dx_ref, dt_ref) = fns["current"](x, table)
    for name, fn in fns.items():
        _, (dx, dt) = fn(x, table)
        err = max(float(jnp.abs(dx - dx_ref).max()), float(jnp.abs(dt - dt_ref).max()))
        print(f"{name}: largest gradient difference from current {err:.1e}")
    times = {name: [] for name in fns}
    for _ in range(5):
        for name, fn in fns.items():
            start = time.perf_counter()
            jax.block_until_ready(fn(x, table))
            times[name].append(time.perf_counter() - start)
    base = statistics.median(times["current"])
    for name in fns:
        t = statistics.median(times[name])
        print(f"{name}: {t * 1e3:.0f} ms, {base / t:.2f}x current")


if __name__ == "__main__":
    main()
