"""Continuous batching for greedy decoding and beam search: a fixed number of decoding
slots (a row, or a sentence's k beam rows) works through a queue of sentences; when a
slot's sentence ends, the next sentence of the queue takes it at the next step, so no
step decodes a finished sentence and no batch waits for its longest member.

Legend: m sentences in the queue, s slots, t cache length.

Each slot keeps its own position: the self-attention caches and the position counter
hold one index per row (:meth:`MultiHeadAttention._per_row_cache`), so a new sentence
starts at position 0 while its neighbours go on. The encoder runs once over the whole
queue, and each layer's cross-attention keys and values of every sentence are kept
(``[m, h, src, d]``); a slot that takes a sentence copies its rows of them (only on
steps where some slot was refilled). A sentence's output does not depend on the
sentences beside it, so the result equals :func:`~flaxformer_lite.inference.decoding.
sample`'s greedy output row for row, and :func:`~flaxformer_lite.inference.decoding.
beam_search`'s hypotheses and scores sentence by sentence (a beam slot's cache starts
at the full length, where beam_search's starts short and grows: the same values up to
float rounding). Dense self-attention only: a sparse pattern's ring buffer holds the
positions of one shared index.
"""

from __future__ import annotations

import functools

import flax.linen as nn
import jax
import jax.numpy as jnp
from jax import Array, lax

from flaxformer_lite.config.experiment import BEAM_STOPS
from flaxformer_lite.inference.constraints import NEG_INF, constrain
from flaxformer_lite.inference.decoding import _advance, _best, _undecided, length_penalty
from flaxformer_lite.inference.stepping import (
    SOURCE_LEAVES,
    Stepper,
    _name,
    block_top_k,
    grown,
    repeat_rows,
    score_dtype,
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

    state = _queue_loop(body, state, cache, count, s, set(state) - set(PER_SLOT))
    return (state["out"][:m], state["rows"]) if count_rows else state["out"][:m]


def _queue_loop(body, state: dict, cache, count: Array, s: int, shared, k: int = 1) -> dict:
    """``body`` over (state, cache) while the queue fills the ``s`` slots; once it is
    empty and few slots still run, those go on in a smaller batch (run_shrinking's
    second stage; every slot runs every step) to the end. ``shared``: the state's
    entries that are not one per slot; ``k``: cache rows per slot."""
    sizes = stage_sizes(s, SHRINK)

    def filling(c):
        running = jnp.sum(c[0]["active"])
        if len(sizes) == 1:
            return running > 0
        return (running > 0) & ((c[0]["next"] < count) | (running > sizes[1]))

    state, cache = lax.while_loop(filling, body, (state, cache))
    if len(sizes) > 1:
        keep = jnp.argsort(~state["active"], stable=True)[: sizes[1]]
        state = {name: x if name in shared else x[keep] for name, x in state.items()}
        cache = take_cache_rows(cache, (keep[:, None] * k + jnp.arange(k)).reshape(-1))
        state, _ = lax.while_loop(lambda c: jnp.any(c[0]["active"]), body, (state, cache))
    return state


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


@functools.partial(
    jax.jit,
    static_argnames=(
        "model", "max_length", "eos_id", "bos_id", "slots", "beam_size", "alpha", "stop",
        "first_length", "no_repeat_ngram", "count_rows",
    ),
)  # fmt: skip
def beam_continuous(
    model: nn.Module,
    params,
    inputs: Array,
    *,
    beam_size: int,
    alpha: float,
    max_length: int,
    eos_id: int,
    bos_id: int,
    slots: int,
    limit: Array | None = None,
    count: Array | None = None,
    stop: str = "exact",
    first_length: int = 0,
    no_repeat_ngram: int = 0,
    min_lengths: Array | None = None,
    max_lengths: Array | None = None,
    count_rows: bool = False,
):
    """Beam search of every row of ``inputs [m, src]`` through ``slots`` sentences of
    ``beam_size`` rows each, in queue order; returns (``[m, k, max_length]`` ids,
    ``[m, k]`` scores) as :func:`~flaxformer_lite.inference.decoding.beam_search`
    gives them for a sentence whose batch has ``limit`` (a scalar or ``[m]``, traced)
    as its limit (``count_rows``: and the row-steps run, beams counted).

    A slot's k rows keep one position between them; when its sentence is done (by the
    ``stop`` rule, or at its limit) its k best hypotheses are written out and the
    next sentence of the queue starts there at the next step. ``count`` (traced): only
    the first ``count`` rows are decoded. ``no_repeat_ngram``, ``min_lengths`` and
    ``max_lengths`` (``[m]``): beam_search's rules, each sentence under its own.

    ``first_length`` (< max_length): the queue runs with caches of that many positions
    (every step reorders and reads the whole cache); a sentence still searching when
    its cache is full leaves its slot, and those sentences are searched again from
    the start, as a second queue with caches of ``max_length``. The same results; the
    steps spent on them before are lost, so the length should hold most outputs."""
    if model.config.sparse_attention:
        raise ValueError("continuous batching needs dense self-attention (one index per row)")
    if stop not in BEAM_STOPS:
        raise ValueError(f"stop={stop!r}; choose one of {', '.join(BEAM_STOPS)}")
    m = inputs.shape[0]
    limits = jnp.broadcast_to(
        jnp.full((m,), max_length, jnp.int32) if limit is None else limit, (m,)
    )
    wide = score_dtype(model)
    search = _BeamQueue(
        Stepper(model, params, inputs), inputs, jnp.minimum(limits, max_length),
        k=beam_size, alpha=alpha, stop=stop, eos_id=eos_id, bos_id=bos_id,
        vocab=model.config.vocab_size, max_length=max_length, wide=wide,
        rules=(no_repeat_ngram, min_lengths, max_lengths),
    )  # fmt: skip
    count = jnp.int32(m) if count is None else jnp.minimum(count, m)
    out = {
        "ids": jnp.zeros((m + 1, beam_size, max_length), jnp.int32),  # row m: nobody's
        "scores": jnp.full((m + 1, beam_size), NEG_INF, wide),
        "rows": jnp.int32(0),
        "redo": jnp.zeros((m + 1,), jnp.int32),  # the sentences that outgrew the cache
        "redone": jnp.int32(0),
    }
    first = first_length if 0 < first_length < max_length else max_length
    out = search.run(jnp.arange(m, dtype=jnp.int32), count, min(slots, m), first, out)
    if first < max_length:
        out = search.run(out["redo"], out["redone"], min(slots, m), max_length, out)
    result = out["ids"][:m], out["scores"][:m]
    return (*result, out["rows"]) if count_rows else result


class _BeamQueue:
    """The loop of :func:`beam_continuous` over one queue and one cache length."""

    def __init__(self, stepper, inputs, limits, *, k, alpha, stop, eos_id, bos_id, vocab,
                 max_length, wide, rules):  # fmt: skip
        self.stepper, self.inputs, self.limits, self.rules = stepper, inputs, limits, rules
        # the longest output each sentence can reach (beam_search's ``longest``)
        most = rules[2]
        self.longest = limits if most is None else jnp.minimum(limits, most + 1)
        self.k, self.alpha, self.stop, self.eos_id, self.bos_id = k, alpha, stop, eos_id, bos_id
        self.vocab, self.wide = vocab, wide
        self.store = stepper.init_cache(inputs.shape[0], 1)  # cross-attention keys; 1 position
        # The search state of a sentence that starts (only beam 0 alive, as beam_search's).
        self.start = {
            "live_seqs": jnp.zeros((k, max_length), jnp.int32),
            "live_logp": jnp.array([0.0] + [NEG_INF] * (k - 1), wide),
            "fin_seqs": jnp.zeros((k, max_length), jnp.int32),
            "fin_scores": jnp.full((k,), NEG_INF, wide),
            "steps": jnp.int32(0),
        }

    def run(self, order: Array, count: Array, s: int, length: int, out: dict) -> dict:
        """The sentences ``order[:count]`` searched in ``s`` slots with caches of
        ``length`` positions; ``out`` with their results (and, where ``length`` is
        short of the output's, the sentences that outgrew it in ``redo``)."""
        k = self.k
        parks = length < self.start["live_seqs"].shape[-1]
        cache = grown(take_cache_rows(self.store, jnp.repeat(order[:s], k)), length)

        def per_row(path, x):
            return jnp.zeros((s * k,), jnp.int32) if _name(path) in INDEX_LEAVES else x

        cache = jax.tree_util.tree_map_with_path(per_row, cache)
        src = order[:s]
        state = {
            **{name: jnp.broadcast_to(x, (s, *x.shape)) for name, x in self.start.items()},
            "src": src,
            "max_lp": length_penalty(self.longest[src].astype(self.wide), self.alpha),
            "active": jnp.arange(s) < count,
            "next": jnp.minimum(count, s),
            **out,
        }
        body = functools.partial(self._step, order=order, count=count, length=length,
                                 parks=parks)  # fmt: skip
        state = _queue_loop(body, state, cache, count, s, {*out, "next"}, k)
        return {name: state[name] for name in out}

    def _step(self, c, *, order, count, length, parks):
        r, cache = c
        k, m = self.k, self.inputs.shape[0]
        n, src, act, i = r["src"].shape[0], r["src"], r["active"], r["steps"]
        at = jnp.maximum(i - 1, 0)[:, None, None]
        previous = jnp.take_along_axis(r["live_seqs"], at, axis=2)[..., 0]
        last = jnp.where(i[:, None] == 0, self.bos_id, previous)
        inputs = repeat_rows(self.inputs[src], k)
        logits, cache = self.stepper(cache, last.reshape(n * k, 1), inputs)
        logp = jax.nn.log_softmax(logits).reshape(n, k, self.vocab)
        ngram, least, most = self.rules
        logp = constrain(logp, r["live_seqs"], i, self.eos_id, ngram,
                         None if least is None else least[src],
                         None if most is None else most[src])  # fmt: skip
        new, origin = _advance(r, logp, i, self.eos_id, self.alpha)
        cache = take_cache_rows(cache, (jnp.arange(n)[:, None] * k + origin).reshape(-1),
                                beams_only=True)  # fmt: skip
        r = r | {
            name: jnp.where(act.reshape(n, *[1] * (x.ndim - 1)), x, r[name])
            for name, x in new.items()
        }
        steps = r["steps"]
        going = act & _undecided(
            self.stop, steps, r["live_logp"], r["fin_scores"], self.alpha, r["max_lp"]
        )  # fmt: skip
        running = going & (steps < self.limits[src])
        ended = act & ~running
        write = functools.partial(_write_out, k=k, alpha=self.alpha, m=m)
        r = lax.cond(jnp.any(ended), write, lambda r, *_: r, r, ended, going)
        if parks:  # a sentence whose next step has no position left: searched again later
            full = running & (steps >= length)
            where = jnp.where(full, r["redone"] + jnp.cumsum(full) - 1, m)
            r = r | {"redo": r["redo"].at[where].set(src), "redone": r["redone"] + jnp.sum(full)}
            running = running & ~full
        # Free slots take the next sentences, in queue order.
        free = ~running
        new = r["next"] + jnp.cumsum(free) - 1
        take = free & (new < count)
        src = jnp.where(take, order[jnp.minimum(new, m - 1)], src)
        fresh = {
            name: jnp.where(take.reshape(n, *[1] * x.ndim), x, r[name])
            for name, x in self.start.items()
        }
        lp = length_penalty(self.longest[src].astype(self.wide), self.alpha)
        cache = lax.cond(
            jnp.any(take), _refill, lambda c, *_: c, cache, self.store, jnp.repeat(take, k),
            jnp.repeat(src, k),
        )  # fmt: skip
        return r | fresh | {
            "src": src,
            "max_lp": jnp.where(take, lp, r["max_lp"]),
            "active": running | take,
            "next": r["next"] + jnp.sum(take),
            "rows": r["rows"] + k * jnp.sum(act),
        }, cache


def _write_out(r: dict, ended: Array, going: Array, *, k: int, alpha: float, m: int) -> dict:
    """The state with the k best hypotheses of each ``ended`` slot written at its
    sentence's row (``going``: the slots still searching, which at their limit let
    the live beams compete, as beam_search's last step does)."""
    ids, scores = _best(r | {"active": going}, k, alpha)
    rows = jnp.where(ended, r["src"], m)
    return r | {"ids": r["ids"].at[rows].set(ids), "scores": r["scores"].at[rows].set(scores)}
