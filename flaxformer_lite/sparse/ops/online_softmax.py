"""Partial softmaxes and their exact merge: the arithmetic the sparse kernels share.

A part of an attention computation over some keys of each query gives a
:class:`Partial`: the running max ``m`` ``[b, h, n]``, the sum ``l`` of
``exp(score - m)`` and the unnormalised output ``o`` ``[b, h, n, v]``.
:func:`merge` combines parts over disjoint key sets exactly (the online-softmax
identity), and :func:`normalise` turns ``o / l`` into the attention output, zero
for a query that may attend nothing.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence

import jax
import jax.numpy as jnp
from jax import Array, lax

NEG = -1e30  # stand-in for -inf in running maxima (keeps exp() finite)
FLOOR = -1e29  # least running max: exp(NEG - FLOOR) == 0


@dataclasses.dataclass(frozen=True)
class Partial:
    """Per-query partial softmax: max ``m`` [b,h,n], sum ``l`` [b,h,n], output ``o`` [b,h,n,v]."""

    m: Array
    l: Array
    o: Array


def pad_to(x: Array, length: int, axis: int) -> Array:
    """``x`` zero-padded at the end of ``axis`` to ``length``."""
    extra = length - x.shape[axis]
    if extra == 0:
        return x
    widths = [(0, 0)] * x.ndim
    widths[axis] = (0, extra)
    return jnp.pad(x, widths)


def segment_mask(seg_q: Array | None, seg_k: Array | None) -> Array | None:
    """Same segment and not padding (id 0), broadcast from the shapes given; None if no ids."""
    if seg_q is None:
        return None
    return (seg_q == seg_k) & (seg_k != 0)


def partial_softmax(scores: Array, mask: Array, values_fn: Callable[[Array], Array]) -> Partial:
    """Masked partial softmax over the last axis; ``values_fn(p)`` contracts p with V.

    Masked scores become ``NEG`` and the running max is floored at ``FLOOR``,
    so ``exp(NEG - m)`` is exactly 0 even in a fully masked row (whose ``l``
    is then 0): one select instead of two, over the largest arrays of a kernel.
    """
    scores = jnp.where(mask, scores, NEG)
    m = lax.stop_gradient(jnp.maximum(jnp.max(scores, axis=-1), FLOOR))
    p = jnp.exp(scores - m[..., None])
    return Partial(m, p.sum(-1), values_fn(p))


@jax.custom_vjp
def normalise(o: Array, l: Array) -> Array:
    """``o / l`` per query; queries with nothing to attend (``l == 0``) output zeros.

    Its backward pass is written out (``do = g / l``, ``dl = -sum(g * out) / l``, zero
    where ``l == 0``): autodiff of the quotient gave XLA:CPU a fused
    ``-sum(g * o / l^2)`` that its YNNPACK reduction ran 3x slower (forward+backward
    of ``[1, 8, 16384, 64]``: 74 ms, against 23 ms written out), and every sparse
    kernel's output passes through here, NSA's three times."""
    return _normalise_fwd(o, l)[0]


def _normalise_fwd(o: Array, l: Array):
    inv = jnp.where(l > 0, 1.0 / jnp.where(l > 0, l, 1.0), 0.0)
    out = o * inv[..., None]
    return out, (out, inv)


def _normalise_bwd(residuals, g: Array):
    out, inv = residuals
    return g * inv[..., None], -inv * jnp.einsum("...v,...v->...", g, out)


normalise.defvjp(_normalise_fwd, _normalise_bwd)


def merge(parts: Sequence[Partial]) -> Array:
    """The normalised output of parts over disjoint key sets of the same queries."""
    m = parts[0].m
    for p in parts[1:]:
        m = jnp.maximum(m, p.m)
    l = 0.0
    o = 0.0
    for p in parts:
        w = jnp.exp(p.m - m)
        l = l + p.l * w
        o = o + p.o * w[..., None]
    return normalise(o, l)
