"""Receptive fields of stacked sparse layers, and pictures of patterns.

One attention layer lets output ``i`` read input ``j`` when the pattern allows
``(i, j)``; the residual connection also carries ``i`` to itself. After ``L``
layers, ``i`` can be reached from ``j`` iff there is a chain
``j = j_0 -> j_1 -> ... -> j_L = i`` of allowed (or identity) steps, i.e.
the boolean matrix power ``(A | I)^L``. This is what decides whether a
sparse model can, in principle, use the whole context:

* a band of half-width ``w`` reaches ``L w`` tokens after ``L`` layers;
* a dilated-only pattern never leaves its residue class: it never covers all;
* global tokens (Longformer, ETC, BigBird) connect everything in two layers.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

from flaxformer_lite.sparse.grammar import patterns as P
from flaxformer_lite.sparse.grammar.patterns import Pattern


def receptive_field(pattern: Pattern, length: int, num_layers: int) -> np.ndarray:
    """``[num_layers, length, length]`` bool: ``out[l, i, j]`` = input ``j`` reaches
    output ``i`` after ``l + 1`` layers (per-layer random draws via ``for_layer``)."""
    eye = np.eye(length, dtype=bool)
    reach = eye
    out = np.zeros((num_layers, length, length), bool)
    for layer in range(num_layers):
        step = pattern.for_layer(layer).mask(length) | eye
        reach = _compose(step, reach)
        out[layer] = reach
    return out


def _compose(step: np.ndarray, reach: np.ndarray) -> np.ndarray:
    """``new[i, j] = any_k step[i, k] & reach[k, j]``, as a float32 matrix product (BLAS;
    the counts are at most ``length`` < 2^24, so exact)."""
    return (step.astype(np.float32) @ reach.astype(np.float32)) > 0


def coverage(pattern: Pattern, length: int, num_layers: int) -> np.ndarray:
    """Fraction of (output, input) pairs connected after each of ``num_layers`` layers."""
    return receptive_field(pattern, length, num_layers).mean(axis=(1, 2))


def layers_to_cover(pattern: Pattern, length: int, max_layers: int = 64) -> int | None:
    """Fewest layers after which every output reaches every input (causal patterns:
    every earlier input); None if ``max_layers`` do not suffice."""
    eye = np.eye(length, dtype=bool)
    target = np.tril(np.ones((length, length), bool)) if pattern.is_causal else ~np.zeros_like(eye)
    reach = eye
    for layer in range(max_layers):
        step = pattern.for_layer(layer).mask(length) | eye
        reach = _compose(step, reach)
        if (reach | ~target).all():
            return layer + 1
    return None


def pattern_figure(pattern: Pattern, length: int, title: str | None = None):
    """A matplotlib Figure of the ``[length, length]`` attention matrix (black = attends)."""
    from matplotlib.figure import Figure  # no pyplot: a notebook's backend stays as it is

    mask = pattern.mask(length)
    fig = Figure(figsize=(4, 4), dpi=100)
    ax = fig.subplots()
    ax.imshow(mask, cmap="Greys", interpolation="nearest", vmin=0, vmax=1)
    ax.set_title(title or f"{_label(pattern)}  (density {mask.mean():.2f})", fontsize=8)
    ax.set_xlabel("key j")
    ax.set_ylabel("query i")
    fig.tight_layout()
    return fig


def receptive_field_figure(
    pattern: Pattern,
    length: int,
    num_layers: int,
    title: str | None = None,
    query: int | None = None,
):
    """A Figure: for one output position (default the middle), which inputs reach it
    after 1..num_layers layers (rows = layers), with the coverage per layer."""
    from matplotlib.figure import Figure

    field = receptive_field(pattern, length, num_layers)
    i = length // 2 if query is None else query
    rows = field[:, i, :]
    cov = field.mean(axis=(1, 2))
    fig = Figure(figsize=(6, 0.35 * num_layers + 1.2), dpi=100)
    ax = fig.subplots()
    ax.imshow(rows, cmap="Blues", aspect="auto", interpolation="nearest", vmin=0, vmax=1)
    ax.set_yticks(range(num_layers), [f"L{l + 1} ({c:.0%})" for l, c in enumerate(cov)], fontsize=7)
    ax.set_xlabel(f"input position (output {i})")
    ax.set_title(title or f"receptive field: {_label(pattern)}", fontsize=8)
    fig.tight_layout()
    return fig


def _save(fig, path: str | Path) -> Path:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path)
    return path


def plot_pattern(pattern: Pattern, length: int, path: str | Path, title: str | None = None):
    """PNG of :func:`pattern_figure` at ``path``; returns the path."""
    return _save(pattern_figure(pattern, length, title), path)


def plot_receptive_field(
    pattern: Pattern,
    length: int,
    num_layers: int,
    path: str | Path,
    title: str | None = None,
    query: int | None = None,
):
    """PNG of :func:`receptive_field_figure` at ``path``; returns the path."""
    return _save(receptive_field_figure(pattern, length, num_layers, title, query), path)


def _label(pattern: Pattern) -> str:
    text = repr(pattern)
    return text if len(text) < 70 else text[:67] + "..."


def gallery(out_dir: str | Path, length: int = 256, num_layers: int = 6) -> list[Path]:
    """The README's pictures: each catalogue pattern's matrix and some receptive fields."""
    out = Path(out_dir)
    shown = {
        "local": (P.Local(16), "Local(window=16)"),
        "dilated": (P.Dilated(8, 4), "Dilated(window=8, dilation=4)"),
        "sparse_strided": (
            P.sparse_transformer_strided(16).causal(),
            "Sparse Transformer strided, causal (stride 16)",
        ),
        "fixed": (P.Fixed(32, 4).causal(), "Sparse Transformer fixed, causal (32, summary 4)"),
        "longformer": (P.longformer(16, (0, 128)), "Longformer: window 16 + 2 global tokens"),
        "bigbird": (P.bigbird(16, 3, 1, 2), "BigBird: block 16, 3 window, 1 global, 2 random"),
    }
    paths = []
    for name, (pattern, title) in shown.items():
        density = pattern.mask(length).mean()
        paths.append(
            plot_pattern(pattern, length, out / f"pattern_{name}.png", f"{title}: {density:.1%}")
        )
    for name in ("local", "dilated", "bigbird"):
        pattern, title = shown[name]
        paths.append(
            plot_receptive_field(pattern, length, num_layers, out / f"receptive_{name}.png", title)
        )
    return paths


if __name__ == "__main__":
    import sys

    for p in gallery(sys.argv[1] if len(sys.argv) > 1 else "docs/sparse"):
        print(p)
