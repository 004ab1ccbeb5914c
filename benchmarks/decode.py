"""Decoding speed against google/flax's examples/wmt, in the same process.

  python benchmarks/decode.py [--rounds 5]

Tiny shape (256 wide, 3+3 layers, 4 heads, FFN 1024, vocab 8000), batch 32, source
length 64, exactly 64 new tokens per sentence: EOS is set to an id no model emits,
so every method does the full work. Ours: cached greedy (decoding.sample at
temperature 0), beam 4 (decoding.beam_search, alpha 0.6) and uncached greedy (the
reference the cache is measured against). The peer (benchmarks/peer.py): its own
cache and ``decode.beam_search`` for beam 4 (as its ``predict_step``), and for
greedy the plain argmax loop over its cached decoder (its example has no greedy).
Rounds alternate ours and the peer's (order flipped every round); reported: the
peer's time / ours per round and the median over rounds, plus the cache speed-up
(uncached / cached greedy, target >= 10x) and beam-4 cost over greedy (<= 5x).
Writes benchmarks/results/decode.{json,md}.
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

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

import peer  # noqa: E402
from common import TINY  # noqa: E402

from flaxformer_lite.inference import decoding  # noqa: E402
from flaxformer_lite.model.transformer import Transformer  # noqa: E402

BATCH, SOURCE, NEW = 32, 64, 64
NEVER = -1  # an EOS id no argmax can produce: fixed-length decoding


def timed(fn) -> float:
    t = time.perf_counter()
    jax.block_until_ready(fn())
    return time.perf_counter() - t


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--out", default=str(ROOT / "benchmarks" / "results"))
    args = parser.parse_args()

    model = Transformer(TINY)
    inputs = jax.random.randint(jax.random.key(1), (BATCH, SOURCE), 3, TINY.vocab_size)
    params = jax.jit(model.init)(jax.random.key(0), inputs[:1], inputs[:1])["params"]
    peer_params = peer.init_params(TINY, SOURCE)
    kw = dict(max_length=NEW, eos_id=NEVER, bos_id=TINY.bos_id)
    ours = {
        "greedy": jax.jit(lambda p, x: decoding.sample(model, p, x, **kw)),
        "beam 4": jax.jit(
            lambda p, x: decoding.beam_search(model, p, x, beam_size=4, alpha=0.6, **kw)
        ),
    }
    theirs = {
        "greedy": jax.jit(lambda p, x: peer.greedy(TINY, p, x, max_len=NEW)),
        "beam 4": jax.jit(
            lambda p, x: peer.beam_search(TINY, p, x, beam_size=4, eos_id=NEVER, max_len=NEW)
        ),
    }
    uncached = jax.jit(lambda p, x: decoding.greedy_uncached(model, p, x, **kw))
    # Both do the full work: every row gets NEW tokens.
    assert int((ours["greedy"](params, inputs) != 0).sum(1).min()) == NEW
    assert theirs["beam 4"](peer_params, inputs).shape == (BATCH, NEW)
    for fn, p in [
        *((f, params) for f in ours.values()),
        *((f, peer_params) for f in theirs.values()),
    ]:
        jax.block_until_ready(fn(p, inputs))  # compile
    jax.block_until_ready(uncached(params, inputs))

    times = {f"{who} {m}": [] for who in ("ours", "peer") for m in ours}
    times["ours greedy (uncached)"] = []
    for i in range(args.rounds):
        order = [("ours", ours, params), ("peer", theirs, peer_params)]
        for who, fns, p in order if i % 2 == 0 else order[::-1]:
            for method, fn in fns.items():
                times[f"{who} {method}"].append(timed(functools.partial(fn, p, inputs)))
        if i < 3:
            times["ours greedy (uncached)"].append(timed(lambda: uncached(params, inputs)))
    med = {k: statistics.median(v) for k, v in times.items()}
    vs_peer = {
        m: statistics.median(
            [p / o for p, o in zip(times[f"peer {m}"], times[f"ours {m}"], strict=True)]
        )
        for m in ours
    }
    rows = [
        {
            "method": k,
            "seconds": med[k],
            "seconds_rounds": v,
            "new_tokens_per_s": BATCH * NEW / med[k],
        }
        for k, v in times.items()
    ]
    ratios = {
        "greedy_vs_peer": vs_peer["greedy"],
        "beam4_vs_peer": vs_peer["beam 4"],
        "cache_speedup": med["ours greedy (uncached)"] / med["ours greedy"],
        "beam4_over_greedy": med["ours beam 4"] / med["ours greedy"],
    }
    result = {
        "device": jax.devices()[0].device_kind,
        "batch": BATCH,
        "source": SOURCE,
        "new_tokens": NEW,
        "rounds": args.rounds,
        "rows": rows,
        "ratios": ratios,
    }
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "decode.json").write_text(json.dumps(result, indent=2))
    lines = [
        f"`python benchmarks/decode.py --rounds {args.rounds}`; {result['device']}; batch "
        f"{BATCH}, source {SOURCE}, {NEW} new tokens each; median of the rounds",
        "",
        "| method | seconds | new tokens/s |",
        "|---|---|---|",
    ]
    lines += [f"| {r['method']} | {r['seconds']:.3f} | {r['new_tokens_per_s']:.0f} |" for r in rows]
    lines += [
        "",
        f"cached greedy vs flax examples/wmt: **{ratios['greedy_vs_peer']:.2f}x** (target >= 1.3x)",
        f"beam 4 vs flax examples/wmt: **{ratios['beam4_vs_peer']:.2f}x** (target >= 1.3x)",
        f"KV cache speed-up over recomputing: {ratios['cache_speedup']:.1f}x (target >= 10x)",
        f"beam 4 cost over greedy: {ratios['beam4_over_greedy']:.2f}x (target <= 5x)",
    ]
    text = "\n".join(lines)
    (out / "decode.md").write_text(text + "\n")
    print(text)


if __name__ == "__main__":
    main()
