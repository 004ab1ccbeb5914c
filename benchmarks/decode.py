"""Decoding speed: cached greedy, beam 4, and uncached greedy (the reference).

  python benchmarks/decode.py [--repeats 3]

Tiny config (256 wide, 3+3 layers, 4 heads, FFN 1024, vocab 8000), batch 32,
source length 64, exactly 64 new tokens per sentence: EOS is set to an id
the model never emits, so every method does the full work. Reports new
(output) tokens per second and the ratios measured in this one process:
cache speed-up over recomputation (target >= 10x) and beam-4 cost over greedy
(target <= 5x). Writes benchmarks/results/decode.{json,md}.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import jax

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

from common import TINY  # noqa: E402

from flaxformer_lite import decoding  # noqa: E402
from flaxformer_lite.architectures.transformer import Transformer  # noqa: E402

BATCH, SOURCE, NEW = 32, 64, 64
NEVER = -1  # an EOS id no argmax can produce: fixed-length decoding


def timed(fn, repeats: int) -> float:
    jax.block_until_ready(fn())  # compile
    times = []
    for _ in range(repeats):
        t = time.perf_counter()
        jax.block_until_ready(fn())
        times.append(time.perf_counter() - t)
    return statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--out", default=str(ROOT / "benchmarks" / "results"))
    args = parser.parse_args()

    model = Transformer(TINY)
    inputs = jax.random.randint(jax.random.key(1), (BATCH, SOURCE), 3, TINY.vocab_size)
    params = jax.jit(model.init)(jax.random.key(0), inputs[:1], inputs[:1])["params"]
    kw = dict(max_length=NEW, eos_id=NEVER, bos_id=TINY.bos_id)
    runs = {
        "greedy (cached)": lambda: decoding.sample(model, params, inputs, **kw),
        "beam 4 (cached)": lambda: decoding.beam_search(
            model, params, inputs, beam_size=4, alpha=0.6, **kw
        ),
        "greedy (uncached)": lambda: decoding.greedy_uncached(model, params, inputs, **kw),
    }
    # Check the fixed length really is reached.
    assert int((decoding.sample(model, params, inputs, **kw) != 0).sum(1).min()) == NEW
    seconds = {name: timed(fn, args.repeats) for name, fn in runs.items()}
    seconds["greedy (cached), again"] = timed(runs["greedy (cached)"], args.repeats)
    greedy = min(seconds["greedy (cached)"], seconds["greedy (cached), again"])
    rows = [
        {"method": name, "seconds": s, "new_tokens_per_s": BATCH * NEW / s}
        for name, s in seconds.items()
    ]
    ratios = {
        "cache_speedup": seconds["greedy (uncached)"] / greedy,
        "beam4_over_greedy": seconds["beam 4 (cached)"] / greedy,
    }
    result = {
        "device": jax.devices()[0].device_kind,
        "batch": BATCH,
        "source": SOURCE,
        "new_tokens": NEW,
        "rows": rows,
        "ratios": ratios,
    }
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "decode.json").write_text(json.dumps(result, indent=2))
    lines = ["| method | seconds | new tokens/s |", "|---|---|---|"]
    lines += [f"| {r['method']} | {r['seconds']:.3f} | {r['new_tokens_per_s']:.0f} |" for r in rows]
    lines += [
        "",
        f"KV cache speed-up over recomputing: {ratios['cache_speedup']:.1f}x (target >= 10x)",
        f"beam 4 cost over greedy: {ratios['beam4_over_greedy']:.2f}x (target <= 5x)",
    ]
    text = "\n".join(lines)
    (out / "decode.md").write_text(text + "\n")
    print(text)


if __name__ == "__main__":
    main()
