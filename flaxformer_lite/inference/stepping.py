"""What every search shares: one cached decoding step of either architecture (and of
an ensemble), and a decoding loop that drops its finished rows as it goes.

Legend: b batch (source rows), k rows per source row (beams), v vocabulary.

A search keeps, for each source row, an ``active`` flag: the row still searches. A
row that is done is frozen (its outputs stop changing), so its result does not
depend on which sentences share its batch. A batch steps until its last row is
done, so a batch of short outputs with one long one pays the long one's steps for
every row: on the demo's test split, half of a beam search's row-steps were spent on
rows that were done. :func:`run_shrinking` cuts that: when only a few rows of a
batch still search, it gathers them (their state and their cache rows) into a
smaller batch and steps that instead. The sizes are compile-time constants, so a
search compiles one loop per size. A beam search may also start with a short cache
(:func:`grown`): its first stage stops when that cache is full, and the rows still
searching go on with the cache padded to its whole length, in parts of the smaller
size.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import flax.linen as nn
import jax
import jax.numpy as jnp
from jax import Array, lax

from flaxformer_lite.model.lm import LanguageModel
from flaxformer_lite.model.transformer import Transformer
from flaxformer_lite.workdir.layer_layout import switched, unrolled


def is_ensemble(params) -> bool:
    """A tuple/list of parameter trees (an ensemble) rather than one tree."""
    return isinstance(params, tuple | list)


def score_dtype(model: nn.Module) -> jnp.dtype:
    """Logits and scores: float32, or float64 for a float64 model (float64 mode is how
    this project checks numerics, so its scores must not be rounded to float32)."""
    return jnp.promote_types(model.config.dtype, jnp.float32)


def repeat_rows(x: Array | None, k: int) -> Array | None:
    """``[b, ...]`` -> ``[b * k, ...]`` (each row k times, adjacent)."""
    return x if x is None or k == 1 else jnp.repeat(x, k, axis=0)


# Cache leaves computed from the source at the first step (the same for every beam of
# a row): the cross-attention keys/values and the lexical shortcut's keys.
SOURCE_LEAVES = ("cross_key", "cross_value", "lexical_key")


def _name(path) -> str:
    return jax.tree_util.keystr(path[-1:], simple=True)


def _per_row(path) -> bool:
    """Whether a cache leaf (at ``path``) holds one entry per decoded row. Counters
    (scalars) and a ring buffer's slot positions are shared by all rows."""
    return _name(path) != "cached_positions"


def _follows_beams(path, x) -> bool:
    """Whether a cache leaf must be reordered when beams are: the per-row leaves but
    those computed from the source, which are the same for every beam of a row."""
    return x.ndim > 0 and _per_row(path) and _name(path) not in SOURCE_LEAVES


def take_cache_rows(cache, rows: Array, *, beams_only: bool = False):
    """Every per-row cache leaf ``[n, ...]`` at ``rows`` (``beams_only``: the leaves
    that follow a beam reordering; those computed from the source stay).

    Whole rows are copied, the empty tail of a self-attention cache included:
    memory-bound, ~18% of a beam search on CPU. Moving only the positions written so
    far (a branch per 16 positions) measured slower: the branches copied the caches."""

    def take(path, x):
        moves = _follows_beams(path, x) if beams_only else x.ndim > 0 and _per_row(path)
        return x.at[rows].get(mode="promise_in_bounds") if moves else x

    return jax.tree_util.tree_map_with_path(take, cache)


class Stepper:
    """One decoding step of either architecture over a shared cache protocol.

    For an ensemble (``params`` a tuple of trees) the encoding and the cache are
    tuples with one entry per member, and a step returns the log of the members'
    mean next-token probability."""

    def __init__(self, model: nn.Module, params, inputs: Array | None, repeat: int = 1):
        # ``repeat`` = k for beam search: each source row stands for k adjacent beam
        # rows. The encoder and the cross-attention projections run once per source
        # row (their keys are repeated), which saves 3/4 of them at beam 4.
        # Cached decoding reads each layer's cache by name: a scanned model's layers
        # run unrolled (the same parameters, unstacked).
        members = tuple(params) if is_ensemble(params) else (params,)
        config, _ = unrolled(model.config, None)
        if config is not model.config:
            model = model.clone(config=config)
            members = tuple(switched(p)[0] for p in members)
        self.model, self.source, self.repeat = model, inputs, repeat
        self.members = members
        if not self.members:
            raise ValueError("an ensemble needs at least one parameter tree")
        self.is_lm = isinstance(model, LanguageModel)
        if not self.is_lm and inputs is None:
            raise ValueError("the encoder-decoder needs source inputs")

    def init_cache(self, batch: int, max_length: int):
        """An empty cache of ``batch`` rows and ``max_length`` positions; for the
        encoder-decoder, with the cross-attention keys and values of the source already
        in it (each layer's projection of the encoder output), so that every step, the
        first included, runs the same program.

        One call of the model over a ``max_length`` dummy target makes the cache: the
        call that creates a cache fills only what comes from the source (the layers
        compute the rest, which nothing reads and XLA drops). A separate pass for the
        shapes (``model.init``) and a first step to fill the source's keys traced the
        model twice more: a third of a search's tracing, and, for beams, a decoder
        step of another batch size to compile."""
        if self.is_lm:
            dummy = jnp.ones((batch, max_length), jnp.int32)
            shapes = jax.eval_shape(
                lambda p: self.model.apply({"params": p}, dummy, decode=True, mutable=["cache"]),
                self.members[0],
            )[1]["cache"]
            empty = jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype), shapes)
            return tuple(empty for _ in self.members)
        # The source's keys are projected once per source row, then repeated for its
        # k beams; the other leaves start empty.
        k = self.repeat
        if batch != self.source.shape[0] * k:
            rows = self.source.shape[0]
            raise ValueError(f"init_cache(batch={batch}): need {rows} source rows x {k}")
        dummy = jnp.ones((self.source.shape[0], max_length), jnp.int32)

        def expand(path, x):
            if _name(path) in SOURCE_LEAVES:
                return repeat_rows(x, k)
            rows = x.shape[0] * k if x.ndim > 0 and _per_row(path) else None
            return jnp.zeros(x.shape if rows is None else (rows, *x.shape[1:]), x.dtype)

        made = [
            self.model.apply({"params": p}, self.source, dummy, decode=True, mutable=["cache"])
            for p in self.members
        ]
        return tuple(jax.tree_util.tree_map_with_path(expand, m[1]["cache"]) for m in made)

    def _member_step(self, params, cache, tokens: Array, encoded, inputs):
        variables = {"params": params, "cache": cache}
        if self.is_lm:
            logits, mutated = self.model.apply(variables, tokens, decode=True, mutable=["cache"])
        else:
            logits, mutated = self.model.apply(
                variables,
                encoded,
                inputs,
                tokens,
                decode=True,
                mutable=["cache"],
                method=Transformer.decode,
            )
        return logits[:, -1].astype(score_dtype(self.model)), mutated["cache"]

    def __call__(self, cache, tokens: Array, inputs: Array | None) -> tuple[Array, tuple]:
        """Logits ``[n, v]`` for the next token after ``tokens [n, 1]``; the new cache.
        ``inputs``: the source rows ``[n, s]`` of the decoded rows (their padding
        mask; None for a language model).

        One member: its logits. An ensemble: log of the mean member probability."""
        steps = [
            self._member_step(p, c, tokens, None, inputs)
            for p, c in zip(self.members, cache, strict=True)
        ]
        caches = tuple(c for _, c in steps)
        if len(steps) == 1:
            return steps[0][0], caches
        logp = jnp.stack([jax.nn.log_softmax(lg) for lg, _ in steps])
        return jax.nn.logsumexp(logp, axis=0) - jnp.log(len(steps)), caches


def block_top_k(x: Array, k: int, block: int = 32) -> tuple[Array, Array]:
    """``lax.top_k`` of ``x [n, m]`` (values and indices, best first, ties to the lower
    index), found among the k blocks of ``block`` entries with the largest maxima:
    every one of the k largest entries lies in one of those blocks. XLA:CPU's top-k
    of a beam's 4 x 8,000 candidates took 1.5 ms a row batch, ~5% of a beam step; a
    pass for the block maxima and a top-k of k blocks take a sixth of that."""
    n, m = x.shape
    if m < 4 * k * block:  # few blocks: nothing to save
        return lax.top_k(x, k)
    pad = -m % block
    if pad:
        x = jnp.pad(x, ((0, 0), (0, pad)), constant_values=-jnp.inf)
    blocks = x.reshape(n, -1, block)
    # Blocks in index order, so that ties among their entries go to the lower index.
    chosen = jnp.sort(lax.top_k(blocks.max(axis=-1), k)[1], axis=-1)
    entries = jnp.take_along_axis(blocks, chosen[..., None], axis=1).reshape(n, k * block)
    values, j = lax.top_k(entries, k)
    return values, jnp.take_along_axis(chosen, j // block, axis=1) * block + j % block


def stage_sizes(batch: int, shrink: int) -> tuple[int, ...]:
    """The batch sizes a search of ``batch`` rows steps with: the whole batch, then
    1/shrink of it (0 = never shrink). A batch of at most 2 * shrink rows (the
    widest sources' batches of a test set: 8 rows at 512 tokens) does not shrink: a
    loop per size costs its compile time, ~1 s for beam 4 on 2 cores."""
    if shrink < 2 or batch <= 2 * shrink:
        return (batch,)
    return (batch, math.ceil(batch / shrink))


def grown(cache, length: int):
    """``cache`` with its self-attention keys and values ``[n, h, t, d]`` padded with
    empty positions to ``length``: position i is written at step i and read only
    from then on, so the padding changes nothing but the room."""

    def pad(path, x):
        if _name(path) in ("cached_key", "cached_value") and x.shape[2] < length:
            return jnp.pad(x, ((0, 0), (0, 0), (0, length - x.shape[2]), (0, 0)))
        return x

    return jax.tree_util.tree_map_with_path(pad, cache)


def run_shrinking(
    step: Callable,
    i: Array,
    rows: dict,
    cache,
    stop_at: Array,
    sizes: tuple[int, ...],
    k: int,
    grow: tuple[int, int] | None = None,
) -> dict:
    """Steps ``rows`` (a dict of ``[b, ...]`` arrays, each row's search state, with
    an ``active`` flag) until no row is active or step ``stop_at``: ``step(i, rows,
    cache) -> (rows, cache)`` must leave an inactive row as it is. Returns the rows,
    in their order.

    Two stages. The whole batch steps while more rows than ``sizes[1]`` are active
    and, with ``grow`` = (the given cache's length, the length the search needs),
    until the short cache is full: a short cache is cheaper to reorder and to attend
    over at every step. Then the active rows (and the k cache rows of each, padded
    to the length needed) step on in batches of ``sizes[1]`` rows, one after the
    other: usually one batch of the few rows left; several where many rows were
    still active when the short cache filled. A row's result does not depend on
    which rows share its batch, so the stages change no output."""
    size, *rest = sizes
    short = grow is not None and grow[0] < grow[1]
    end = jnp.minimum(stop_at, grow[0]) if short else stop_at

    def cond(c):
        i, rows, _ = c
        active = jnp.sum(rows["active"])
        go = (i < end) & (active > 0)
        return go & (active > rest[0]) if rest else go

    def body(c):
        i, rows, cache = c
        rows, cache = step(i, rows, cache)
        return i + 1, rows, cache

    i, rows, cache = lax.while_loop(cond, body, (i, rows, cache))
    if not rest and not short:
        return rows
    part_size = rest[0] if rest else size
    # The active rows first (a stable sort keeps their order), then done rows to fill.
    order = jnp.argsort(~rows["active"], stable=True)
    parts = (jnp.sum(rows["active"]) + part_size - 1) // part_size

    def one_part(p, rows):
        # The last part may overlap the one before (the slice stays inside the
        # batch): rows stepped there already sit this part out and are not written.
        start = jnp.minimum(p * part_size, order.shape[0] - part_size)
        keep = lax.dynamic_slice_in_dim(order, start, part_size)
        fresh = start + jnp.arange(part_size) >= p * part_size
        part = jax.tree.map(lambda x: x[keep], rows)
        part["active"] = part["active"] & fresh
        cache_rows = (keep[:, None] * k + jnp.arange(k)).reshape(-1)
        part_cache = take_cache_rows(cache, cache_rows)
        part_cache = grown(part_cache, grow[1]) if short else part_cache

        def part_cond(c):
            i, part, _ = c
            return (i < stop_at) & jnp.any(part["active"])

        _, part, _ = lax.while_loop(part_cond, body, (i, part, part_cache))

        def put(full, x):
            mine = fresh.reshape(-1, *[1] * (x.ndim - 1))
            return full.at[keep].set(jnp.where(mine, x, full[keep]))

        return jax.tree.map(put, rows, part)

    return lax.fori_loop(0, parts, one_part, rows)


def first_cache_length(model: nn.Module, max_length: int, first_length: int) -> int:
    """The cache length a search starts with: ``first_length`` where it is shorter
    than ``max_length`` (the search then goes on with a cache of ``max_length``,
    :func:`~flaxformer_lite.inference.stepping.run_shrinking`), else ``max_length``.
    Every step reorders (beam search) and attends over the whole cache: on the demo's
    test split, batches of up to 16 source pieces decoded 1.48x faster (beam 4) and
    1.25x (greedy) with 32 positions than with 80. Sparse self-attention keeps the
    cache it has: its ring buffers and random blocks are laid out for one length."""
    if 0 < first_length < max_length and not model.config.sparse_attention:
        return first_length
    return max_length
