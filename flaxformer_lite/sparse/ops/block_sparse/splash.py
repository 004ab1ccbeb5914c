"""TPU splash attention's mask of a pattern (``attention_impl=splash``): splash's own
mask classes where one computes the pattern (dense, causal, a window, chunked causal),
else a mask read block by block from the pattern's tile plan
(:mod:`~flaxformer_lite.sparse.grammar.tiles`, the plan the GPU's block-sparse kernel runs on),
so that no ``[n, n]`` array is formed (a ``NumpyMask`` of it was 4 GB at 64k tokens).
Splash is imported when a mask is made: nothing here runs without it.
"""

from __future__ import annotations

import functools

import numpy as np

from flaxformer_lite.sparse.grammar import patterns as P
from flaxformer_lite.sparse.grammar.tiles import TilePlan, tile_plan


def splash_mask(pattern: P.Pattern, n: int, block: int):
    from jax.experimental.pallas.ops.tpu.splash_attention import splash_attention_mask as M

    shape = (n, n)
    kind = type(pattern)
    if kind is P.Full:
        return M.CausalMask(shape) if pattern.is_causal else M.FullMask(shape)
    if kind is P.Local:
        w = pattern.window
        return M.LocalMask(shape, (w, 0 if pattern.is_causal else w), offset=0)
    if kind is P.BlockLocal and pattern.radius == 0 and pattern.is_causal:
        return M.ChunkedCausalMask(shape, pattern.block_size)
    return _plan_mask_class()(tile_plan(pattern, n, block, block), pattern)


@functools.cache
def _plan_mask_class():
    """A splash mask read from the tile plan the GPU's block-sparse kernel uses: splash
    asks for the mask block by block, and a block is empty, full or one of the plan's
    few partial masks, so no ``[n, n]`` array is formed (a ``NumpyMask`` of it was 4 GB
    at 64k tokens)."""
    from jax.experimental.pallas.ops.tpu.splash_attention import splash_attention_mask as M

    class PlanMask(M.Mask):
        def __init__(self, plan: TilePlan, pattern: P.Pattern):
            self.plan, self.pattern, self.grid = plan, pattern, plan.tile_mask()

        @property
        def shape(self) -> tuple[int, int]:
            return (self.plan.n, self.plan.n)

        def __getitem__(self, idx) -> np.ndarray:
            rows, cols = (range(*s.indices(self.plan.n)) for s in idx)
            if rows.step != 1 or cols.step != 1:
                raise NotImplementedError(f"PlanMask takes contiguous slices, not {idx}")
            plan, out = self.plan, np.zeros((len(rows), len(cols)), bool)
            for a in range(rows.start // plan.bq, -(-rows.stop // plan.bq)):
                for b in range(cols.start // plan.bk, -(-cols.stop // plan.bk)):
                    if self.grid[a, b] < 0:
                        continue
                    r0, r1 = max(a * plan.bq, rows.start), min((a + 1) * plan.bq, rows.stop)
                    c0, c1 = max(b * plan.bk, cols.start), min((b + 1) * plan.bk, cols.stop)
                    tile = plan.masks[self.grid[a, b]]
                    out[r0 - rows.start : r1 - rows.start, c0 - cols.start : c1 - cols.start] = (
                        tile[
                            r0 - a * plan.bq : r1 - a * plan.bq, c0 - b * plan.bk : c1 - b * plan.bk
                        ]
                    )
            return out

        def __eq__(self, other: object) -> bool:
            return isinstance(other, PlanMask) and (self.pattern, self.shape) == (
                other.pattern,
                other.shape,
            )

        def __hash__(self) -> int:
            return hash((type(self).__name__, self.pattern, self.shape))

    return PlanMask
