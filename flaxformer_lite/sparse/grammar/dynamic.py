"""The patterns whose keys depend on the content, as data (their kernels:
``sparse/ops/topk``, ``moba``, ``nsa``).

Which keys a query reads depends on the content, so these have no fixed mask or cover.
``TopK`` scores every key; MoBA and NSA read ``k`` blocks per query block, not every
score: sub-quadratic. They import nothing but the pattern
base, so the config validates them without JAX.
"""

from __future__ import annotations

import dataclasses

from flaxformer_lite.sparse.grammar import patterns
from flaxformer_lite.sparse.grammar.patterns import Pattern, _check_positive


@dataclasses.dataclass(frozen=True)
class Dynamic(Pattern):
    """The patterns whose keys depend on the content (``TopK``; MoBA and NSA in
    :mod:`~flaxformer_lite.sparse.grammar.dynamic`): no fixed rule or cover, their own kernels
    (``label`` and ``kernel`` name them in errors)."""

    label = "dynamic attention"
    kernel = "its own kernel"

    def _allows(self, i, j, n):
        raise ValueError(f"{self.label} has no fixed mask: its keys depend on the content")

    def _plans(self, n, block):
        raise ValueError(f"{self.label} has no fixed cover: it is computed by {self.kernel}")


@dataclasses.dataclass(frozen=True)
class TopK(Dynamic):
    """Each query keeps its ``k`` highest-scoring keys (Routing/learned-sparsity family):
    :func:`~flaxformer_lite.sparse.ops.topk.xla.topk_attention` (time n^2, memory ``block * n``)."""

    offset_invariant = True  # its own scores, within its segment

    k: int = 64
    label = "top-k attention"
    kernel = "sparse.topk"

    def __post_init__(self):
        _check_positive("topk", k=self.k)


@dataclasses.dataclass(frozen=True)
class MoBA(Dynamic):
    """``moba:block=B,k=K``: each query reads its own key block and the ``k - 1`` whose
    mean key best matches it (``block_gate=1``: one choice per query block, by its mean
    query; not causal): :mod:`~flaxformer_lite.sparse.ops.moba.xla`."""

    block: int = 64
    k: int = 3
    block_gate: bool = False
    label = "moba attention"
    kernel = "sparse.routed"

    def __post_init__(self):
        _check_positive("moba", block=self.block, k=self.k)
        if self.block_gate and self.is_causal:
            raise ValueError(
                "block_gate=1 routes a query block by all its queries, later ones too: "
                "not causal; use block_gate=0 where attention is causal (decoders, LMs)"
            )


@dataclasses.dataclass(frozen=True)
class NSA(Dynamic):
    """``nsa:block=B,k=K,window=W``: NSA's compressed, selected (``k`` blocks) and
    sliding ``window`` branches, mixed by learned gates:
    :mod:`~flaxformer_lite.sparse.ops.nsa.xla`."""

    block: int = 64
    k: int = 4
    window: int = 64
    label = "nsa attention"
    kernel = "sparse.nsa"

    def __post_init__(self):
        _check_positive("nsa", block=self.block, k=self.k, window=self.window)


# ``patterns.Dynamic`` and ``patterns.TopK``, where they were defined before this file held
# them, kept for one release (the sparse package imports this module with ``patterns``).
patterns.Dynamic, patterns.TopK = Dynamic, TopK
