"""The rules a search obeys besides the model: which tokens sampling may draw
(top-k, top-p), and which tokens beam search may not append (a repeated n-gram, EOS
before a row's minimum length, anything but EOS at its maximum).

Legend: b batch, k beams, t decoded length, v vocabulary.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import Array, lax

NEG_INF = -1.0e9


def draw(key: Array, logits: Array, block: int = 128) -> Array:
    """One token per row ``[b]`` from ``softmax(logits [b, v])``, by the inverse of its
    distribution function at one uniform number per row (:func:`inverse_cdf`).

    ``jax.random.categorical`` adds Gumbel noise to every logit: 8,000 random numbers
    per row and step, 2.1 ms of a 16-row step of the LM on a 2-core CPU, against
    0.11 ms here (the draws differ from categorical's for the same key; both are
    exact samples of the distribution)."""
    u = jax.random.uniform(key, logits.shape[:-1], jnp.float32)
    return inverse_cdf(logits, u, block)


def inverse_cdf(logits: Array, u: Array, block: int = 128) -> Array:
    """``[b]``: the first token whose cumulative probability exceeds ``u [b]`` (in
    [0, 1)): the block of ``block`` tokens first, then the token inside it, so that
    each cumulative sum runs over ~sqrt(v) terms (float32 keeps ~1e-6 of the mass).
    A token of probability zero (a filtered logit) is never chosen, whatever ``u``."""
    b, v = logits.shape
    x = logits.astype(jnp.promote_types(logits.dtype, jnp.float32))
    p = jnp.exp(x - jnp.max(x, axis=-1, keepdims=True))
    p = jnp.pad(p, ((0, 0), (0, -v % block))).reshape(b, -1, block)  # padding: mass 0
    mass = p.sum(axis=-1)  # [b, blocks]
    ends = jnp.cumsum(mass, axis=-1)
    target = u.astype(x.dtype) * ends[:, -1]
    j = _first_above(ends, target, mass)
    inside = jnp.take_along_axis(p, j[:, None, None], axis=1)[:, 0]  # [b, block]
    before = jnp.take_along_axis(ends - mass, j[:, None], axis=1)
    i = _first_above(before + jnp.cumsum(inside, axis=-1), target, inside)
    return (j * block + i).astype(jnp.int32)


def _first_above(cum: Array, target: Array, mass: Array) -> Array:
    """``[b]``: the first index whose ``cum`` exceeds ``target``; where rounding leaves
    none, the last index with mass (never one of probability zero)."""
    n = cum.shape[-1]
    hit = (cum > target[:, None]) & (mass > 0)
    last = n - 1 - jnp.argmax(mass[:, ::-1] > 0, axis=-1)
    return jnp.where(hit.any(axis=-1), jnp.argmax(hit, axis=-1), last)


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


def repeated_ngram_mask(seqs: Array, length: Array, n: int, vocab_size: int) -> Array:
    """``[..., vocab]`` True where appending the token to ``seqs[..., :length]`` would
    repeat an ``n``-gram already in it (fairseq's ``--no-repeat-ngram-size``).
    ``length``: shared, or one per leading row (``[b]`` for ``seqs [b, k, t]``)."""
    *lead, t = seqs.shape
    flat = seqs.reshape(-1, t)
    windows = t - n + 1
    if windows <= 0:
        return jnp.zeros((*lead, vocab_size), bool)
    if jnp.ndim(length):  # each row its own length
        length = jnp.broadcast_to(jnp.reshape(length, (-1, *[1] * (len(lead) - 1))), lead)
        length = length.reshape(-1, 1)
        prefix = [
            jnp.take_along_axis(flat, jnp.maximum(length - n + 1 + m, 0), axis=1)[:, 0]
            for m in range(n - 1)
        ]
    else:
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


def constrain(logp, seqs, i, eos_id, no_repeat_ngram, min_lengths, max_lengths):
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
