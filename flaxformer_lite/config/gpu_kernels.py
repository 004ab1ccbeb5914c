"""Which GPU kernel runs a head group under ``model.attention_impl=cudnn``, by its
pattern: cuDNN's fused kernel where cuDNN computes the pattern (dense, causal, a causal
window), the project's band kernel for a two-sided window, its block-sparse kernel for
every other static pattern, its routed block kernel for ``moba`` and ``nsa`` (their
chosen blocks; NSA's window on the band kernel); top-k attention has none. Read by the config rules
(:mod:`~flaxformer_lite.config.rules`), the model's dispatch and its start-up lines.
"""

from __future__ import annotations

from flaxformer_lite.sparse.grammar import patterns as P

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
            "is two-sided; it runs on the band kernel (sparse/ops/band/pallas_triton.py)"
        )
    raise ValueError(
        f"cuDNN computes dense, causal and local-window attention, not "
        f"{type(pattern).__name__}; it runs on the block-sparse kernel "
        "(sparse/ops/block_sparse/pallas_triton.py)"
    )


# The kernels that attention_impl=cudnn runs a head group on, by its pattern: cuDNN for
# dense, causal and causal-window attention; the project's band kernel for a two-sided
# window; the project's fused block-sparse kernel for every other static pattern.
GPU_KERNELS = {
    "cudnn": "cuDNN's fused kernel",
    "band": "the band kernel (Triton)",
    "block_sparse": "the block-sparse kernel (Triton)",
    "routed": "the routed block kernel (Triton)",
}


def gpu_kernel(pattern: P.Pattern) -> str:
    """The :data:`GPU_KERNELS` entry that runs ``pattern`` under ``attention_impl=cudnn``;
    ValueError for top-k attention (every score decides: no fused kernel) and for a
    routed block that is not a tile of Triton (a power of two of at least 16)."""
    if isinstance(pattern, P.TopK):
        raise ValueError(
            "topk attention's keys depend on the scores (every one), and no fused GPU kernel "
            "computes it; use attention_impl=blocked for that model, or moba/nsa (block routing)"
        )
    if isinstance(pattern, P.Dynamic):  # moba, nsa
        block = pattern.block
        if block < 16 or block & (block - 1):
            raise ValueError(
                f"the routed block kernel's key tiles are the routing's blocks, and block="
                f"{block} is no power of two >= 16; use block=16, 32, 64 or 128, or "
                "attention_impl=blocked"
            )
        return "routed"
    if type(pattern) is P.Full or (type(pattern) is P.Local and pattern.is_causal):
        return "cudnn"
    return "band" if type(pattern) is P.Local else "block_sparse"


def cudnn_computes(pattern: P.Pattern) -> bool:
    """True if cuDNN's own kernel computes ``pattern`` (see :func:`gpu_kernel`)."""
    return gpu_kernel(pattern) == "cudnn"
