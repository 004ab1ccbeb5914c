"""Continuous batching for greedy decoding: a fixed number of decoding rows (slots)
works through a queue of sentences; when a row's sentence ends, the next sentence of
the queue takes its slot at the next step, so no step decodes a finished row and no
batch waits for its longest member.

Legend: m sentences in the queue, s slots, t cache length.

Each slot keeps its own position: the self-attention caches and the position counter
hold one index per row (:meth:`MultiHeadAttention._per_row_cache`), so a new sentence
starts at position 0 while its neighbours go on. The encoder runs once over the whole
queue, and each layer's cross-attention keys and values of every sentence are kept
(``[m, h, src, d]``); a slot that takes a sentence copies its rows of them (only on
steps where some slot was refilled). A sentence's output does not depend on the
sentences beside it, so the result equals :func:`~flaxformer_lite.inference.decoding.
sample`'s greedy output row for row. Dense self-attention only: a sparse pattern's
ring buffer holds the positions of one shared index.
"""

from __future__ import annotations

import functools

import flax.linen as nn
import jax
import jax.numpy as jnp
from jax import Array, lax

from flaxformer_lite.inference.stepping import (
    SOURCE_LEAVES,
    Stepper,
    _name,
    block_top_k,
    grown,
    stage_sizes,
    take_cache_rows,
)

# Cache counters that become one per slot.
INDEX_LEAVES = ("cache_index", "position_index")
# The search state's entries that are one per slot.
PER_SLOT = ("src", "last", "step", "active")
# The rows go on in a batch of 1/SHRINK of the slots once only that many still run.
SHRINK = 4


@functools.partial(
    jax.jit, static_argnames=("model", "max_length", "eos_id", "bos_id", "slots", "count_rows")
)
def greedy_continuous(
    model: nn.Module,
    params,
    inputs: Array,
    *,
    max_length: int,
    eos_id: int,
    bos_id: int,
    slots: int,
    limit: Array | None = None,
    count: Array | None = None,
    count_rows: bool = False,
) -> Array | tuple[Array, Array]:
    """Greedy decoding of every row of ``inputs [m, src]`` through ``slots`` decoding
    rows, in queue order; returns ``[m, max_length]`` ids (``count_rows``: and the
    row-steps run).

    ``limit`` (traced; a scalar or ``[m]``): at most that many tokens per sentence,
    as :func:`~flaxformer_lite.inference.decoding.sample`'s. ``count`` (traced): only
    the first ``count`` rows are decoded, the others (padding the queue to a size
    that compiles once for many test sets) stay zeros and cost no step."""
    if model.config.sparse_attention:
        raise ValueError("continuous batching needs dense self-attention (one index per row)")
    m = inputs.shape[0]
    s = min(slots, m)
    limits = jnp.broadcast_to(
        jnp.full((m,), max_length, jnp.int32) if limit is None else limit, (m,)
    )
    count = jnp.int32(m) if count is None else jnp.minimum(count, m)
    stepper = Stepper(model, params, inputs)
    store = stepper.init_cache(m, 1)  # the queue's cross-attention keys; 1 position
    cache = grown(take_cache_rows(store, jnp.arange(s)), max_length)

    def per_slot(path, x):
        return jnp.zeros((s,), jnp.int32) if _name(path) in INDEX_LEAVES else x

    cache = jax.tree_util.tree_map_with_path(per_slot, cache)
    state = {
        "src": jnp.arange(s, dtype=jnp.int32),  # each slot's sentence
        "last": jnp.full((s,), bos_id, jnp.int32),
        "step": jnp.zeros((s,), jnp.int32),  # tokens the slot's sentence has
        "active": jnp.arange(s) < count,
        "next": jnp.minimum(count, s),  # the queue's next sentence
        "out": jnp.zeros((m + 1, max_length), jnp.int32),  # row m: a finished slot's writes
        "rows": jnp.int32(0),
    }

    def body(c):
        state, cache = c
        src, active, step = state["src"], state["active"], state["step"]
        logits, cache = stepper(cache, state["last"][:, None], inputs[src])
        token = block_top_k(logits, 1)[1][:, 0].astype(jnp.int32)
        writes = active & (step < limits[src])  # a limit of 0 writes nothing
        out = (
            state["out"].at[jnp.where(writes, src, m), jnp.minimum(step, max_length - 1)].set(token)
        )
        step = step + 1
        active = active & (token != eos_id) & (step < limits[src])
        # Free slots take the next sentences, in queue order.
        free = ~active
        new = state["next"] + jnp.cumsum(free) - 1
        take = free & (new < count)
        src = jnp.where(take, new, src)
        cache = lax.cond(jnp.any(take), _refill, lambda c, *_: c, cache, store, take, src)
        state = {
            "src": src,
            "last": jnp.where(take, bos_id, token),
            "step": jnp.where(take, 0, step),
            "active": active | take,
            "next": state["next"] + jnp.sum(take),
            "out": out,
            "rows": state["rows"] + jnp.sum(state["active"]),
        }
        return state, cache

    # Once the queue is empty and few rows still run, they go on in a smaller batch (as
    # run_shrinking's second stage): every slot runs every step.
    sizes = stage_sizes(s, SHRINK)

    def filling(c):
        state = c[0]
        running = jnp.sum(state["active"])
        if len(sizes) == 1:
            return running > 0
        return (running > 0) & ((state["next"] < count) | (running > sizes[1]))

    state, cache = lax.while_loop(filling, body, (state, cache))
    if len(sizes) > 1:
        keep = jnp.argsort(~state["active"], stable=True)[: sizes[1]]
        state = {k: v[keep] if k in PER_SLOT else v for k, v in state.items()}
        cache = take_cache_rows(cache, keep)
        state, _ = lax.while_loop(lambda c: jnp.any(c[0]["active"]), body, (state, cache))
    return (state["out"][:m], state["rows"]) if count_rows else state["out"][:m]


def _refill(cache, store, take: Array, src: Array):
    """The cache with the refilled slots (``take``) starting over: their positions 0,
    their sentence's cross-attention keys and values from ``store``."""

    def one(path, x, kept):
        name = _name(path)
        if name in INDEX_LEAVES:
            return jnp.where(take, 0, x)
        if name in SOURCE_LEAVES:
            picked = kept[src]
            return jnp.where(take.reshape(-1, *[1] * (x.ndim - 1)), picked, x)
        return x

    return jax.tree_util.tree_map_with_path(one, cache, store)
