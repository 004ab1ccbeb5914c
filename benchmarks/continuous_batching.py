"""Greedy decoding of a queue of sentences: batch by batch (translate's way: sorted
sources, batches of 32, each batch stepping until its last row ends, the tail shrunk)
against continuous batching (32 decoding rows; a row whose sentence ends takes the
next one).

  python benchmarks/continuous_batching.py             # the demo's shape
  python benchmarks/continuous_batching.py --tiny      # seconds, any machine

A model of the demo's shape with random weights and ``--sentences`` sources of 4-16
pieces at width 16, sorted by length. Each sentence's output length is its source's
plus a seeded normal draw (sd ``--spread`` pieces; at least 1), imposed as its limit
(no EOS can come first), so both ways run the same row-steps' worth of tokens and
must give the same ids (checked). ``--streams`` calls run at once, as translate runs
two batches on a CPU: the batches go to the streams in turn, and the sorted queue is
dealt to them for continuous batching. In one process, each way is timed warm
(median of ``--rounds``); prints the times, their ratio and the row-steps each decodes against
the steps the sentences need.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from decode_profile import DEMO, TINY  # noqa: E402  (the same two model shapes)

from flaxformer_lite.config.model import ModelConfig  # noqa: E402
from flaxformer_lite.inference import decoding  # noqa: E402
from flaxformer_lite.inference.continuous import greedy_continuous  # noqa: E402
from flaxformer_lite.model.partitioning import unbox  # noqa: E402
from flaxformer_lite.model.transformer import Transformer  # noqa: E402

EXTRA = 50  # translate's max_extra: a batch's cache holds its longest source + 50


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tiny", action="store_true")
    parser.add_argument("--sentences", type=int, default=256)
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--spread", type=float, default=3.0)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--streams", type=int, default=2, help="calls at once (decode.streams)")
    args = parser.parse_args()
    model = Transformer(ModelConfig(**(TINY if args.tiny else DEMO)))
    rng = np.random.default_rng(0)
    lengths = np.sort(rng.integers(4, 17, args.sentences))
    src = np.zeros((args.sentences, 16), np.int32)
    for r, n in enumerate(lengths):
        src[r, :n] = rng.integers(4, model.config.vocab_size, n)
        src[r, n - 1] = 1  # EOS
    out_len = np.maximum(1, np.round(lengths + rng.normal(0, args.spread, len(lengths))))
    out_len = out_len.astype(np.int32)
    size = decoding.bucket(16 + EXTRA, model.config.max_len)
    params = unbox(model.init(jax.random.key(0), src[:2], src[:2]))["params"]
    kw = dict(max_length=size, eos_id=-1, bos_id=2)
    b = args.batch

    pool = ThreadPoolExecutor(args.streams)
    # Continuous: the sorted queue dealt to the streams in turn (each a like mix).
    queues = [np.arange(s, len(src), args.streams) for s in range(args.streams)]

    def one_batch(i):
        rows, limit = jnp.asarray(src[i : i + b]), jnp.asarray(out_len[i : i + b])
        return jax.block_until_ready(decoding.sample(model, params, rows, limit=limit, **kw))

    def one_queue(q):
        rows, limit = jnp.asarray(src[q]), jnp.asarray(out_len[q])
        return jax.block_until_ready(
            greedy_continuous(model, params, rows, slots=b, limit=limit, count_rows=True, **kw)
        )

    def batched():
        return list(pool.map(one_batch, range(0, len(src), b)))

    def continuous():
        return list(pool.map(one_queue, queues))

    ids = np.zeros((len(src), size), np.int32)
    rows = 0
    for q, (got, steps) in zip(queues, continuous(), strict=True):
        ids[q], rows = np.asarray(got), rows + int(steps)
    np.testing.assert_array_equal(np.concatenate(batched()), ids)

    def timed(f) -> float:
        jax.block_until_ready(f())
        times = []
        for _ in range(args.rounds):
            start = time.perf_counter()
            jax.block_until_ready(f())
            times.append(time.perf_counter() - start)
        return statistics.median(times)

    t_batched, t_cont = timed(batched), timed(continuous)
    padded = sum(int(out_len[i : i + b].max()) * b for i in range(0, len(src), b))
    print(f"{len(src)} sentences, output lengths {out_len.mean():.1f} +- {out_len.std():.1f} "
          f"pieces, batches/slots of {b}, cache {size}, {args.streams} at once, "
          f"{jax.devices()[0].platform}")  # fmt: skip
    print(f"row-steps needed {int(out_len.sum())}; batches without shrinking {padded}; "
          f"continuous {int(rows)}")  # fmt: skip
    print(f"batch by batch: {t_batched:.3f} s   continuous: {t_cont:.3f} s   "
          f"({t_batched / t_cont:.2f}x)   outputs identical")  # fmt: skip


if __name__ == "__main__":
    main()
