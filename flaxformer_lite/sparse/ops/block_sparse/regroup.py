"""A strided pattern's pairs made contiguous: positions regrouped by their residue.

A stride ``s`` (``Strided(s)``: ``(i - j) % s == 0``; ``Dilated(w, s)``: the same within
``w`` steps) pairs each query with keys of its own residue ``i % s``. In the original
order those keys are one in every ``s``, so every tile below the diagonal holds a few
of them (at 64k tokens, stride 128: a quarter of all tiles visited, 2.3% of their pairs
allowed). Regrouped, with residue ``r``'s positions ``r, r + s, r + 2s, ...`` in one run
of ``span`` slots (``slot = r * span + i // s``), they form one dense block per residue:
a causal block for ``Strided``, a band for ``Dilated``.

A pattern that is a stride plus other parts (the Sparse Transformer's
``Local(s - 1) | Strided(s)``) is computed in two parts that share no pair: the other
parts in the original order, the stride's remaining pairs in the regrouped order; the
kernel merges the two by their log-sum-exps
(:mod:`~flaxformer_lite.sparse.ops.block_sparse.pallas_triton`).
"""

from __future__ import annotations

import dataclasses
import functools

import numpy as np

from flaxformer_lite.sparse.grammar import patterns as P
from flaxformer_lite.sparse.grammar.plans import Plans
from flaxformer_lite.sparse.grammar.tiles import TilePlan, tile_plan

_OFFSET_RULES = (P.Full, P.Local, P.Dilated, P.Strided)  # rules of i - j alone


def _of_offsets(pattern) -> bool:
    if isinstance(pattern, P.Union | P.Intersection):
        return all(_of_offsets(p) for p in pattern.parts)
    return type(pattern) in _OFFSET_RULES


def _of_runs(pattern, stride: int) -> bool:
    """Whether, on positions regrouped by ``stride``, the rule depends only on the runs'
    offsets and residues (see :meth:`Residues.tile_keys`)."""
    if isinstance(pattern, P.Union | P.Intersection):
        return all(_of_runs(p, stride) for p in pattern.parts)
    if type(pattern) is P.Fixed:
        return pattern.stride == stride
    if type(pattern) is P.BlockLocal:
        return pattern.block_size == stride
    return type(pattern) in _OFFSET_RULES


def regrouping(pattern) -> tuple[int, P.Pattern | None] | None:
    """(stride, the rest computed in the original order, or None) of a pattern whose
    stride pays to regroup: a ``Strided``/``Dilated`` pattern, a union holding one of
    them beside rules of ``i - j`` alone (a window), or ``Fixed`` (its summary columns
    regrouped, its chunks in the original order). None for anything else."""
    kind = type(pattern)
    if kind is P.Fixed and pattern.summary < pattern.stride:
        # Its summary columns are residues s - c .. s - 1: contiguous once regrouped,
        # beside the same-chunk blocks (the rest, in the original order).
        same_chunk = P.BlockLocal(pattern.stride, 0)
        return pattern.stride, (same_chunk.causal() if pattern.is_causal else same_chunk)
    if kind is P.Strided:
        return (pattern.stride, None) if pattern.stride > 1 else None
    if kind is P.Dilated:
        return (pattern.dilation, None) if pattern.dilation > 1 else None
    if kind is not P.Union:
        return None
    strided = [p for p in pattern.parts if type(p) in (P.Strided, P.Dilated)]
    others = [p for p in pattern.parts if type(p) not in (P.Strided, P.Dilated)]
    if len(strided) != 1 or not others or not all(_of_offsets(p) for p in others):
        return None
    stride = getattr(strided[0], "stride", None) or strided[0].dilation
    if stride < 2:
        return None
    rest = others[0] if len(others) == 1 else P.Union(tuple(others))
    return stride, (rest.causal() if pattern.is_causal else rest)


@dataclasses.dataclass(frozen=True)
class Residues:
    """The pairs of ``pattern`` that ``rest`` does not hold, on slots regrouped by the
    residue of ``stride``: a rule over slots in the form :func:`tile_plan` reads
    (``allows``, ``plans``, ``tile_keys``). Slot ``r * span + q`` is position
    ``q * stride + r``, empty (allowing nothing) where that is ``>= n``."""

    pattern: P.Pattern
    rest: P.Pattern | None
    stride: int
    n: int
    span: int
    is_causal = False  # causality is in the rule of ``pattern``

    def positions(self, slots):
        """The original position of each slot, -1 for an empty one."""
        r, q = slots // self.span, slots % self.span
        p = q * self.stride + r
        return np.where((p < self.n) & (r < self.stride), p, -1)

    def allows(self, i, j, n_slots: int):
        pi, pj = self.positions(i), self.positions(j)
        qi, kj = np.maximum(pi, 0), np.maximum(pj, 0)
        ok = (pi >= 0) & (pj >= 0) & self.pattern.allows(qi, kj, self.n)
        if self.rest is not None:
            ok = ok & ~self.rest.allows(qi, kj, self.n)
        return ok

    def plans(self, n_slots: int, block: int) -> Plans:
        return Plans(strides=(1,))  # every tile is a candidate; tile_keys sorts them out

    def tile_keys(self, i0, j0, bq: int, bk: int):
        """The pairs of a tile depend on its offset within the residue runs, the two
        residues' difference (``i - j`` is ``(q_i - q_j) s + r_i - r_j``; same chunk of
        ``s`` is ``q_i == q_j``), whether the key residue is a fixed pattern's summary
        column, and how many of its slots hold a position (a prefix of each run)."""
        rules = (self.pattern,) if self.rest is None else (self.pattern, self.rest)
        if not all(_of_runs(p, self.stride) for p in rules):
            return None
        rq, rk, qq, qk = i0 // self.span, j0 // self.span, i0 % self.span, j0 % self.span
        full_q = -(-(self.n - rq) // self.stride)  # positions of residue rq
        full_k = -(-(self.n - rk) // self.stride)
        summary = getattr(self.pattern, "summary", 0)
        return np.stack(
            [qq - qk, rq - rk, rk >= self.stride - summary, np.clip(full_q - qq, 0, bq),
             np.clip(full_k - qk, 0, bk)],
            axis=1,
        )  # fmt: skip


@dataclasses.dataclass(frozen=True, eq=False)
class Part:
    """One part of a pattern's pairs: its tile plan over slots, and ``slots`` (the
    original position of each slot, -1 = empty; None: the original order itself)."""

    plan: TilePlan
    slots: np.ndarray | None = None


@functools.lru_cache(maxsize=64)
def pattern_parts(
    pattern, n: int, bq: int, bk: int, regroup: bool | None = None
) -> tuple[Part, ...]:
    """The parts a kernel computes ``pattern`` in (one, or a window in the original
    order and a stride regrouped), disjoint and together exactly its pairs.

    ``regroup``: None = regroup a stride where that visits fewer tiles and its runs,
    padded to the tile, take at most twice the slots of the original order (a short
    sequence's residues hold a few positions each: at 256 tokens and stride 128, two
    per run of 64 slots); True = wherever the pattern has a stride; False = never."""
    whole = (Part(tile_plan(pattern, n, bq, bk)),)
    split = regrouping(pattern) if regroup is not False else None
    if split is None:
        return whole
    stride, rest = split
    block = max(bq, bk)
    per_residue = -(-n // stride)
    span = -(-per_residue // block) * block  # positions per residue, to the tile
    if regroup is None and stride * span > 2 * whole[0].plan.m:
        return whole
    framed = Residues(pattern, rest, stride, n, span)
    regrouped = Part(
        tile_plan(framed, stride * span, bq, bk), framed.positions(np.arange(stride * span))
    )
    parts = (regrouped,) if rest is None else (Part(tile_plan(rest, n, bq, bk)), regrouped)
    if regroup is None and sum(p.plan.tiles for p in parts) >= whole[0].plan.tiles:
        return whole
    return parts
