"""Where a decoding step's time goes: the model, the cache reorder, the search's
bookkeeping, and the loop.

  python benchmarks/decode_profile.py                  # the demo's shape (ende_small)
  python benchmarks/decode_profile.py --tiny           # seconds, any machine

A model of the demo's shape with random weights (a step costs the same whatever the
weights), a batch of ``--batch`` sources of ``--source`` pieces, every search forced to
run exactly ``--steps`` steps (EOS forbidden before them). In one process, each
program is timed warm (median of ``--rounds``) and divided by the steps:

- ``search``: the whole search (:func:`~flaxformer_lite.inference.decoding.beam_search`
  or greedy :func:`~flaxformer_lite.inference.decoding.sample`), with the encoder, the
  cross-attention projections and the shrinking off (every row runs every step);
- ``model``: the same number of cached decoder steps alone (the stepper in a
  ``while_loop``: embeddings, layers, logits; tokens fed back by argmax of row 0);
- ``reorder``: the beam search's cache reorder alone (``take_cache_rows``, every step);
- ``loop``: an empty ``while_loop`` of the same steps carrying the cache (XLA's loop and
  the carry's copies, if any);
- ``bookkeeping``: search - model - reorder (log-softmax, constraints, top-2k, the
  sequences and scores, the stop rule).

Prints one line per part and writes benchmarks/results/decode_profile.{json,md}.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import jax
import jax.numpy as jnp
from jax import lax

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from flaxformer_lite.config.model import ModelConfig  # noqa: E402
from flaxformer_lite.inference import decoding  # noqa: E402
from flaxformer_lite.inference.stepping import Stepper, take_cache_rows  # noqa: E402
from flaxformer_lite.model.partitioning import unbox  # noqa: E402
from flaxformer_lite.model.transformer import Transformer  # noqa: E402

# configs/ende_small.py's model (the demo's), as translate runs it
DEMO = dict(vocab_size=8000, d_model=256, num_heads=4, d_ff=1024, num_encoder_layers=3,
            num_decoder_layers=3, max_len=256, ln_position="pre")  # fmt: skip
TINY = dict(vocab_size=200, d_model=32, num_heads=2, d_ff=64, num_encoder_layers=1,
            num_decoder_layers=1, max_len=64, ln_position="pre")  # fmt: skip


def timed(f, *args, rounds: int) -> float:
    """Median seconds of ``rounds`` warm calls (one warm-up call first)."""
    jax.block_until_ready(f(*args))
    times = []
    for _ in range(rounds):
        start = time.perf_counter()
        jax.block_until_ready(f(*args))
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def _touch(tree) -> jax.Array:
    """A scalar that reads every leaf (so that XLA keeps every loop-carried value: one
    leaf alone would let it drop the others' work)."""
    return sum(jnp.sum(x[:1].astype(jnp.float32)) for x in jax.tree.leaves(tree) if x.ndim)


def _profile(model, params, src, k: int, t: int, L: int, rounds: int) -> dict[str, float]:
    """ms per step of each part: (time of 2t steps - time of t steps) / t, the steps a
    traced argument, so that one program of each part runs both (its fixed costs, the
    encoder and the cache's making, cancel)."""
    b = src.shape[0]
    n = b * k

    def search(p, s, steps):
        forced = jnp.full((b,), steps, jnp.int32)  # EOS forbidden before the last step
        if k == 1:
            return decoding.sample(model, p, s, max_length=2 * t, eos_id=1, bos_id=2,
                                   shrink=0, limit=forced)  # fmt: skip
        return decoding.beam_search(model, p, s, beam_size=k, alpha=0.6, max_length=2 * t,
                                    eos_id=1, bos_id=2, min_lengths=forced, shrink=0,
                                    limit=steps)[0]  # fmt: skip

    def start(p, s):
        stepper = Stepper(model, p, s, repeat=k)
        return stepper, stepper.init_cache(n, L)

    def model_steps(p, s, steps):
        stepper, cache = start(p, s)
        inputs = jnp.repeat(s, k, axis=0)

        def body(i, c):
            tokens, cache = c
            logits, cache = stepper(cache, tokens, inputs)
            nxt = jnp.argmax(logits[:1], axis=-1).astype(jnp.int32)
            return jnp.broadcast_to(nxt[:, None], (n, 1)), cache

        return lax.fori_loop(0, steps, body, (jnp.full((n, 1), 2, jnp.int32), cache))[0]

    def reorder_steps(p, s, steps):
        _, cache = start(p, s)

        def body(i, cache):
            rows = (jnp.arange(n) // k) * k + (jnp.arange(n) + i) % k  # another beam
            return take_cache_rows(cache, rows, beams_only=True)

        return _touch(lax.fori_loop(0, steps, body, cache))

    def loop_steps(p, s, steps):
        _, cache = start(p, s)
        return _touch(lax.fori_loop(0, steps, lambda i, c: jax.tree.map(lambda x: x + 0, c), cache))

    parts = {"search": search, "model": model_steps, "loop": loop_steps}
    if k > 1:
        parts["reorder"] = reorder_steps
    out = {"rows": n}
    for name, fn in parts.items():
        f = jax.jit(fn)
        one, two = (timed(f, params, src, jnp.int32(x), rounds=rounds) for x in (t, 2 * t))
        out[name] = 1e3 * (two - one) / t
    out["bookkeeping"] = out["search"] - out["model"] - out.get("reorder", 0.0)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tiny", action="store_true")
    parser.add_argument("--batch", type=int, default=32, help="source sentences")
    parser.add_argument("--source", type=int, default=16, help="pieces per source")
    parser.add_argument("--steps", type=int, default=16, help="decoding steps (forced)")
    parser.add_argument("--beam", type=int, default=4)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--out", default=str(ROOT / "benchmarks" / "results"))
    args = parser.parse_args()
    config = ModelConfig(**(TINY if args.tiny else DEMO))
    model = Transformer(config)
    src = jax.random.randint(jax.random.key(1), (args.batch, args.source), 3, config.vocab_size)
    params = unbox(model.init(jax.random.key(0), src[:, :4], src[:, :4]))["params"]
    t = args.steps
    L = decoding.bucket(2 * t + 1, config.max_len)
    rows = {}
    for mode, k in (("greedy", 1), (f"beam {args.beam}", args.beam)):
        rows[mode] = _profile(model, params, src, k, t, L, args.rounds)
        r = rows[mode]
        names = [x for x in ("model", "reorder", "bookkeeping", "loop") if x in r]
        shares = ", ".join(f"{x} {r[x]:.3f} ms ({r[x] / r['search']:.0%})" for x in names)
        head = f"{mode}: {r['rows']} rows, cache {L}: search {r['search']:.3f} ms/step"
        print(f"{head} = {shares}", flush=True)
    shape = "tiny" if args.tiny else "ende_small"
    result = {"shape": shape, "batch": args.batch, "source": args.source, "steps": t,
              "cache": L, "backend": jax.default_backend(), "ms_per_step": rows}  # fmt: skip
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    suffix = "_tiny" if args.tiny else ""
    (out / f"decode_profile{suffix}.json").write_text(json.dumps(result, indent=2) + "\n")
    lines = [f"`python benchmarks/decode_profile.py{' --tiny' if args.tiny else ''}`: {shape}, "
             f"{args.batch} sources of {args.source} pieces, steps {t} -> {2 * t} (forced), "
             f"cache {L}, {jax.default_backend()}; ms per step (share of the search)", "",
             "| mode | rows | search | model | reorder | bookkeeping | loop |",
             "|---|---:|---:|---:|---:|---:|---:|"]  # fmt: skip
    for mode, r in rows.items():
        cells = [f"{r[key]:.3f} ({r[key] / r['search']:.0%})" if key in r else "—"
                 for key in ("model", "reorder", "bookkeeping", "loop")]  # fmt: skip
        lines.append(f"| {mode} | {r['rows']} | {r['search']:.3f} | " + " | ".join(cells) + " |")
    (out / f"decode_profile{suffix}.md").write_text("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
