"""Token-level cross-entropy with label smoothing, normalised by non-padding tokens.

Label smoothing as in the paper (eps_ls = 0.1): the target distribution puts
1 - eps on the label and eps / (V - 1) on every other token. The reported
``loss`` is that cross-entropy; ``nll`` is the plain negative log-likelihood
of the labels, whose exponential is the perplexity.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import Array


def _statistics(logits: Array, labels: Array, smoothing: float):
    """Per token: (smoothed cross-entropy, nll, correct) and the log-partition ``lse``.

    The label's logit is a gather of one value per token (its own gradient would be a
    scatter: :func:`_backward` replaces it).
    """
    vocab = logits.shape[-1]
    lse = jax.nn.logsumexp(logits, axis=-1)
    label_logit = jnp.take_along_axis(logits, labels[..., None], axis=-1)[..., 0]
    nll = lse - label_logit
    if smoothing == 0.0:
        smoothed = nll
    else:
        confidence, low = 1.0 - smoothing, smoothing / (vocab - 1)
        # sum_v q_v z_v with q = low everywhere except confidence at the label.
        expected = low * jnp.sum(logits, axis=-1) + (confidence - low) * label_logit
        smoothed = lse - expected
    # Correct when the label's logit beats every other logit (a tie counts as wrong,
    # so constant logits score 0): argmax is a slow variadic reduction on XLA:CPU.
    is_label = jnp.arange(vocab) == labels[..., None]
    best_other = jnp.max(jnp.where(is_label, -jnp.inf, logits), axis=-1)
    correct = (label_logit > best_other).astype(jnp.float32)
    return (smoothed, nll, correct), lse


@functools.partial(jax.custom_vjp, nondiff_argnums=(2,))
def _token_statistics(logits: Array, labels: Array, smoothing: float):
    return _statistics(logits, labels, smoothing)[0]


def _forward(logits, labels, smoothing):
    out, lse = _statistics(logits, labels, smoothing)
    return out, (logits, labels, lse)


def _backward(smoothing, residuals, cotangents):
    """d/dz of g_s * smoothed + g_n * nll = (g_s + g_n) softmax(z) - g_s q - g_n onehot,
    one elementwise pass over the logits: the gather's gradient would be a scatter
    (slow on CPU) and autodiff of the reductions materializes several ``[..., vocab]``
    arrays."""
    logits, labels, lse = residuals
    g_s, g_n, _ = cotangents
    vocab = logits.shape[-1]
    low = smoothing / (vocab - 1) if smoothing else 0.0
    at_label = (g_s * (1.0 - smoothing - low) + g_n)[..., None]
    probs = jnp.exp(logits - lse[..., None])
    is_label = jnp.arange(vocab) == labels[..., None]
    grad = (g_s + g_n)[..., None] * probs - (g_s * low)[..., None]
    grad = grad - jnp.where(is_label, at_label, 0.0)
    return grad.astype(logits.dtype), None


_token_statistics.defvjp(_forward, _backward)


def token_losses(logits: Array, labels: Array, smoothing: float) -> tuple[Array, Array]:
    """Per-token (smoothed cross-entropy, nll), each ``[batch, length]``, in float32.

    Written as ``logsumexp(z) - sum_v q_v z_v`` (q sums to one), with a hand-written
    gradient ``softmax(z) - q`` in one pass (no one-hot array, no scatter).
    """
    smoothed, nll, _ = _token_statistics(logits.astype(jnp.float32), labels, smoothing)
    return smoothed, nll


def sums(logits: Array, labels: Array, weights: Array, smoothing: float) -> dict[str, Array]:
    """Summed statistics of a batch (summed so devices and micro-batches can add them)."""
    weights = weights.astype(jnp.float32)
    smoothed, nll, correct = _token_statistics(logits.astype(jnp.float32), labels, smoothing)
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
