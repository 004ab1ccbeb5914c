"""Token-level cross-entropy with label smoothing, normalised by non-padding tokens.

Label smoothing as in the paper (eps_ls = 0.1): the target distribution puts
1 - eps on the label and eps / (V - 1) on every other token. The reported
``loss`` is that cross-entropy; ``nll`` is the plain negative log-likelihood
of the labels, whose exponential is the perplexity.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import Array


def _label_logits(logits: Array, labels: Array) -> tuple[Array, Array]:
    """The label's logit ``[...]`` and the one-hot label mask ``[..., vocab]``."""
    is_label = jnp.arange(logits.shape[-1]) == labels[..., None]
    return jnp.sum(jnp.where(is_label, logits, 0.0), axis=-1), is_label


def _losses(logits: Array, label_logit: Array, smoothing: float) -> tuple[Array, Array]:
    vocab = logits.shape[-1]
    lse = jax.nn.logsumexp(logits, axis=-1)
    nll = lse - label_logit
    if smoothing == 0.0:
        return nll, nll
    confidence = 1.0 - smoothing
    low = smoothing / (vocab - 1)
    # sum_v q_v z_v with q = low everywhere except confidence at the label.
    expected = low * jnp.sum(logits, axis=-1) + (confidence - low) * label_logit
    return lse - expected, nll


def token_losses(logits: Array, labels: Array, smoothing: float) -> tuple[Array, Array]:
    """Per-token (smoothed cross-entropy, nll), each ``[batch, length]``, in float32.

    Written as ``logsumexp(z) - sum_v q_v z_v`` (q sums to one): no gather and
    no log-probability array, so the gradient is the fused ``softmax(z) - q``
    (a gather's gradient is a scatter, slow on CPU).
    """
    logits = logits.astype(jnp.float32)
    return _losses(logits, _label_logits(logits, labels)[0], smoothing)


def sums(logits: Array, labels: Array, weights: Array, smoothing: float) -> dict[str, Array]:
    """Summed statistics of a batch (summed so devices and micro-batches can add them)."""
    logits = logits.astype(jnp.float32)
    weights = weights.astype(jnp.float32)
    label_logit, is_label = _label_logits(logits, labels)
    smoothed, nll = _losses(logits, label_logit, smoothing)
    # Correct when the label's logit beats every other logit (a tie counts as
    # wrong, so constant logits score 0). Cheaper than argmax, which XLA:CPU
    # lowers to a slow variadic (value, index) reduction (~3% of a tiny step).
    best_other = jnp.max(jnp.where(is_label, -jnp.inf, logits), axis=-1)
    correct = (label_logit > best_other).astype(jnp.float32)
    return {
        "loss_sum": jnp.sum(smoothed * weights),
        "nll_sum": jnp.sum(nll * weights),
        "correct": jnp.sum(correct * weights),
        "tokens": jnp.sum(weights),
    }


def summarize(s: dict[str, Array]) -> dict[str, Array]:
    """Means per non-padding token from ``sums`` (safe for an empty batch)."""
    n = jnp.maximum(s["tokens"], 1.0)
    nll = s["nll_sum"] / n
    return {
        "loss": s["loss_sum"] / n,
        "nll": nll,
        "perplexity": jnp.exp(nll),
        "accuracy": s["correct"] / n,
        "tokens": s["tokens"],
    }
