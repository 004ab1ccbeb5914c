"""Autoregressive decoding with the KV cache: greedy, sampling, beam search.

Legend: b batch, k beams, s source length, t decoded length, v vocabulary.

Every search is one jitted program: the encoder runs once, the first step
stores each layer's cross-attention keys/values in the cache, and a
``lax.while_loop`` feeds one token per step through the cached decoder until
every sentence has produced EOS (or ``max_length`` is reached). Outputs are
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

Above 400 lines on purpose: greedy, sampling and beam search share one stepper, its
cache handling and the ensemble mean; split apart, each would repeat them.
"""

from __future__ import annotations

import functools

import flax.linen as nn
import jax
import jax.numpy as jnp
from jax import Array, lax

from flaxformer_lite.config.experiment import BEAM_STOPS
from flaxformer_lite.model.lm import LanguageModel
from flaxformer_lite.model.transformer import Transformer

NEG_INF = -1.0e9
# Arguments every jitted search takes as compile-time constants.
_STATIC = ("model", "max_length", "eos_id", "bos_id")


def bucket(limit: int, cap: int) -> int:
    """The cache length that a search with output ``limit`` compiles for: the next
    multiple of 16, at most ``cap``; the limit itself is traced. (Powers of two
    compile less but cost ~25% of a beam search on CPU: each step reorders and
    reads the whole cache, so its unused tail is paid for.)"""
    return min(-(-max(limit, 1) // 16) * 16, cap)


def is_ensemble(params) -> bool:
    """A tuple/list of parameter trees (an ensemble) rather than one tree."""
    return isinstance(params, tuple | list)


class _Stepper:
    """One decoding step of either architecture over a shared cache protocol.

    For an ensemble (``params`` a tuple of trees) the encoding and the cache are
    tuples with one entry per member, and a step returns the log of the members'
    mean next-token probability."""

    def __init__(self, model: nn.Module, params, inputs: Array | None, repeat: int = 1):
        # ``repeat`` = k for beam search: each source row stands for k adjacent beam
        # rows. The encoder still runs once per source row (its output is repeated),
        # which saves 3/4 of the encoder at beam 4: ~25% of the whole search.
        self.model, self.source, self.repeat = model, inputs, repeat
        self.inputs = _repeat(inputs, repeat) if repeat > 1 else inputs  # decoder masks
        self.members = tuple(params) if is_ensemble(params) else (params,)
        if not self.members:
            raise ValueError("an ensemble needs at least one parameter tree")
        self.is_lm = isinstance(model, LanguageModel)
        if not self.is_lm and inputs is None:
            raise ValueError("the encoder-decoder needs source inputs")

    def init_cache(self, batch: int, max_length: int):
        dummy = jnp.ones((batch, max_length), jnp.int32)
        args = (dummy,) if self.is_lm else (self.inputs, dummy)
        shapes = jax.eval_shape(
            lambda: self.model.init(jax.random.key(0), *args, decode=True)["cache"]
        )
        return tuple(
            jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype), shapes) for _ in self.members
        )

    def encode(self):
        if self.is_lm:
            return None
        encoded = [
            self.model.apply({"params": p}, self.source, method=Transformer.encode)
            for p in self.members
        ]
        return tuple(_repeat(e, self.repeat) if self.repeat > 1 else e for e in encoded)

    def _member_step(self, params, cache, tokens: Array, encoded: Array | None):
        variables = {"params": params, "cache": cache}
        if self.is_lm:
            logits, mutated = self.model.apply(variables, tokens, decode=True, mutable=["cache"])
        else:
            logits, mutated = self.model.apply(
                variables,
                encoded,
                self.inputs,
                tokens,
                decode=True,
                mutable=["cache"],
                method=Transformer.decode,
            )
        return logits[:, -1].astype(score_dtype(self.model)), mutated["cache"]

    def __call__(self, cache, tokens: Array, encoded) -> tuple[Array, tuple]:
        """Logits ``[b, v]`` for the next token after ``tokens [b, 1]``; the new cache.

        One member: its logits. An ensemble: log of the mean member probability."""
        encodings = encoded if encoded is not None else (None,) * len(self.members)
        steps = [
            self._member_step(p, c, tokens, e)
            for p, c, e in zip(self.members, cache, encodings, strict=True)
        ]
        caches = tuple(c for _, c in steps)
        if len(steps) == 1:
            return steps[0][0], caches
        logp = jnp.stack([jax.nn.log_softmax(lg) for lg, _ in steps])
        return jax.nn.logsumexp(logp, axis=0) - jnp.log(len(steps)), caches


def score_dtype(model: nn.Module) -> jnp.dtype:
    """Logits and scores: float32, or float64 for a float64 model (float64 mode is how
    this project checks numerics, so its scores must not be rounded to float32)."""
    return jnp.promote_types(model.config.dtype, jnp.float32)


def _repeat(x: Array | None, k: int) -> Array | None:
    """``[b, ...]`` -> ``[b * k, ...]`` (each row k times, adjacent)."""
    return None if x is None else jnp.repeat(x, k, axis=0)


# Greedy and sampling -----------------------------------------------------------------


def filter_logits(logits: Array, top_k: int = 0, top_p: float = 1.0) -> Array:
    """Keep the ``top_k`` largest logits and/or the smallest set with probability >= top_p."""
    if top_k > 0:
        kth = lax.top_k(logits, top_k)[0][..., -1:]
        logits = jnp.where(logits < kth, NEG_INF, logits)
    if top_p < 1.0:
        order = jnp.argsort(-logits, axis=-1)
        sorted_logits = jnp.take_along_axis(logits, order, axis=-1)
        probs = jax.nn.softmax(sorted_logits, axis=-1)
        before = jnp.cumsum(probs, axis=-1) - probs  # mass strictly above each token
        drop_sorted = before >= top_p
        drop = (
            jnp.zeros_like(drop_sorted)
            .at[jnp.arange(logits.shape[0])[:, None], order]
            .set(drop_sorted)
        )
        logits = jnp.where(drop, NEG_INF, logits)
    return logits


@functools.partial(
    jax.jit, static_argnames=(*_STATIC, "temperature", "top_k", "top_p", "batch_size")
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
) -> Array:
    """Greedy (``temperature=0``) or sampled decoding; returns ``[b, max_length]`` ids.

    ``limit`` (traced; a scalar, or ``[b]`` for each row its own): at most that many
    tokens, the rest of a row padding. Per-row limits make a row's output independent
    of its batch-mates; a padding row with limit 0 is done from the start."""
    stepper = _Stepper(model, params, inputs)
    b = (
        inputs.shape[0]
        if inputs is not None
        else (prefix.shape[0] if prefix is not None else batch_size)
    )
    encoded = stepper.encode()
    cache = stepper.init_cache(b, max_length)
    rng = jax.random.key(0) if rng is None else rng
    if prefix is not None:  # 0 = not forced; indexing past its end would clamp, so pad it
        prefix = jnp.pad(
            prefix[:, :max_length], ((0, 0), (0, max(max_length - prefix.shape[1], 0)))
        )

    def choose(logits, i):
        if temperature == 0.0:
            token = jnp.argmax(logits, axis=-1)
        else:
            scaled = filter_logits(logits / temperature, top_k, top_p)
            token = jax.random.categorical(jax.random.fold_in(rng, i), scaled, axis=-1)
        if prefix is not None:
            forced = prefix[:, i]
            token = jnp.where(forced > 0, forced, token)
        return token.astype(jnp.int32)

    logits, cache = stepper(cache, jnp.full((b, 1), bos_id, jnp.int32), encoded)
    first = choose(logits, 0)
    out = jnp.zeros((b, max_length), jnp.int32).at[:, 0].set(first)
    rows = jnp.full((b,), max_length, jnp.int32) if limit is None else jnp.broadcast_to(limit, (b,))
    out = jnp.where((rows > 0)[:, None], out, 0)
    done = (first == eos_id) | (rows <= 1)

    stop_at = jnp.minimum(jnp.max(rows), max_length)

    def cond(carry):
        i, _, _, done, _ = carry
        return (i < stop_at) & ~jnp.all(done)

    def body(carry):
        i, out, cache, done, last = carry
        logits, cache = stepper(cache, last[:, None], None)
        token = jnp.where(done, 0, choose(logits, i))
        out = lax.dynamic_update_slice_in_dim(out, token[:, None], i, axis=1)
        return i + 1, out, cache, done | (token == eos_id) | (i + 1 >= rows), token

    _, out, _, _, _ = lax.while_loop(cond, body, (jnp.int32(1), out, cache, done, first))
    return out


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


def _gather_beams(tree, beam_index: Array, batch: int, beams: int):
    """Reorder every ``[b*k, ...]`` self-attention cache leaf by ``beam_index [b, k]``."""

    # Whole rows of the flattened [b*k, ...] leaves. This copy of the cache is
    # memory-bound: ~15% of a beam-4 search in benchmarks/decode.py.
    rows = (jnp.arange(batch)[:, None] * beams + beam_index).reshape(-1)

    def gather(path, x):
        name = jax.tree_util.keystr(path)
        # Counters, cross K/V and a ring buffer's slot positions are the same for
        # every beam; only per-row leaves follow their beams.
        if x.ndim == 0 or "cross_" in name or "cached_positions" in name:
            return x
        return x.at[rows].get(mode="promise_in_bounds")

    return jax.tree_util.tree_map_with_path(gather, tree)


def repeated_ngram_mask(seqs: Array, length: Array, n: int, vocab_size: int) -> Array:
    """``[..., vocab]`` True where appending the token to ``seqs[..., :length]`` would
    repeat an ``n``-gram already in it (fairseq's ``--no-repeat-ngram-size``)."""
    *lead, t = seqs.shape
    flat = seqs.reshape(-1, t)
    windows = t - n + 1
    if windows <= 0:
        return jnp.zeros((*lead, vocab_size), bool)
    # The n-1 tokens before the next one, and every earlier n-gram's first n-1 tokens.
    prefix = [
        lax.dynamic_index_in_dim(flat, jnp.maximum(length - n + 1 + m, 0), 1, False)
        for m in range(n - 1)
    ]
    match = jnp.arange(windows)[None, :] <= length - n  # n-grams that lie in the prefix
    for m in range(n - 1):
        match &= flat[:, m : m + windows] == prefix[m][:, None]
    follower = flat[:, n - 1 : n - 1 + windows]
    rows = jnp.arange(flat.shape[0])[:, None]
    banned = jnp.zeros((flat.shape[0], vocab_size), bool).at[rows, follower].max(match)
    return banned.reshape(*lead, vocab_size)


@functools.partial(
    jax.jit, static_argnames=(*_STATIC, "beam_size", "alpha", "no_repeat_ngram", "stop")
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
) -> tuple[Array, Array]:
    """Beam search with length penalty; returns (``[b, k, t]`` ids, ``[b, k]`` scores).

    ``min_lengths`` / ``max_lengths`` (``[b]`` ints, optional): per-sentence bounds on
    the tokens before EOS (EOS forbidden before the minimum, forced at the maximum),
    e.g. to tie the output length to the source length.

    ``no_repeat_ngram`` = n > 0 forbids any hypothesis to contain the same n tokens
    twice (a guard against an undertrained model's loops); 0 = off, as in the paper.

    Hypotheses are sorted by penalised score log p / ((5+len)/6)^alpha, best first.
    Finished hypotheses (ended by EOS) are kept apart from the live ones; ``stop``
    says when a row is done (:func:`_undecided`: exact, current or finished). At the
    limit (``max_length``, or the traced ``limit`` below it), rows without enough
    finished hypotheses take live ones.
    """
    if stop not in BEAM_STOPS:
        raise ValueError(f"stop={stop!r}; choose one of {', '.join(BEAM_STOPS)}")
    b, k, v = inputs.shape[0], beam_size, model.config.vocab_size
    stepper = _Stepper(model, params, inputs, repeat=k)
    encoded = stepper.encode()
    cache = stepper.init_cache(b * k, max_length)

    live_seqs = jnp.zeros((b, k, max_length), jnp.int32)
    # Only beam 0 is alive at the start, so the first step does not pick k copies.
    wide = score_dtype(model)
    live_logp = jnp.tile(jnp.array([0.0] + [NEG_INF] * (k - 1), wide), (b, 1))
    fin_seqs = jnp.zeros((b, k, max_length), jnp.int32)
    fin_scores = jnp.full((b, k), NEG_INF, wide)
    stop_at = max_length if limit is None else jnp.minimum(limit, max_length)
    longest = jnp.full((b,), stop_at, jnp.int32)  # the longest output each row can reach
    if max_lengths is not None:
        longest = jnp.minimum(longest, max_lengths + 1)
    max_lp = length_penalty(longest.astype(wide), alpha)

    def step(i, live_seqs, live_logp, fin_seqs, fin_scores, cache, encoded):
        last = jnp.where(
            i == 0, bos_id, lax.dynamic_index_in_dim(live_seqs, jnp.maximum(i - 1, 0), 2, False)
        )
        logits, cache = stepper(cache, last.reshape(b * k, 1), encoded)
        logp = jax.nn.log_softmax(logits).reshape(b, k, v)
        logp = _constrain(logp, live_seqs, i, eos_id, no_repeat_ngram, min_lengths, max_lengths)
        cand = (live_logp[..., None] + logp).reshape(b, k * v)
        top_logp, top_idx = lax.top_k(cand, 2 * k)  # 2k: at least k of them are not EOS
        beam, token = top_idx // v, (top_idx % v).astype(jnp.int32)
        seqs = jnp.take_along_axis(live_seqs, beam[..., None], axis=1)
        seqs = lax.dynamic_update_slice_in_dim(seqs, token[..., None], i, axis=2)
        is_eos = token == eos_id
        # New live beams: the k best candidates that did not end.
        live_cand = jnp.where(is_eos, NEG_INF, top_logp)
        new_logp, pick = lax.top_k(live_cand, k)
        new_live = jnp.take_along_axis(seqs, pick[..., None], axis=1)
        cache = _gather_beams(cache, jnp.take_along_axis(beam, pick, axis=1), b, k)
        # New finished: merge the candidates that ended here with the old finished.
        penalised = top_logp / length_penalty(jnp.asarray(i + 1, wide), alpha)
        ended = jnp.where(is_eos & (top_logp > NEG_INF / 2), penalised, NEG_INF)
        all_scores = jnp.concatenate([fin_scores, ended], axis=1)
        all_seqs = jnp.concatenate([fin_seqs, seqs], axis=1)
        fin_scores, keep = lax.top_k(all_scores, k)
        fin_seqs = jnp.take_along_axis(all_seqs, keep[..., None], axis=1)
        return new_live, new_logp, fin_seqs, fin_scores, cache

    carry = step(0, live_seqs, live_logp, fin_seqs, fin_scores, cache, encoded)

    def cond(c):
        i, live_seqs, live_logp, fin_seqs, fin_scores, cache = c
        undecided = _undecided(stop, i, live_logp, fin_scores, alpha, max_lp)
        return (i < stop_at) & jnp.any(undecided)

    def body(c):
        i, *state = c
        return (i + 1, *step(i, *state, None))

    i, live_seqs, live_logp, fin_seqs, fin_scores, _ = lax.while_loop(
        cond, body, (jnp.int32(1), *carry)
    )
    # Rows short of finished hypotheses: fill with live beams scored at the length reached.
    live_scores = live_logp / length_penalty(i.astype(wide), alpha)
    all_scores = jnp.concatenate(
        [fin_scores, jnp.where(live_logp > NEG_INF / 2, live_scores, NEG_INF)], axis=1
    )
    all_seqs = jnp.concatenate([fin_seqs, live_seqs], axis=1)
    scores, keep = lax.top_k(all_scores, k)
    return jnp.take_along_axis(all_seqs, keep[..., None], axis=1), scores


def _undecided(stop: str, i, live_logp, fin_scores, alpha: float, max_lp) -> Array:
    """``[b]``: the rows a beam search must go on with after step ``i - 1``.

    - ``exact``: some live beam can still beat the best finished one. With alpha >= 0
      a live beam's score can only fall below logp / lp(L), L the longest output its
      row may still reach (``max_lp`` = lp(L)): the result is the best-scoring
      hypothesis the beam can find, but a row of short outputs steps on towards L
      when alpha is large.
    - ``current``: the best live beam, scored as if it ended at the next step
      (logp / lp(i + 1)), beats the best finished one; the rule of transformers'
      ``generate`` (``early_stopping=False``). A live beam could still gain by
      growing longer, so it may stop before ``exact`` finds a better hypothesis; it
      never steps on for nothing.
    - ``finished``: fewer than ``beam_size`` hypotheses have finished (transformers'
      ``early_stopping=True``, and fairseq's); a row with no live beam left is done.
    """
    if stop == "finished":
        return (fin_scores[:, -1] <= NEG_INF / 2) & (live_logp[:, 0] > NEG_INF / 2)
    reach = max_lp if stop == "exact" else length_penalty((i + 1).astype(max_lp.dtype), alpha)
    return fin_scores[:, 0] < live_logp[:, 0] / reach


def _constrain(logp, seqs, i, eos_id, no_repeat_ngram, min_lengths, max_lengths):
    """``logp [b, k, v]`` of step ``i`` under the search's rules: no repeated n-gram,
    no EOS before a row's minimum length, only EOS at its maximum."""
    v = logp.shape[-1]
    eos_logp = logp[..., eos_id : eos_id + 1]  # before any ban
    if no_repeat_ngram > 0:
        banned = repeated_ngram_mask(seqs, i, no_repeat_ngram, v)
        logp = jnp.where(banned, NEG_INF, logp)
    if min_lengths is not None:
        too_short = (i < min_lengths)[:, None]
        logp = logp.at[..., eos_id].set(jnp.where(too_short, NEG_INF, logp[..., eos_id]))
    if max_lengths is not None:
        at_limit = (i >= max_lengths)[:, None, None]
        only_eos = jnp.arange(v) == eos_id
        # A forced EOS costs what the model gives it, even where an n-gram ban hit it.
        logp = jnp.where(at_limit, jnp.where(only_eos, eos_logp, NEG_INF), logp)
    return logp


def strip(ids, eos_id: int) -> list[list[int]]:
    """Token lists up to (not including) the first EOS or padding."""
    out = []
    for row in jax.device_get(ids).tolist():
        seq = []
        for t in row:
            if t in (eos_id, 0):
                break
            seq.append(t)
        out.append(seq)
    return out
