"""Coverage vs depth of sparse attention patterns (no training: graph reachability).

  .venv/bin/python experiments/sparse_receptive_fields/run.py

Writes results.json, coverage.png, patterns.png and receptive.png next to this file.
One layer lets output i read input j when the pattern allows (i, j) (the residual
keeps i itself); L layers connect j to i iff a chain of allowed steps joins them,
the boolean power (A | I)^L (flaxformer_lite.sparse.grammar.analysis). Coverage is the
fraction of the pairs a dense layer connects (all pairs; for causal patterns the
pairs j <= i) that the stack connects.
"""

from __future__ import annotations

import json
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402

from flaxformer_lite.sparse.grammar import analysis  # noqa: E402
from flaxformer_lite.sparse.grammar import patterns as P  # noqa: E402

HERE = Path(__file__).resolve().parent
LENGTH = 1024
LAYERS = 12
PICTURE_LENGTH = 256  # the pattern pictures: the same patterns at a size one can see

# Patterns of similar cost: ~50-130 keys per query of 1,024 (a dense layer: 1,024).
# (name, pattern, the paper it comes from)
PATTERNS = [
    ("local", P.Local(48), "band |i-j| <= 48"),
    ("dilated", P.Dilated(window=48, dilation=4), "Longformer's dilated window, alone"),
    ("strided", P.Strided(32), "the strided half of Sparse Transformer, alone"),
    ("global", P.Global((0,)), "one global token, alone"),
    ("random", P.RandomBlocks(32, 3, seed=0), "BigBird's random blocks, alone"),
    ("local+dilated", P.Local(24) | P.Dilated(window=24, dilation=4), "mixed windows"),
    (
        "sparse_transformer_strided",
        P.sparse_transformer_strided(32),
        "Child et al. 2019, strided (local 31 + every 32nd)",
    ),
    ("sparse_transformer_fixed", P.Fixed(64, 1), "Child et al. 2019, fixed (64, summary 1)"),
    ("longformer", P.longformer(48, (0,)), "Beltagy et al. 2020: window 48 + 1 global"),
    (
        "bigbird",
        P.bigbird(16, 3, 1, 1),
        "Zaheer et al. 2020: blocks of 16, 3 window, 1 global, 1 random",
    ),
]
CAUSAL = [
    ("local (causal)", P.Local(96).causal()),
    ("sparse_transformer_strided (causal)", P.sparse_transformer_strided(64).causal()),
    ("sparse_transformer_fixed (causal)", P.Fixed(64, 2).causal()),
]


def measure(pattern: P.Pattern) -> dict:
    field = analysis.receptive_field(pattern, LENGTH, LAYERS)
    attainable = np.tril(np.ones((LENGTH, LENGTH), bool)) if pattern.is_causal else None
    if attainable is None:
        cover = field.mean(axis=(1, 2))
    else:
        cover = field[:, attainable].mean(axis=1)
    full = np.flatnonzero(cover >= 1.0)
    mask = pattern.mask(LENGTH)
    keys = mask[attainable].sum() / LENGTH if attainable is not None else mask.sum() / LENGTH
    return {
        "keys_per_query": float(keys),
        "coverage": [round(float(c), 6) for c in cover],
        "layers_to_cover": int(full[0]) + 1 if len(full) else None,
    }


def main() -> dict:
    results = {"length": LENGTH, "max_layers": LAYERS, "patterns": {}}
    for name, pattern, source in PATTERNS:
        results["patterns"][name] = {"source": source, "pattern": repr(pattern), **measure(pattern)}
    for name, pattern in CAUSAL:
        results["patterns"][name] = {
            "source": "causal",
            "pattern": repr(pattern),
            **measure(pattern),
        }
    (HERE / "results.json").write_text(json.dumps(results, indent=2) + "\n")

    # Coverage vs depth.
    fig, ax = plt.subplots(figsize=(7.5, 4.5))
    layers = np.arange(1, LAYERS + 1)
    for name, r in results["patterns"].items():
        style = "--" if "causal" in name else "-"
        ax.plot(
            layers,
            r["coverage"],
            style,
            marker="o",
            ms=3,
            label=f"{name} ({r['keys_per_query']:.0f})",
        )
    ax.set_xlabel("layers")
    ax.set_ylabel("coverage (fraction of pairs connected)")
    ax.set_title(f"Coverage vs depth, n = {LENGTH} (keys per query in brackets)", fontsize=10)
    ax.set_ylim(0, 1.02)
    ax.legend(fontsize=7, loc="lower right")
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(HERE / "coverage.png", dpi=110)
    plt.close(fig)

    # The patterns themselves, at a visible size.
    fig, axes = plt.subplots(2, 5, figsize=(15, 6.4))
    for ax, (name, pattern, _) in zip(axes.flat, PATTERNS, strict=True):
        ax.imshow(pattern.mask(PICTURE_LENGTH), cmap="Greys", interpolation="nearest")
        ax.set_title(name, fontsize=9)
        ax.set_xticks([])
        ax.set_yticks([])
    fig.suptitle(f"The patterns at n = {PICTURE_LENGTH} (black: query row attends key column)")
    fig.tight_layout()
    fig.savefig(HERE / "patterns.png", dpi=90)
    plt.close(fig)

    # Which inputs reach the middle output, layer by layer: dilated vs its fix vs BigBird.
    shown = ["dilated", "local+dilated", "bigbird"]
    fig, axes = plt.subplots(len(shown), 1, figsize=(8, 6.5))
    for ax, name in zip(axes, shown, strict=True):
        pattern = dict((n, p) for n, p, _ in PATTERNS)[name]
        field = analysis.receptive_field(pattern, LENGTH, 6)[:, LENGTH // 2, :]
        ax.imshow(field, cmap="Blues", aspect="auto", interpolation="nearest", vmin=0, vmax=1)
        ax.set_yticks(range(6), [f"L{i + 1}" for i in range(6)], fontsize=7)
        ax.set_title(f"{name}: inputs reaching output {LENGTH // 2}", fontsize=9)
    axes[-1].set_xlabel("input position")
    fig.tight_layout()
    fig.savefig(HERE / "receptive.png", dpi=90)
    plt.close(fig)
    return results


if __name__ == "__main__":
    for name, r in main()["patterns"].items():
        cover = r["coverage"]
        print(
            f"{name:38s} keys/query {r['keys_per_query']:6.1f}  L1 {cover[0]:.3f}  "
            f"L2 {cover[1]:.3f}  L3 {cover[2]:.3f}  L6 {cover[5]:.3f}  L12 {cover[11]:.3f}  "
            f"full at {r['layers_to_cover']}"
        )
