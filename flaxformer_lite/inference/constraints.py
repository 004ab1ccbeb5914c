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
