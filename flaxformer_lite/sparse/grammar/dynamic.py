"""The block-routed dynamic patterns as data (their kernels: ``routed``, ``nsa``).

Like :class:`~flaxformer_lite.sparse.grammar.patterns.TopK`, which keys a query reads depends on
the content, so these have no fixed mask or cover; unlike it, they read ``k`` blocks
per query block, not every score: sub-quadratic. They import nothing but the pattern
base, so the config validates them without JAX.
"""

from __future__ import annotations

import dataclasses

from flaxformer_lite.sparse.grammar.patterns import Dynamic, _check_positive


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
