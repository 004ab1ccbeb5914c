"""Which GPU kernel runs a head group under ``model.attention_impl=cudnn``, by its
pattern: cuDNN's fused kernel where cuDNN computes the pattern (dense, causal, a causal
window), the project's band kernel for a two-sided window, its block-sparse kernel for
every other static pattern; top-k attention has none. Read by the config rules
(:mod:`~flaxformer_lite.config.rules`), the model's dispatch and its start-up lines.
"""

from __future__ import annotations

from flaxformer_lite.sparse import patterns as P

__all__ = ["GPU_KERNELS", "cudnn_computes", "cudnn_window", "gpu_kernel"]


def cudnn_window(pattern: P.Pattern) -> tuple[bool, int | None]:
    """(causal, left window w: keys ``i-w..i``) of a pattern cuDNN's kernel computes, or
    ValueError. A two-sided Local band is not among them (see :func:`gpu_kernel`)."""
    if type(pattern) is P.Full:
        return pattern.is_causal, None
    if type(pattern) is P.Local and pattern.is_causal:
        return True, pattern.window
    if type(pattern) is P.Local:
        raise ValueError(
            f"cuDNN's sliding window is left-only (causal), and Local(window={pattern.window}) "
            "is two-sided; it runs on the band kernel (sparse/band_gpu.py)"
        )
    raise ValueError(
        f"cuDNN computes dense, causal and local-window attention, not "
        f"{type(pattern).__name__}; it runs on the block-sparse kernel (sparse/block_sparse_gpu.py)"
    )


# The kernels that attention_impl=cudnn runs a head group on, by its pattern: cuDNN for
# dense, causal and causal-window attention; the project's band kernel for a two-sided
# window; the project's fused block-sparse kernel for every other static pattern.
GPU_KERNELS = {
    "cudnn": "cuDNN's fused kernel",
    "band": "the band kernel (Triton)",
    "block_sparse": "the block-sparse kernel (Triton)",
}


def gpu_kernel(pattern: P.Pattern) -> str:
    """The :data:`GPU_KERNELS` entry that runs ``pattern`` under ``attention_impl=cudnn``;
    ValueError for dynamic attention (its keys depend on the content: no fused kernel)."""
    if isinstance(pattern, P.Dynamic):
        name = "topk" if isinstance(pattern, P.TopK) else type(pattern).__name__.lower()
        raise ValueError(
            f"{name} attention's keys depend on the scores, and no fused GPU kernel "
            "computes it yet; use attention_impl=blocked for that head group's model"
        )
    if type(pattern) is P.Full or (type(pattern) is P.Local and pattern.is_causal):
        return "cudnn"
    return "band" if type(pattern) is P.Local else "block_sparse"


def cudnn_computes(pattern: P.Pattern) -> bool:
    """True if cuDNN's own kernel computes ``pattern`` (see :func:`gpu_kernel`)."""
    return gpu_kernel(pattern) == "cudnn"
