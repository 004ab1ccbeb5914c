"""Activation memory per ``model.remat`` policy: what a training step saves for its
backward pass (``training/activations.saved_bytes``: the residuals of ``jax.vjp``,
shapes only, nothing runs), for a long-context LM (4k and 16k tokens; dense, a
local window and BigBird) and for paper_base (translation, 256 source and target
tokens, 8 sentences). Writes benchmarks/results/remat.md.

  python benchmarks/remat.py [--lengths 4096,16384]

Goal: ``full`` keeps at least 3x less than ``none`` at 16k tokens. What each policy
keeps: none (everything), full (each layer's input), dots (the projections' and the
FFN's matmul outputs; attention's scores and softmax, norms, activations and dropout
recomputed), dots_all (every matmul output, the attention scores too).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402

from flaxformer_lite.config.model import PRESETS, REMAT_POLICIES, ModelConfig  # noqa: E402
from flaxformer_lite.model.lm import LanguageModel  # noqa: E402
from flaxformer_lite.model.partitioning import unbox  # noqa: E402
from flaxformer_lite.model.transformer import Transformer  # noqa: E402
from flaxformer_lite.training.activations import saved_bytes  # noqa: E402

# A long-context LM of the size configs/lm_long_sparse.py trains (6 layers of 512).
LM = dict(vocab_size=8000, d_model=512, num_heads=8, d_ff=2048, num_decoder_layers=6)
PATTERNS = {"dense": "dense", "local:window=256": "local:window=256", "bigbird": "bigbird"}


def _saved(model, *inputs) -> int:
    params = jax.eval_shape(lambda: unbox(model.init(jax.random.key(0), *inputs))["params"])

    def loss(p):
        out = model.apply(
            {"params": p}, *inputs, deterministic=False, rngs={"dropout": jax.random.key(1)}
        )
        return jnp.mean(out.astype(jnp.float32))

    return saved_bytes(loss, params)


def cases(lengths: list[int]):
    for n in lengths:
        for name, spec in PATTERNS.items():
            config = ModelConfig(**LM, max_len=n, attention_pattern=spec)
            tokens = jnp.ones((1, n), jnp.int32)
            yield f"LM {n // 1024}k, {name}", lambda c=config, t=tokens: (LanguageModel(c), t)
    base = PRESETS["paper_base"]
    src, tgt = jnp.ones((8, 256), jnp.int32), jnp.ones((8, 256), jnp.int32)
    yield "paper_base, 8 x 256 tokens", lambda: (Transformer(base), src, tgt)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--lengths", default="4096,16384")
    args = parser.parse_args()
    lengths = [int(x) for x in args.lengths.split(",")]
    head = " | ".join(REMAT_POLICIES)
    lines = [
        "# Activation memory per model.remat policy (MiB saved for the backward pass)",
        "",
        f"`python benchmarks/remat.py --lengths {args.lengths}`",
        "",
        f"| model | {head} | none / full |",
        "|---|" + "---:|" * (len(REMAT_POLICIES) + 1),
    ]
    for name, build in cases(lengths):
        model, *inputs = build()
        sizes = {}
        for policy in REMAT_POLICIES:
            model = model.__class__(model.config.replace(remat=policy))
            sizes[policy] = _saved(model, *inputs)
        cells = " | ".join(f"{sizes[p] / 2**20:,.1f}" for p in REMAT_POLICIES)
        line = f"| {name} | {cells} | {sizes['none'] / sizes['full']:.1f}x |"
        print(line, flush=True)
        lines.append(line)
    out = ROOT / "benchmarks" / "results" / "remat.md"
    out.write_text("\n".join(lines) + "\n")
    print(f"wrote {out.relative_to(ROOT)}")


if __name__ == "__main__":
    main()
