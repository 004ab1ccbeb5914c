"""Accelerator attention kernels behind ``model.attention_impl``.

* ``cudnn``: cuDNN's fused flash-attention kernel on NVIDIA GPUs (through
  ``jax.nn.dot_product_attention``, and jax's cuDNN module for packed rows) for dense,
  causal and causal local-window attention (``attention_pattern`` dense, ``full`` or
  ``local:window=w``, per head group). The other head groups run on the project's
  Triton kernels: a two-sided window on the band kernel
  (:mod:`flaxformer_lite.sparse.ops.band.pallas_triton`), every other static pattern on the
  block-sparse kernel (:mod:`flaxformer_lite.sparse.ops.block_sparse.pallas_triton`); which kernel
  runs which pattern is the dispatch table's (:mod:`flaxformer_lite.sparse.dispatch`).
  cuDNN's limits and how each is met are listed above :class:`CudnnCall`.
* ``splash``: TPU splash attention (Pallas) for any of the project's sparse
  patterns: ``Full`` -> ``FullMask``/``CausalMask``, ``Local`` -> ``LocalMask``,
  a causal one-block ``BlockLocal`` -> ``ChunkedCausalMask``, anything else -> a mask
  read block by block from the pattern's tile plan (:mod:`flaxformer_lite.sparse.grammar.tiles`,
  the plan the GPU's block-sparse kernel runs on; no ``[n, n]`` array); one mask per
  head, as a ``MultiHeadMask``. Splash skips the key blocks a mask leaves empty.

Both take ``[b, n, h, d]`` arrays and return the same values as the project's
own kernels (tests/test_kernels.py: values and gradients, on CPU through
``implementation="xla"`` and Pallas' interpreter). On a platform a kernel does
not run on, :func:`platform_mode` raises one message naming what to pick.
"""

from __future__ import annotations

import dataclasses
import inspect
import math
import os

import jax
import jax.numpy as jnp
from jax import Array

from flaxformer_lite.sparse.dispatch import cudnn_computes, gpu_kernel
from flaxformer_lite.sparse.grammar import patterns as P
from flaxformer_lite.sparse.ops.block_sparse.splash import splash_mask

__all__ = ["CudnnCall", "cudnn_attention", "cudnn_call", "cudnn_computes",
           "cudnn_window", "gpu_kernel", "platform_mode", "splash_attention"]  # fmt: skip

FUSED = ("cudnn", "splash")


def platform_mode(impl: str):
    """How ``impl`` runs here: ``"cudnn"`` on a GPU; splash's ``interpret`` flag
    (False) on a TPU; a ValueError naming the alternative elsewhere. Tests replace
    this function to run both kernels on CPU (``"xla"``, ``interpret=True``); so does
    ``FLAXFORMER_FUSED_ON_CPU=1`` in the environment, for dry runs of accelerator
    scripts (the same code, computed by XLA / Pallas' interpreter)."""
    platform = jax.default_backend()
    if impl == "cudnn" and platform == "gpu":
        return "cudnn"
    if impl == "splash" and platform == "tpu":
        return False
    if os.environ.get("FLAXFORMER_FUSED_ON_CPU", "0") not in ("", "0"):
        return "xla" if impl == "cudnn" else True
    needs = {"cudnn": "an NVIDIA GPU", "splash": "a TPU"}[impl]
    raise ValueError(
        f"model.attention_impl={impl} needs {needs}, and this is {platform}; use "
        "attention_impl=blocked (the project's kernels run everywhere)"
        + (", or splash on a TPU" if impl == "cudnn" else ", or cudnn on a GPU")
    )


# cuDNN ------------------------------------------------------------------------------
#
# What cuDNN's fused kernel accepts, and how the project meets it (every limit below is
# a conversion or a config rule, tested on CPU by calling the same code with
# implementation="xla"; see tests/test_kernels.py):
#
# * dtype: fp16/bf16 only. A float32 model's q/k/v are rounded to bfloat16 for the
#   kernel (8-bit mantissa: a relative rounding of at most 2^-9 per element; cuDNN
#   accumulates scores, softmax and the value products in float32) and the output is
#   cast back; float16/bfloat16 models pass through; float64 is refused by a config rule.
# * masks: no [b, 1, q, k] boolean mask, which cuDNN would take as a dense bias (O(n^2)
#   memory, the opposite of a fused kernel). Padding goes in as sequence lengths
#   (padding at the end of the row, as the pipeline makes it); packed rows as cuDNN's
#   packed layout: per row, the offset and length of each segment (segments contiguous
#   and numbered in order, as packing makes them, at most ``max_segments`` per row).
# * windows: cuDNN's sliding window is left-only (keys i-w..i) and so implies
#   causality: a causal Local(w) pattern runs on cuDNN, a non-causal one cannot, and
#   the dispatch table (sparse/dispatch.py, which kernel runs which pattern) sends it
#   to the project's band kernel (sparse/ops/band/pallas_triton.py: Triton on a GPU) instead.
# * head size: a multiple of 8 and at most 256 (Hopper; 128 before it): a config rule.

CUDNN_DTYPES = (jnp.bfloat16, jnp.float16)


def cudnn_window(pattern: P.Pattern) -> tuple[bool, int | None]:
    """(causal, left window w: keys ``i-w..i``) of a pattern cuDNN's kernel computes, or
    ValueError. A two-sided Local band is not among them (the dispatch table sends it to
    the band kernel)."""
    if type(pattern) is P.Full:
        return pattern.is_causal, None
    if type(pattern) is P.Local and pattern.is_causal:
        return True, pattern.window
    if type(pattern) is P.Local:
        raise ValueError(
            f"cuDNN's sliding window is left-only (causal), and Local(window={pattern.window}) "
            "is two-sided; it runs on the band kernel (sparse/ops/band/pallas_triton.py)"
        )
    raise ValueError(
        f"cuDNN computes dense, causal and local-window attention, not "
        f"{type(pattern).__name__}; it runs on the block-sparse kernel "
        "(sparse/ops/block_sparse/pallas_triton.py)"
    )


@dataclasses.dataclass(frozen=True)
class CudnnCall:
    """Everything cuDNN's fused kernel receives for one attention: no ``[q, k]`` array.

    ``q_seqlen``/``kv_seqlen``: ``[b]`` real lengths (rows padded at the end), or
    ``[b, m]`` segment lengths with ``q_offsets``/``kv_offsets`` ``[b, m + 1]`` segment
    starts (packed rows; -1 past a row's last segment), or all None (no padding).
    ``window``: keys ``i - window .. i`` (cuDNN's sliding window is ``window + 1``).
    """

    query: Array
    key: Array
    value: Array
    scale: float
    causal: bool = False
    window: int | None = None
    q_seqlen: Array | None = None
    kv_seqlen: Array | None = None
    q_offsets: Array | None = None
    kv_offsets: Array | None = None

    @property
    def packed(self) -> bool:
        return self.q_offsets is not None


def _segment_table(ids: Array, m: int) -> tuple[Array, Array]:
    """(lengths ``[b, m]``, starts ``[b, m + 1]``) of the contiguous runs of equal non-zero
    ids in each row, -1 past the last; O(n) per row (no ``[n, m]`` comparison)."""
    prev = jnp.pad(ids[:, :-1], ((0, 0), (1, 0)))
    nxt = jnp.pad(ids[:, 1:], ((0, 0), (0, 1)))
    starts_at = (ids != 0) & (ids != prev)
    ends_at = (ids != 0) & (ids != nxt)
    first = lambda flags: jnp.nonzero(flags, size=m + 1, fill_value=-1)[0]  # noqa: E731
    starts = jax.vmap(first)(starts_at).astype(jnp.int32)
    ends = jax.vmap(first)(ends_at).astype(jnp.int32)[:, :m]
    lengths = jnp.where(starts[:, :m] >= 0, ends - starts[:, :m] + 1, -1)
    return lengths.astype(jnp.int32), starts.at[:, m].set(-1)


def cudnn_call(
    query: Array,
    key: Array,
    value: Array,
    *,
    causal: bool = False,
    window: int | None = None,
    q_segments: Array | None = None,
    kv_segments: Array | None = None,
    packed: bool = False,
    max_segments: int | None = None,
    scale: float | None = None,
) -> CudnnCall:
    """The arguments cuDNN gets for ``[b, q|k, h, d]`` arrays under token-form masks:
    ``*_segments [b, n]`` ids (0 = padding; one id per row unless ``packed``).
    ``max_segments`` bounds the segments of a packed row (default: half the shorter
    length, since every packed example holds at least a token and its EOS)."""
    d = query.shape[-1]
    scale = 1.0 / math.sqrt(d) if scale is None else float(scale)
    dtype = query.dtype if query.dtype in CUDNN_DTYPES else jnp.bfloat16
    q, k, v = (x.astype(dtype) for x in (query, key, value))
    if q_segments is None and kv_segments is None:
        return CudnnCall(q, k, v, scale, causal, window)
    q_ids = q_segments if q_segments is not None else jnp.ones(query.shape[:2], jnp.int32)
    kv_ids = kv_segments if kv_segments is not None else q_ids
    if not packed:
        lengths = lambda ids: jnp.sum(ids != 0, axis=1, dtype=jnp.int32)  # noqa: E731
        return CudnnCall(q, k, v, scale, causal, window, lengths(q_ids), lengths(kv_ids))
    m = max_segments or max(1, min(q_ids.shape[1], kv_ids.shape[1]) // 2)
    q_len, q_off = _segment_table(q_ids, m)
    kv_len, kv_off = _segment_table(kv_ids, m)
    return CudnnCall(q, k, v, scale, causal, window, q_len, kv_len, q_off, kv_off)


def _public(call: CudnnCall, implementation: str) -> Array:
    """A call without packing through ``jax.nn.dot_product_attention``: lengths, causality
    and the left window as its arguments."""
    return jax.nn.dot_product_attention(
        call.query, call.key, call.value, scale=call.scale, is_causal=call.causal,
        query_seq_lengths=call.q_seqlen, key_value_seq_lengths=call.kv_seqlen,
        local_window_size=None if call.window is None else (call.window, 0),
        implementation=implementation,
    )  # fmt: skip


def _run_cudnn(call: CudnnCall) -> Array:
    """The call on the GPU: jax.nn's public wrapper, or for packed rows the packed layout
    of jax's cuDNN module (not re-exported by jax.nn; Hopper or later)."""
    if not call.packed:
        return _public(call, "cudnn")
    try:
        from jax._src.cudnn import fused_attention_stablehlo as F

        packed_api = "q_offsets" in inspect.signature(F.dot_product_attention).parameters
    except ImportError:
        packed_api = False
    if not packed_api:
        raise ValueError(
            f"attention_impl=cudnn on packed rows needs cuDNN's packed layout, which jax "
            f"{jax.__version__} does not offer; set data.pack=False or attention_impl=chunked"
        )
    return F.dot_product_attention(
        call.query, call.key, call.value, q_seqlen=call.q_seqlen, kv_seqlen=call.kv_seqlen,
        q_offsets=call.q_offsets, kv_offsets=call.kv_offsets, scale=call.scale,
        mask_type=F.MaskType.PADDING_CAUSAL if call.causal else F.MaskType.PADDING,
        sliding_window_length=None if call.window is None else call.window + 1,
    )  # fmt: skip


def _run_xla(call: CudnnCall) -> Array:
    """What the call computes, on any platform (``implementation="xla"``), as cuDNN does
    it: for rows without packing jax.nn's own XLA path on the same arguments; for packed
    rows the mask that the segment table describes, built here from the lengths and
    offsets (what cuDNN reads of them), so that a wrong table fails on CPU. Like cuDNN's
    packed layout (seen on an H200: NaN gradients), nothing is written at tokens outside
    every segment: the output and the gradients of q, k and v are NaN there, so a caller
    that lets them reach a real value fails on CPU too."""
    if not call.packed:
        return _public(call, "xla")
    q_seg, q_pos = _segment_positions(call.q_offsets, call.q_seqlen, call.query.shape[1])
    k_seg, k_pos = _segment_positions(call.kv_offsets, call.kv_seqlen, call.key.shape[1])
    allowed = (q_seg[:, :, None] == k_seg[:, None, :]) & (q_seg[:, :, None] >= 0)
    if call.causal:
        allowed &= k_pos[:, None, :] <= q_pos[:, :, None]
    if call.window is not None:
        allowed &= q_pos[:, :, None] - k_pos[:, None, :] <= call.window
    q_in, k_in = (q_seg >= 0)[:, :, None, None], (k_seg >= 0)[:, :, None, None]
    out = jax.nn.dot_product_attention(
        _unwritten_grad(call.query, q_in), _unwritten_grad(call.key, k_in),
        _unwritten_grad(call.value, k_in), mask=allowed[:, None], scale=call.scale,
        implementation="xla",
    )  # fmt: skip
    return jnp.where(q_in, out, jnp.nan)


@jax.custom_vjp
def _unwritten_grad(x: Array, written: Array) -> Array:
    """``x`` itself; its gradient is NaN where ``written`` is False (cuDNN's packed layout
    leaves those rows of dq/dk/dv unwritten)."""
    return x


def _unwritten_fwd(x, written):
    return x, written


def _unwritten_bwd(written, g):
    return jnp.where(written, g, jnp.nan).astype(g.dtype), None


_unwritten_grad.defvjp(_unwritten_fwd, _unwritten_bwd)


def _segment_positions(offsets: Array, lengths: Array, n: int) -> tuple[Array, Array]:
    """(segment index or -1, position within the segment) of each of ``n`` tokens."""
    t = jnp.arange(n)[None, :, None]
    start, size = offsets[:, None, :-1], lengths[:, None, :]
    inside = (start >= 0) & (t >= start) & (t < start + size)  # [b, n, m]
    seg = jnp.where(inside.any(-1), jnp.argmax(inside, -1), -1)
    pos = jnp.sum(jnp.where(inside, t - start, 0), -1)
    return seg, pos


def cudnn_attention(
    query: Array,
    key: Array,
    value: Array,
    *,
    causal: bool = False,
    pattern: P.Pattern | None = None,
    q_segments: Array | None = None,
    kv_segments: Array | None = None,
    packed: bool = False,
    max_segments: int | None = None,
    scale: float | None = None,
    implementation: str | None = None,
) -> Array:
    """``[b, q, h, d]`` attention by cuDNN's fused kernel (``implementation`` "cudnn",
    the default on a GPU via :func:`platform_mode`, or "xla": the same arguments computed
    by XLA, for CPU tests). ``pattern`` (Full or causal Local) sets the causality and
    window; ``*_segments`` the padding and packing (see :func:`cudnn_call`). Padding
    queries get zeros, as the project's other kernels give them; the output has the
    input's dtype."""
    window = None
    if pattern is not None:
        causal, window = cudnn_window(pattern)
    call = cudnn_call(
        query, key, value, causal=causal, window=window, q_segments=q_segments,
        kv_segments=kv_segments, packed=packed, max_segments=max_segments, scale=scale,
    )  # fmt: skip
    mode = implementation or platform_mode("cudnn")
    if q_segments is not None:
        # cuDNN writes neither the output nor the gradients of q, k and v at tokens outside
        # every segment (padding): those rows hold whatever the buffer held, NaN included.
        # Selecting the inputs makes the gradient a select too (zero there, whatever
        # cuDNN left); the output is selected likewise.
        q_real = (q_segments != 0)[:, :, None, None]
        kv_real = ((kv_segments if kv_segments is not None else q_segments) != 0)[:, :, None, None]
        call = dataclasses.replace(
            call, query=jnp.where(q_real, call.query, 0), key=jnp.where(kv_real, call.key, 0),
            value=jnp.where(kv_real, call.value, 0),
        )  # fmt: skip
    out = (_run_cudnn if mode == "cudnn" else _run_xla)(call)
    if q_segments is not None:
        out = jnp.where(q_real, out, 0)
    return out.astype(query.dtype)


# Splash ---------------------------------------------------------------------------


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
    block = math.gcd(n, max(128, block_size))
    masks = [splash_mask(p, n, block) for p in patterns for _ in range(per)]
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
