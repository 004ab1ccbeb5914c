"""Packed rows in each sequence's own coordinates: what the kernels share to make packing
invisible to a pattern counted from a sequence's start.

A packed row holds several sequences, each a contiguous run of one nonzero segment id
(0 is padding). A pattern whose pairs depend on more than ``i - j`` (blocks, global
tokens, random blocks, chunks) must see each sequence as it would see it alone in a row
of the same length, padded: the rule evaluated at positions from the sequence's start,
``pattern.allows(pos_i, pos_j, n)`` with ``n`` the row's length, and only between tokens
of one run. That is "packed == padded" exactly: a sequence of length ``L`` padded to
``n`` is the sequence at positions ``0..L-1`` of a row of length ``n``.

:func:`sequences` finds each token's run and position; :func:`aligned_layout` moves the
runs of a row apart so that each starts on a multiple of the kernel block (the blocked
kernel then reads each sequence's blocks from one static table, shifted by where the
sequence starts); :func:`to_aligned` / :func:`from_aligned` move arrays there and back.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax import Array, lax


@dataclasses.dataclass(frozen=True)
class Sequences:
    """Each token of ``[b, n]`` segment ids in its own sequence.

    ``run``: 1-based index of its sequence (contiguous run of one nonzero id) in the
    row, 0 for padding; ``pos``: its position from the run's start (0 for padding);
    ``length``: its run's length (0 for padding)."""

    run: Array
    pos: Array
    length: Array


jax.tree_util.register_dataclass(Sequences, ["run", "pos", "length"], [])


def sequences(segments: Array) -> Sequences:
    """The runs of ``[b, n]`` segment ids (0 = padding): a new run starts wherever the id
    changes to a nonzero one, so two neighbours with the same id are one sequence."""
    b, n = segments.shape
    real = segments != 0
    before = jnp.pad(segments[:, :-1], ((0, 0), (1, 0)))
    starts = real & (segments != before)
    run = jnp.where(real, jnp.cumsum(starts, axis=1), 0).astype(jnp.int32)
    t = jnp.arange(n, dtype=jnp.int32)
    first = lax.cummax(jnp.where(starts, t, 0), axis=1)
    pos = jnp.where(real, t - first, 0)
    counts = jax.vmap(lambda r: jnp.zeros(n + 1, jnp.int32).at[r].add(1))(run)
    length = jnp.where(real, jnp.take_along_axis(counts, run, axis=1), 0)
    return Sequences(run, pos, length)


@dataclasses.dataclass(frozen=True)
class Aligned:
    """A row's sequences moved apart so that no block of ``block`` slots mixes a sequence
    that spans blocks with another one.

    ``dest`` ``[b, n]``: each token's slot in the aligned row of ``blocks * block``
    slots (that number for padding, and for tokens that did not fit); ``src``
    ``[b, slots]``: the token each slot holds (``n``: empty). Per slot: its sequence's
    ``run`` (0: empty), ``pos`` in it, its ``length``, ``ids``: a segment id per
    sequence that grows along the aligned row (empty slots 0), and ``long``: its sequence
    has its own blocks. Per block: ``start``, the first block of its sequence (for blocks
    of ``long`` sequences). ``fits``: every row's sequences fit."""

    block: int
    dest: Array
    src: Array
    run: Array
    pos: Array
    length: Array
    ids: Array
    long: Array
    start: Array
    fits: Array

    @property
    def blocks(self) -> int:
        return self.src.shape[1] // self.block


jax.tree_util.register_dataclass(
    Aligned, ["dest", "src", "run", "pos", "length", "ids", "long", "start", "fits"], ["block"]
)


def guaranteed_blocks(n: int, block: int) -> int:
    """Aligned blocks that always hold a row of ``n`` tokens under :func:`aligned_layout`
    with ``share=True``: a sequence longer than ``block`` takes ``ceil(L / block) <
    2 L / block`` blocks; the shorter ones, laid end to end, take ``ceil(T / block)``
    blocks plus one for each that would cross a boundary (at most one a boundary):
    ``2 n / block + 1`` in all."""
    return 2 * (-(-n // block)) + 1


def aligned_layout(seq: Sequences, block: int, blocks: int | None = None,
                   share: bool = True) -> Aligned:  # fmt: skip
    """Each sequence of ``seq`` longer than ``block`` from a multiple of ``block`` (its own
    blocks, in row order); with ``share``, the others end to end after them, each inside
    one block (one that would cross a boundary gets a block of its own, after the
    rest), else each from a block of its own too. ``blocks``: the aligned row's blocks
    (default :func:`guaranteed_blocks`). Computed with cumulative sums, no loop."""
    b, n = seq.run.shape
    B = block
    blocks = guaranteed_blocks(n, B) if blocks is None else blocks
    slots = blocks * B
    per_run = jax.vmap(lambda r, x: jnp.zeros(n + 1, jnp.int32).at[r].max(x))
    length = per_run(seq.run, seq.length)  # [b, n + 1] by run (run 0: 0)
    own = (length > B) if share else (length > 0)
    need = jnp.where(own, -(-length // B), 0)
    first_long = jnp.cumsum(need, axis=1) - need
    longs = jnp.sum(need, axis=1, keepdims=True)
    short = jnp.where((length > 0) & ~own, length, 0)
    at = jnp.cumsum(short, axis=1) - short  # end to end after the long ones
    cross = (short > 0) & (at // B != (at + short - 1) // B)
    stream = -(-jnp.sum(short, axis=1, keepdims=True) // B)
    nth = jnp.cumsum(cross, axis=1) - cross
    start_slot = jnp.where(
        own, first_long * B, jnp.where(cross, (longs + stream + nth) * B, longs * B + at)
    )
    fits = jnp.all(longs[:, 0] + stream[:, 0] + jnp.sum(cross, axis=1) <= blocks)
    real = seq.run > 0
    dest = jnp.take_along_axis(start_slot, seq.run, axis=1) + seq.pos
    dest = jnp.where(real & (dest < slots), dest, slots)
    t = jnp.arange(n, dtype=jnp.int32)
    src = jax.vmap(lambda d: jnp.full(slots + 1, n, jnp.int32).at[d].set(t, mode="drop"))(dest)
    src = src[:, :slots]

    def take(x):  # [b, n] per token -> [b, slots] per slot (0 where empty)
        padded = jnp.concatenate([x, jnp.zeros((b, 1), x.dtype)], axis=1)
        return jnp.take_along_axis(padded, src, axis=1)

    run, pos, size = take(seq.run), take(seq.pos), take(seq.length)
    ids = jnp.where(run > 0, take(jnp.take_along_axis(start_slot, seq.run, axis=1)) + 1, 0)
    is_long = (run > 0) & jnp.take_along_axis(own, run, axis=1)
    first = pos.reshape(b, blocks, B)[:, :, 0]
    start = jnp.arange(blocks, dtype=jnp.int32)[None] - first // B
    return Aligned(B, dest, src, run, pos, size, ids, is_long, start, fits)


def _gather_tokens(x: Array, index: Array, axis: int) -> Array:
    """``x`` (tokens on ``axis``) at ``index`` ``[b, m]`` per row; index ``x.shape[axis]``
    reads zeros."""
    x = jnp.moveaxis(x, axis, 1)
    b = x.shape[0]
    padded = jnp.concatenate([x, jnp.zeros((b, 1, *x.shape[2:]), x.dtype)], axis=1)
    out = jax.vmap(lambda xb, i: xb[i])(padded, index)
    return jnp.moveaxis(out, 1, axis)


def to_aligned(x: Array, layout: Aligned, axis: int) -> Array:
    """``x`` (``[b, ..., n, ...]``, tokens on ``axis``) in the aligned slots (zeros where
    empty)."""
    return _gather_tokens(x, layout.src, axis)


def from_aligned(x: Array, layout: Aligned, axis: int) -> Array:
    """The inverse of :func:`to_aligned`: each token's value from its slot (zeros for
    padding)."""
    return _gather_tokens(x, layout.dest, axis)


def tight_blocks(n: int, block: int) -> int:
    """The first try's aligned blocks: half again the row's, plus one (what rows of
    sequences averaging a few blocks need; :func:`in_sequences`)."""
    nb = -(-n // block)
    return nb + -(-nb // 2) + 1


def in_sequences(fn, arrays, segments: Array, block: int, axis: int, share: bool = True):
    """``fn(layout, *aligned arrays)`` (an array with tokens on ``axis``) back in the
    row's order: on the :func:`tight_blocks` layout where every row's sequences fit it,
    else on the :func:`guaranteed_blocks` one (``lax.cond``: both are compiled, one
    runs). ``share=False`` (every sequence its own blocks) has no guaranteed size: rows
    that do not fit even twice the row's blocks run with ``share=True``."""
    seq = sequences(segments)
    n = segments.shape[1]
    tries = [aligned_layout(seq, block, tight_blocks(n, block), share)]
    if share:
        tries.append(aligned_layout(seq, block, guaranteed_blocks(n, block)))
    else:
        tries += [aligned_layout(seq, block, guaranteed_blocks(n, block), share=False),
                  aligned_layout(seq, block, guaranteed_blocks(n, block))]  # fmt: skip

    def run(layout):
        def go(*xs):
            moved = [to_aligned(x, layout, axis) for x in xs]
            return from_aligned(fn(layout, *moved), layout, axis)

        return go

    out = run(tries[-1])
    for layout in reversed(tries[:-1]):
        out = functools.partial(lax.cond, layout.fits, run(layout), out)
    return out(*arrays)
