"""Autoregressive decoding with the KV cache: greedy, sampling, beam search.

Legend: b batch, k beams, s source length, t decoded length, v vocabulary.

Every search is one jitted program: the encoder runs once, each layer's
cross-attention keys/values go into the cache, and a ``lax.while_loop`` feeds one
token per step through the cached decoder until every sentence is done (or
``max_length`` is reached); a done sentence stops changing, and once few are left
they step on as a smaller batch (:mod:`~flaxformer_lite.inference.stepping`). Outputs are
``[b, t]`` token ids (``[b, k, t]`` for beams): EOS then padding after a
sentence ends. ``max_length`` sizes the cache and the outputs (a compile-time
constant); ``limit``, a traced value, stops the search earlier, so that batches
with other length limits reuse one compiled search (:func:`bucket`).

Works for the encoder-decoder (``Transformer``) and the decoder-only
``LanguageModel`` (``inputs=None``); ``prefix`` forces the first tokens of each
row (a prompt), with 0 = no forced token.

Ensembles: ``params`` may be a tuple of parameter trees of the same model (say,
two seeds, or checkpoints of one run). Every member keeps its own encoding and
cache, and the search scores the mean of the members' next-token
probabilities, log(1/n sum_m p_m), in place of one model's log-probabilities.

The stepper, the cache handling, the ensemble mean and the shrinking loop that the
searches share are in :mod:`~flaxformer_lite.inference.stepping`; the rules besides
the model (top-k/top-p, repeated n-grams, length bounds) in
:mod:`~flaxformer_lite.inference.constraints`.
"""

from __future__ import annotations

import functools

import flax.linen as nn
import jax
import jax.numpy as jnp
from jax import Array, lax

from flaxformer_lite.config.experiment import BEAM_STOPS
from flaxformer_lite.inference.constraints import NEG_INF, constrain, draw, filter_logits
from flaxformer_lite.inference.stepping import (
    Stepper,
    block_top_k,
    first_cache_length,
    repeat_rows,
    run_shrinking,
    score_dtype,
    stage_sizes,
    take_cache_rows,
)
from flaxformer_lite.model.transformer import Transformer

# Arguments every jitted search takes as compile-time constants.
_STATIC = ("model", "max_length", "eos_id", "bos_id")
# A search goes on with its unfinished rows alone once they are 1/SHRINK of the batch.
SHRINK = 4


def bucket(limit: int, cap: int) -> int:
    """The cache length that a search with output ``limit`` compiles for: the next
    multiple of 16, at most ``cap``; the limit itself is traced. (Powers of two
    compile less but cost ~25% of a beam search on CPU: each step reorders and
    reads the whole cache, so its unused tail is paid for.)"""
    return min(-(-max(limit, 1) // 16) * 16, cap)


# Greedy and sampling -----------------------------------------------------------------


@functools.partial(
    jax.jit,
    static_argnames=(
        *_STATIC,
        "temperature",
        "top_k",
        "top_p",
        "batch_size",
        "shrink",
        "first_length",
    ),
)
def sample(
    model: nn.Module,
    params,
    inputs: Array | None,
    *,
    max_length: int,
    eos_id: int,
    bos_id: int,
    rng: Array | None = None,
    temperature: float = 0.0,
    top_k: int = 0,
    top_p: float = 1.0,
    prefix: Array | None = None,
    batch_size: int | None = None,
    limit: Array | None = None,
    shrink: int = SHRINK,
    first_length: int = 0,
) -> Array:
    """Greedy (``temperature=0``) or sampled decoding; returns ``[b, max_length]`` ids.

    ``limit`` (traced; a scalar, or ``[b]`` for each row its own): at most that many
    tokens, the rest of a row padding. Per-row limits make a row's output independent
    of its batch-mates; a padding row with limit 0 is done from the start.
    ``shrink``: greedy decoding goes on with the unfinished rows alone once they are
    1/shrink of the batch (:func:`~flaxformer_lite.inference.stepping.run_shrinking`;
    0 = never). Sampling never shrinks: its draws are made over the whole batch.
    ``first_length``: greedy decoding steps with a cache of this many positions
    first (:func:`~flaxformer_lite.inference.stepping.first_cache_length`)."""
    stepper = Stepper(model, params, inputs)
    b = next((x.shape[0] for x in (inputs, prefix) if x is not None), batch_size)
    greedy = temperature == 0.0
    first = first_cache_length(model, max_length, first_length * greedy)
    cache = stepper.init_cache(b, first)
    rng = jax.random.key(0) if rng is None else rng
    limits = jnp.full((b,), max_length, jnp.int32) if limit is None else limit
    rows = {
        "out": jnp.zeros((b, max_length), jnp.int32),
        "last": jnp.full((b,), bos_id, jnp.int32),
        "limit": jnp.broadcast_to(limits, (b,)),
        "inputs": inputs,
    }
    rows["active"] = rows["limit"] > 0
    if prefix is not None:  # 0 = not forced; indexing past its end would clamp, so pad it
        rows["prefix"] = jnp.pad(
            prefix[:, :max_length], ((0, 0), (0, max(max_length - prefix.shape[1], 0)))
        )

    def step(i, r, cache):
        logits, cache = stepper(cache, r["last"][:, None], r["inputs"])
        if temperature == 0.0:  # argmax (ties to the lower id), 6x faster on XLA:CPU
            token = block_top_k(logits, 1)[1][:, 0]
        else:
            scaled = filter_logits(logits / temperature, top_k, top_p)
            token = draw(jax.random.fold_in(rng, i), scaled)
        if prefix is not None:
            forced = r["prefix"][:, i]
            token = jnp.where(forced > 0, forced, token)
        # A done row keeps what it holds (a later stage may step it again).
        held = lax.dynamic_index_in_dim(r["out"], i, 1, False)
        token = jnp.where(r["active"], token, held).astype(jnp.int32)
        out = lax.dynamic_update_slice_in_dim(r["out"], token[:, None], i, axis=1)
        active = r["active"] & (token != eos_id) & (i + 1 < r["limit"])
        return r | {"out": out, "last": token, "active": active}, cache

    stop_at = jnp.minimum(jnp.max(rows["limit"]), max_length)
    sizes = stage_sizes(b, shrink if greedy else 0)
    grow = (first, max_length)
    rows = run_shrinking(step, jnp.int32(0), rows, cache, stop_at, sizes, 1, grow)
    return rows["out"]


@functools.partial(jax.jit, static_argnames=_STATIC)
def greedy_uncached(
    model: nn.Module, params, inputs: Array, *, max_length: int, eos_id: int, bos_id: int
) -> Array:
    """Greedy decoding that reruns the whole decoder on the prefix every step (reference)."""
    encoded = model.apply({"params": params}, inputs, method=Transformer.encode)
    b = inputs.shape[0]

    def body(i, carry):
        out, done = carry
        # The label at position i must not be padding (it would mask the query);
        # causality makes its value irrelevant to the logits at i.
        labels = out.at[:, i].set(eos_id)
        logits = model.apply(
            {"params": params}, encoded, inputs, labels, method=Transformer.decode
        )[:, i]
        token = jnp.where(done, 0, jnp.argmax(logits, axis=-1).astype(jnp.int32))
        return out.at[:, i].set(token), done | (token == eos_id)

    out, _ = lax.fori_loop(
        0, max_length, body, (jnp.zeros((b, max_length), jnp.int32), jnp.zeros((b,), bool))
    )
    del bos_id  # the model shifts the labels right behind its own BOS
    return out


# Beam search ------------------------------------------------------------------------


def length_penalty(length: Array, alpha: float) -> Array:
    """((5 + length) / 6) ** alpha (Wu et al. 2016; the paper uses alpha = 0.6)."""
    return ((5.0 + length) / 6.0) ** alpha


@functools.partial(
    jax.jit,
    static_argnames=(
        *_STATIC,
        "beam_size",
        "alpha",
        "no_repeat_ngram",
        "stop",
        "shrink",
        "first_length",
    ),
)
def beam_search(
    model: nn.Module,
    params,
    inputs: Array,
    *,
    beam_size: int,
    alpha: float,
    max_length: int,
    eos_id: int,
    bos_id: int,
    no_repeat_ngram: int = 0,
    min_lengths: Array | None = None,
    max_lengths: Array | None = None,
    limit: Array | None = None,
    stop: str = "exact",
    shrink: int = SHRINK,
    first_length: int = 0,
) -> tuple[Array, Array]:
    """Beam search with length penalty; returns (``[b, k, t]`` ids, ``[b, k]`` scores).

    ``min_lengths`` / ``max_lengths`` (``[b]`` ints, optional): per-sentence bounds on
    the tokens before EOS (EOS forbidden before the minimum, forced at the maximum),
    e.g. to tie the output length to the source length.

    ``no_repeat_ngram`` = n > 0 forbids any hypothesis to contain the same n tokens
    twice (a guard against an undertrained model's loops); 0 = off, as in the paper.

    Hypotheses are sorted by penalised score log p / ((5+len)/6)^alpha, best first.
    Finished hypotheses (ended by EOS) are kept apart from the live ones; ``stop``
    says when a row is done (:func:`_undecided`: exact, current or finished), and a
    row that is done stops changing, whatever its batch-mates still do. At the limit
    (``max_length``, or the traced ``limit`` below it), rows without enough finished
    hypotheses take live ones. ``shrink``: the search goes on with the undecided rows
    alone once they are 1/shrink of the batch (0 = never; the results are the same).
    ``first_length``: the search steps with a cache of this many positions first
    (:func:`~flaxformer_lite.inference.stepping.first_cache_length`; the same results).
    """
    if stop not in BEAM_STOPS:
        raise ValueError(f"stop={stop!r}; choose one of {', '.join(BEAM_STOPS)}")
    b, k, v = inputs.shape[0], beam_size, model.config.vocab_size
    stepper = Stepper(model, params, inputs, repeat=k)
    sizes = stage_sizes(b, shrink)
    # A batch too small to shrink keeps one cache length: one loop to compile.
    first = first_cache_length(model, max_length, first_length * (len(sizes) > 1))
    cache = stepper.init_cache(b * k, first)
    wide = score_dtype(model)
    stop_at = max_length if limit is None else jnp.minimum(limit, max_length)
    longest = jnp.full((b,), stop_at, jnp.int32)  # the longest output each row can reach
    if max_lengths is not None:
        longest = jnp.minimum(longest, max_lengths + 1)
    rows = {
        "live_seqs": jnp.zeros((b, k, max_length), jnp.int32),
        # Only beam 0 is alive at the start, so the first step does not pick k copies.
        "live_logp": jnp.tile(jnp.array([0.0] + [NEG_INF] * (k - 1), wide), (b, 1)),
        "fin_seqs": jnp.zeros((b, k, max_length), jnp.int32),
        "fin_scores": jnp.full((b, k), NEG_INF, wide),
        "steps": jnp.zeros((b,), jnp.int32),  # tokens in each row's live hypotheses
        "max_lp": length_penalty(longest.astype(wide), alpha),
        "inputs": inputs,
        "min_lengths": min_lengths,
        "max_lengths": max_lengths,
    }
    rows["active"] = _undecided(
        stop, jnp.int32(0), rows["live_logp"], rows["fin_scores"], alpha, rows["max_lp"]
    )

    def step(i, r, cache):
        n = r["live_seqs"].shape[0]
        previous = lax.dynamic_index_in_dim(r["live_seqs"], jnp.maximum(i - 1, 0), 2, False)
        last = jnp.where(i == 0, bos_id, previous)
        logits, cache = stepper(cache, last.reshape(n * k, 1), repeat_rows(r["inputs"], k))
        logp = jax.nn.log_softmax(logits).reshape(n, k, v)
        logp = constrain(
            logp, r["live_seqs"], i, eos_id, no_repeat_ngram, r["min_lengths"], r["max_lengths"]
        )
        new, origin = _advance(r, logp, i, eos_id, alpha)
        cache = take_cache_rows(
            cache, (jnp.arange(n)[:, None] * k + origin).reshape(-1), beams_only=True
        )
        act = r["active"]
        r = r | {
            name: jnp.where(act.reshape(n, *[1] * (x.ndim - 1)), x, r[name])
            for name, x in new.items()
        }
        undecided = _undecided(stop, i + 1, r["live_logp"], r["fin_scores"], alpha, r["max_lp"])
        return r | {"active": act & undecided}, cache

    rows = run_shrinking(step, jnp.int32(0), rows, cache, stop_at, sizes, k, (first, max_length))
    return _best(rows, k, alpha)


def _advance(r: dict, logp: Array, i, eos_id: int, alpha: float) -> tuple[dict, Array]:
    """From the live beams' next-token ``logp [n, k, v]``: the new live beams (the k best
    candidates that did not end), the finished ones with those ending here, and each
    new live beam's origin ``[n, k]`` (the beam whose cache rows it continues).
    ``i``: the step, shared by the rows, or ``[n]``, one per row (continuous batching)."""
    n, k, v = logp.shape
    cand = (r["live_logp"][..., None] + logp).reshape(n, k * v)
    top_logp, top_idx = block_top_k(cand, 2 * k)  # 2k: at least k of them are not EOS
    beam, token = top_idx // v, (top_idx % v).astype(jnp.int32)
    seqs = jnp.take_along_axis(r["live_seqs"], beam[..., None], axis=1)
    if jnp.ndim(i) == 0:
        seqs = lax.dynamic_update_slice_in_dim(seqs, token[..., None], i, axis=2)
    else:
        here = jnp.arange(seqs.shape[2]) == i[:, None, None]
        seqs = jnp.where(here, token[..., None], seqs)
    is_eos = token == eos_id
    live_logp, pick = lax.top_k(jnp.where(is_eos, NEG_INF, top_logp), k)
    length = jnp.reshape(jnp.asarray(i + 1, top_logp.dtype), (-1, 1))  # [1, 1] or [n, 1]
    penalised = top_logp / length_penalty(length, alpha)
    ended = jnp.where(is_eos & (top_logp > NEG_INF / 2), penalised, NEG_INF)
    fin_scores, keep = lax.top_k(jnp.concatenate([r["fin_scores"], ended], axis=1), k)
    fin_seqs = jnp.concatenate([r["fin_seqs"], seqs], axis=1)
    new = {
        "live_seqs": jnp.take_along_axis(seqs, pick[..., None], axis=1),
        "live_logp": live_logp,
        "fin_seqs": jnp.take_along_axis(fin_seqs, keep[..., None], axis=1),
        "fin_scores": fin_scores,
        "steps": r["steps"] + 1,
    }
    return new, jnp.take_along_axis(beam, pick, axis=1)


def _best(rows: dict, k: int, alpha: float) -> tuple[Array, Array]:
    """The k hypotheses of each row, best first. A row that stopped on its rule keeps
    its finished hypotheses, topped up with its best live beams (scored at the length
    they reached) where fewer than k ended; in a row that reached the length limit
    still searching, the live beams compete with the finished ones by score."""
    fin, live = rows["fin_scores"], rows["live_logp"]
    lp = length_penalty(rows["steps"].astype(fin.dtype), alpha)[:, None]
    scores = jnp.concatenate([fin, jnp.where(live > NEG_INF / 2, live / lp, NEG_INF)], axis=1)
    seqs = jnp.concatenate([rows["fin_seqs"], rows["live_seqs"]], axis=1)
    ended = jnp.sum(fin > NEG_INF / 2, axis=1, keepdims=True)
    j = jnp.arange(k)[None, :]
    topped_up = jnp.where(j < ended, j, k + j - ended)  # both parts are sorted already
    # A stopped row ranks only those k; a row still searching at the limit, all 2k.
    chosen = jnp.zeros(scores.shape, bool).at[jnp.arange(len(scores))[:, None], topped_up].set(True)
    _, keep = lax.top_k(jnp.where(rows["active"][:, None] | chosen, scores, 2 * NEG_INF), k)
    return jnp.take_along_axis(seqs, keep[..., None], 1), jnp.take_along_axis(scores, keep, 1)


def _undecided(stop: str, i, live_logp, fin_scores, alpha: float, max_lp) -> Array:
    """``[b]``: the rows a beam search must go on with after step ``i - 1``.

    - ``exact``: some live beam can still beat the best finished one. With alpha >= 0
      a live beam's score can only fall below logp / lp(L), L the longest output its
      row may still reach (``max_lp`` = lp(L)): the result is the best-scoring
      hypothesis the beam can find, but a row of short outputs steps on towards L
      when alpha is large.
    - ``current``: the rule of transformers' ``generate`` (``early_stopping=False``):
      a row is done once ``beam_size`` hypotheses have finished and the worst of
      them beats the best live beam scored as if it ended at the next step
      (logp / lp(i + 1)). A live beam could still gain by growing longer, so it may
      stop before ``exact`` finds a better hypothesis; it never steps on for nothing.
      (Comparing with the best finished hypothesis instead stopped too early: 96.8%
      of the demo's test outputs identical to ``exact``'s, BLEU -0.16.)
    - ``finished``: fewer than ``beam_size`` hypotheses have finished (transformers'
      ``early_stopping=True``, and fairseq's).

    A row with no live beam left is done under every rule.
    """
    alive = live_logp[:, 0] > NEG_INF / 2
    if stop == "finished":
        return (fin_scores[:, -1] <= NEG_INF / 2) & alive
    if stop == "exact":
        return fin_scores[:, 0] < live_logp[:, 0] / max_lp
    reach = length_penalty((i + 1).astype(max_lp.dtype), alpha)
    return alive & (fin_scores[:, -1] < live_logp[:, 0] / reach)


def strip(ids, eos_id: int) -> list[list[int]]:
    """Token lists up to (not including) the first EOS or padding."""
    rows = jax.device_get(ids).tolist()
    ends = [next((j for j, t in enumerate(row) if t in (eos_id, 0)), len(row)) for row in rows]
    return [row[:end] for row, end in zip(rows, ends, strict=True)]
