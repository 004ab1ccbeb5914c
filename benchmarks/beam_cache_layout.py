"""A beam step's self-attention over the cache, two ways: reorder the cache rows after
each step (what beam_search does: every hypothesis owns a contiguous row), or keep each
row's keys where they were written and attend through a table of which beam slot
holds each position of a hypothesis (CTranslate2's and fairseq's "no reorder" idea).

  python benchmarks/beam_cache_layout.py [--sources 32] [--beams 4] [--length 48]

The second way copies no cache, but a hypothesis may read any of its source row's k
slots, so each query scores the k slots' keys (k times the attention's products)
and the softmax runs over slots and positions together. The demo's decoder shape
(3 layers, 4 heads of 64), float32; each program runs ``steps`` beam steps in a
``fori_loop`` (origins drawn once), timed at 50 and 100 steps so that fixed costs
cancel. Prints ms per step and the ratio, measured in this process.
"""

from __future__ import annotations

import argparse
import time

import jax
import jax.numpy as jnp
import numpy as np

LAYERS, HEADS, DIM = 3, 4, 64


def scores(q, keys, allowed):
    """``q [n, r, h, d]`` against ``keys [n, h, t, d]`` under ``allowed [n, 1, r, t]``:
    the masked scores ``[n, h, r, t]``."""
    s = jnp.einsum("nrhd,nhtd->nhrt", q, keys) / np.sqrt(q.shape[-1])
    return jnp.where(allowed, s, -1e30)


def reorder_step(caches, q, origin, i):
    """Attend over each row's own cache, then gather the rows the new beams continue."""
    t = caches[0][0].shape[2]
    allowed = (jnp.arange(t) <= i)[None, None, None]
    out, moved = 0.0, []
    for keys, values in caches:
        s = scores(q, keys, allowed)
        out = out + jnp.einsum("nhrt,nhtd->nrhd", jax.nn.softmax(s, -1), values)
        moved.append((keys[origin], values[origin]))
    return out, moved


def slots_step(caches, q, slots, origin, i, k):
    """Attend through ``slots [n, t, k]`` (which of its row's k slots holds each
    position of a hypothesis); only the table follows the beams."""
    n, t, _ = slots.shape
    b = n // k
    # allowed[(row, slot), 0, hypothesis, position]
    allowed = jnp.transpose(slots.reshape(b, k, t, k), (0, 3, 1, 2)).reshape(n, 1, k, t)
    allowed = allowed & (jnp.arange(t) <= i)
    every = jnp.broadcast_to(q.reshape(b, 1, k, HEADS, DIM), (b, k, k, HEADS, DIM))
    every = every.reshape(n, k, HEADS, DIM)  # each slot row scores its row's k queries
    out = 0.0
    for keys, values in caches:
        s = scores(every, keys, allowed).reshape(b, k, HEADS, k, t)  # [row, slot, h, hypothesis, t]
        m = jnp.max(s, axis=(1, 4), keepdims=True)
        e = jnp.exp(s - m)
        w = (e / jnp.sum(e, axis=(1, 4), keepdims=True)).reshape(n, HEADS, k, t)
        per_slot = jnp.einsum("nhrt,nhtd->nrhd", w, values).reshape(b, k, k, HEADS, DIM)
        out = out + per_slot.sum(axis=1).reshape(n, 1, HEADS, DIM)
    return out, slots[origin]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sources", type=int, default=32)
    parser.add_argument("--beams", type=int, default=4)
    parser.add_argument("--length", type=int, default=48, help="cache positions")
    parser.add_argument("--rounds", type=int, default=5)
    args = parser.parse_args()
    b, k, t = args.sources, args.beams, args.length
    n = b * k
    rng = np.random.default_rng(0)
    cache = lambda: jnp.asarray(rng.normal(size=(n, HEADS, t, DIM)), jnp.float32)
    caches = [(cache(), cache()) for _ in range(LAYERS)]
    q = jnp.asarray(rng.normal(size=(n, 1, HEADS, DIM)), jnp.float32)
    origin = jnp.asarray(rng.integers(0, k, n) + np.repeat(np.arange(b) * k, k), jnp.int32)
    slots = jnp.broadcast_to(jax.nn.one_hot(jnp.arange(n) % k, k, dtype=bool)[:, None], (n, t, k))

    @jax.jit
    def reorder(caches, q, steps):
        def body(j, c):
            caches, acc = c
            out, caches = reorder_step(caches, q + acc, origin, j % t)
            return caches, acc + 1e-6 * out

        # Every cache leaf is returned: a dropped one would let XLA skip its gathers.
        return lax_loop(body, steps, (caches, jnp.zeros_like(q)))

    @jax.jit
    def through_slots(caches, q, slots, steps):
        def body(j, c):
            slots, acc = c
            out, slots = slots_step(caches, q + acc, slots, origin, j % t, k)
            return slots, acc + 1e-6 * out

        return lax_loop(body, steps, (slots, jnp.zeros_like(q)))

    def per_step(fn, *a) -> float:
        times = {}
        for steps in (50, 100):
            jax.block_until_ready(fn(*a, steps))
            best = float("inf")
            for _ in range(args.rounds):
                start = time.perf_counter()
                jax.block_until_ready(fn(*a, steps))
                best = min(best, time.perf_counter() - start)
            times[steps] = best
        return (times[100] - times[50]) / 50 * 1e3

    # The same outputs: after j steps a row's reordered cache is the slot its table
    # names at every position (no new keys are written here).
    same = 1e6 * jnp.max(
        jnp.abs(reorder(caches, q, 10)[1] - through_slots(caches, q, slots, 10)[1])
    )
    assert float(same) < 1e-4, f"the two ways differ by {float(same)}"  # float32 sums
    base = per_step(reorder, caches, q)
    slot = per_step(through_slots, caches, q, slots)
    print(f"{b} sources x {k} beams, cache {t}, {LAYERS} layers, {jax.devices()[0].platform}")
    print(f"reorder, then attend:  {base:.2f} ms/step")
    print(f"attend through slots:  {slot:.2f} ms/step ({base / slot:.2f}x)")


def lax_loop(body, steps, carry):
    return jax.lax.fori_loop(0, steps, body, carry)


if __name__ == "__main__":
    main()
