"""Accelerator attention kernels behind ``model.attention_impl``.

* ``cudnn``: ``jax.nn.dot_product_attention`` -- cuDNN's fused flash-attention
  kernel on NVIDIA GPUs -- for dense, causal and local-window attention
  (``attention_pattern`` dense, ``full`` or ``local:window=w``, per head group).
* ``splash``: TPU splash attention (Pallas) for any of the project's sparse
  patterns: ``Full`` -> ``FullMask``/``CausalMask``, ``Local`` -> ``LocalMask``,
  a causal one-block ``BlockLocal`` -> ``ChunkedCausalMask``, anything else -> a
  ``NumpyMask`` of the pattern's ``[n, n]`` matrix; one mask per head, as a
  ``MultiHeadMask``. Splash skips the key blocks a mask leaves empty.

Both take ``[b, n, h, d]`` arrays and return the same values as the project's
own kernels (tests/test_kernels.py: values and gradients, on CPU through
``implementation="xla"`` and Pallas' interpreter). On a platform a kernel does
not run on, :func:`platform_mode` raises one message naming what to pick.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np
from jax import Array

from flaxformer_lite.config import ConfigError, ModelConfig, register_check
from flaxformer_lite.sparse import patterns as P
from flaxformer_lite.sparse.online_softmax import segment_mask

FUSED = ("cudnn", "splash")


def platform_mode(impl: str):
    """How ``impl`` runs here: ``"cudnn"`` on a GPU; splash's ``interpret`` flag
    (False) on a TPU; a ValueError naming the alternative elsewhere. Tests replace
    this function to run both kernels on CPU (``"xla"``, ``interpret=True``)."""
    platform = jax.default_backend()
    if impl == "cudnn" and platform == "gpu":
        return "cudnn"
    if impl == "splash" and platform == "tpu":
        return False
    needs = {"cudnn": "an NVIDIA GPU", "splash": "a TPU"}[impl]
    raise ValueError(
        f"model.attention_impl={impl} needs {needs}, and this is {platform}; use "
        "attention_impl=blocked (the project's kernels run everywhere)"
        + (", or splash on a TPU" if impl == "cudnn" else ", or cudnn on a GPU")
    )


# cuDNN ------------------------------------------------------------------------------


def cudnn_window(pattern: P.Pattern) -> tuple[bool, tuple[int, int] | None]:
    """(causal, local_window_size) of a pattern cuDNN's kernel computes, or ValueError."""
    if type(pattern) is P.Full:
        return pattern.is_causal, None
    if type(pattern) is P.Local:
        w = pattern.window
        return pattern.is_causal, (w, 0 if pattern.is_causal else w)
    raise ValueError(
        f"attention_impl=cudnn computes dense, causal and local-window attention, not "
        f"{type(pattern).__name__}; use attention_impl=blocked (or splash on a TPU)"
    )


def cudnn_attention(
    query: Array,
    key: Array,
    value: Array,
    *,
    mask: Array | None = None,
    pattern: P.Pattern | None = None,
    segments: Array | None = None,
    scale: float | None = None,
    implementation: str | None = None,
) -> Array:
    """``jax.nn.dot_product_attention`` under a boolean ``mask [b, 1|h, q, k]`` and/or
    a Full/Local ``pattern`` and packing ``segments [b, n]``; ``implementation``
    defaults to :func:`platform_mode`."""
    causal, window = cudnn_window(pattern) if pattern is not None else (False, None)
    if segments is not None:
        same = segment_mask(segments[:, :, None], segments[:, None, :])[:, None]
        mask = same if mask is None else mask & same
    return jax.nn.dot_product_attention(
        query,
        key,
        value,
        mask=mask,
        scale=scale,
        is_causal=causal,
        local_window_size=window,
        implementation=implementation or platform_mode("cudnn"),
    )


# Splash ---------------------------------------------------------------------------


def _splash_mask(pattern: P.Pattern, n: int):
    from jax.experimental.pallas.ops.tpu.splash_attention import splash_attention_mask as M

    shape = (n, n)
    kind = type(pattern)
    if kind is P.Full:
        return M.CausalMask(shape) if pattern.is_causal else M.FullMask(shape)
    if kind is P.Local:
        w = pattern.window
        return M.LocalMask(shape, (w, 0 if pattern.is_causal else w), offset=0)
    if kind is P.BlockLocal and pattern.radius == 0 and pattern.is_causal:
        return M.ChunkedCausalMask(shape, pattern.block_size)
    return M.NumpyMask(np.asarray(pattern.mask(n)))


def splash_attention(
    query: Array,
    key: Array,
    value: Array,
    patterns: list[P.Pattern],
    *,
    segments: Array | None = None,
    scale: float | None = None,
    block_size: int = 512,
    interpret: bool | None = None,
) -> Array:
    """``[b, n, h, d]`` self-attention, head group ``g`` under ``patterns[g]``, by the
    TPU splash kernel (``interpret``: Pallas' interpreter, for CPU; default
    :func:`platform_mode`). ``n`` must be a multiple of 128."""
    from jax.experimental.pallas.ops.tpu.splash_attention import splash_attention_kernel as K
    from jax.experimental.pallas.ops.tpu.splash_attention import splash_attention_mask as M

    b, n, h, d = query.shape
    if interpret is None:
        interpret = platform_mode("splash")
    if n % 128:
        raise ValueError(
            f"attention_impl=splash needs a length that is a multiple of 128, got {n}; "
            "set data.max_length to one"
        )
    per = h // len(patterns)
    masks = [_splash_mask(p, n) for p in patterns for _ in range(per)]
    block = math.gcd(n, max(128, block_size))
    sizes = K.BlockSizes(
        block_q=block,
        block_kv=block,
        block_kv_compute=block,
        block_q_dkv=block,
        block_kv_dkv=block,
        block_kv_dkv_compute=block,
        block_q_dq=block,
        block_kv_dq=block,
    )
    kernel = K.make_splash_mha(
        M.MultiHeadMask(masks),
        head_shards=1,
        q_seq_shards=1,
        block_sizes=sizes,
        interpret=interpret,
    )
    scale = 1.0 / math.sqrt(d) if scale is None else scale
    heads_first = lambda x: jnp.swapaxes(x, 1, 2)  # noqa: E731 - [b, h, n, d]
    q, k, v = (
        heads_first(query * jnp.asarray(scale, query.dtype)),
        heads_first(key),
        heads_first(value),
    )
    if segments is None:
        out = jax.vmap(kernel)(q, k, v)
    else:
        out = jax.vmap(lambda q, k, v, s: kernel(q, k, v, segment_ids=K.SegmentIds(s, s)))(
            q, k, v, segments.astype(jnp.int32)
        )
    return heads_first(out).astype(query.dtype)


@register_check
def _check_fused(c: ModelConfig) -> None:
    if c.attention_impl not in FUSED:
        return
    if c.score_fn not in ("scaled_dot", "dot"):
        raise ConfigError(
            f"model.attention_impl={c.attention_impl} computes dot-product scores, not "
            f"score_fn={c.score_fn!r}; use scaled_dot or dot, or attention_impl=blocked"
        )
    if c.attention_dropout > 0:
        raise ConfigError(
            f"model.attention_impl={c.attention_impl} has no dropout on the attention "
            f"weights (attention_dropout={c.attention_dropout}); set it to 0 or use "
            "attention_impl=blocked"
        )
    if c.attention_impl == "splash" and not c.sparse_attention:
        raise ConfigError(
            "model.attention_impl=splash runs the sparse attention_pattern's kernel; with "
            "attention_pattern=dense use attention_pattern=full (dense through splash) or "
            "attention_impl=cudnn / blocked"
        )
