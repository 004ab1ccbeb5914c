"""What counting each packed sequence from its own start costs the sparse kernels.

  python benchmarks/packed_sparse_cost.py [--length 1024] [--rounds 3]

On packed rows a pattern that is not offset-invariant (blocks, global tokens, random
blocks; MoBA's and NSA's key blocks) runs on the row's sequences moved apart
(``sparse.ops.packing``: each longer than a block from a block boundary, in 1.5x the
row's blocks where they fit, else 2x + 1). This times the forward and backward pass of
one attention layer (float32, 8 rows of ``--length`` tokens, 4 heads of 32, blocks of
64) on packed rows, ``packed=True`` (each sequence as alone), against the same rows
through the kernels' unpacked path (``packed=False``: counted from the row's start, the
cost before; wrong for these patterns), in one process, alternating, median of
``--rounds``. Two mixes of sequence lengths: short ones (verse-like, 10-80 tokens) and
long ones (documents, 100-900). ``local`` is offset-invariant: the control, the same
path both ways. Writes benchmarks/results/packed_sparse_cost.{json,md}.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from flaxformer_lite.model import head_groups  # noqa: E402
from flaxformer_lite.sparse.grammar import spec  # noqa: E402
from flaxformer_lite.sparse.ops import packing  # noqa: E402
from flaxformer_lite.sparse.ops.nsa import xla as nsa  # noqa: E402

PATTERNS = [
    "local:window=127", "bigbird:window=3,global=1,random=1", "fixed:stride=64",
    "longformer:window=64,global=4", "moba:block=64,k=3", "nsa:block=64,k=2,window=64",
]  # fmt: skip
MIXES = {"short (10-80)": (10, 80), "long (100-900)": (100, 900)}
ROWS, HEADS, DIM, BLOCK = 8, 4, 32, 64


def _segments(length: int, lo: int, hi: int, seed: int = 0) -> np.ndarray:
    rng = np.random.default_rng(seed)
    seg = np.zeros((ROWS, length), np.int32)
    for r in range(ROWS):
        t, i = 0, 1
        while t < length:
            n = min(int(rng.integers(lo, hi + 1)), length - t)
            seg[r, t : t + n] = i
            t, i = t + n, i + 1
    return seg


def _step(pattern, packed: bool):
    params = {0: nsa.init_params(HEADS, DIM, DIM)}

    @jax.jit
    def step(q, k, v, segments):
        def loss(q, k, v):
            out = head_groups.multihead_sparse_attention(
                q, k, v, [pattern], impl="blocked", block_size=BLOCK, segments=segments,
                packed=packed, nsa_params=params,
            )  # fmt: skip
            return jnp.sum(out * out)

        return jax.grad(loss, argnums=(0, 1, 2))(q, k, v)

    return step


def _time(fn, *args) -> float:
    start = time.perf_counter()
    jax.block_until_ready(fn(*args))
    return time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--length", type=int, default=1024)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--out", default=str(ROOT / "benchmarks" / "results"))
    args = parser.parse_args()
    n = args.length
    rng = np.random.default_rng(0)
    q, k, v = (jnp.asarray(rng.normal(size=(ROWS, n, HEADS, DIM)), jnp.float32) for _ in range(3))
    rows = []
    for mix, (lo, hi) in MIXES.items():
        seg = _segments(n, lo, hi)
        seq = packing.sequences(jnp.asarray(seg))
        tight = packing.aligned_layout(seq, BLOCK, packing.tight_blocks(n, BLOCK))
        layout = "1.5x" if bool(tight.fits) else "2x + 1"
        for text in PATTERNS:
            (pattern,) = spec.parse_spec(text, BLOCK)[0]
            pattern = pattern.causal()
            fns = {p: _step(pattern, p) for p in (False, True)}
            for fn in fns.values():
                _time(fn, q, k, v, jnp.asarray(seg))  # compile
            times = {False: [], True: []}
            for _ in range(args.rounds):
                for p, fn in fns.items():
                    times[p].append(_time(fn, q, k, v, jnp.asarray(seg)))
            before, after = (float(np.median(times[p])) for p in (False, True))
            per_row = float(seg.max(1).mean())
            rows.append({"mix": mix, "pattern": text, "layout": layout,
                         "ratio": after / before, "sequences_per_row": per_row})  # fmt: skip
            print(rows[-1], flush=True)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "packed_sparse_cost.json").write_text(json.dumps(rows, indent=1) + "\n")
    lines = [
        "# Packed rows: each sequence from its own start, against counting from the row",
        "",
        f"`python benchmarks/packed_sparse_cost.py --length {n}`: forward + backward of one",
        f"causal attention layer, {ROWS} packed rows of {n} tokens, {HEADS} heads of {DIM},",
        f"blocks of {BLOCK}, float32, {jax.devices()[0].platform.upper()} "
        f"({jax.device_count()} device(s)); time with packed=True over packed=False on the",
        f"same rows, one process, alternating, median of {args.rounds}.",
        "",
        "| sequences | pattern | aligned layout | time vs from the row |",
        "|---|---|---|---:|",
        *(f"| {r['mix']}, {r['sequences_per_row']:.1f} a row | `{r['pattern']}` | "
          f"{r['layout']} | {r['ratio']:.2f}x |" for r in rows),
    ]  # fmt: skip
    (out / "packed_sparse_cost.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
