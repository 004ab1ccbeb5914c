"""Which kernel computes which attention, on which backend: the one table.

A head group's attention is one of seven families (:func:`family`, from its pattern);
``model.attention_impl`` picks a column; :data:`TABLE` gives the kernel of each pair or
the reason it is refused. The config rules ask :func:`kernel` before anything runs (a
refusal is a config error naming the value), the model asks it to run each head group
(``model/head_groups.py``), and the start-up line names what it answered
(``model/build.py``). To add a kernel: a :data:`KERNELS` entry, its cells in the table,
and its call in ``model/head_groups.py``.

Reading the table:

- ``blocked`` is the project's XLA kernels, on every platform; ``reference`` the same
  patterns as dense attention under their ``[n, n]`` mask (for checking).
- ``chunked`` is dense attention in query chunks: no sparse pattern.
- ``cudnn`` is NVIDIA's fused kernel where it computes the pattern (dense, causal, a
  causal window: its window is left-only), else the project's Pallas kernels lowered by
  Triton (a two-sided window on the band kernel, every other static pattern on the
  block-sparse kernel, MoBA's and NSA's chosen blocks on the routed block kernel).
- ``splash`` is the TPU's splash attention, with a mask per head read from the pattern.

Packed rows (several sequences a row) change two cells for patterns that are not
offset-invariant (``Pattern.offset_invariant``): ``cudnn``'s block-sparse kernel (one
tile plan for every row) hands them to the blocked XLA kernel, which counts each
sequence from its own start; ``splash`` refuses them (the config, before a run).

Imports nothing but the grammar and no JAX (the config asks it).
"""

from __future__ import annotations

import dataclasses

from flaxformer_lite.sparse.grammar import dynamic as D
from flaxformer_lite.sparse.grammar import patterns as P

__all__ = ["FAMILIES", "IMPLS", "KERNELS", "TABLE", "Kernel", "Refused", "cudnn_computes", "family",
           "gpu_kernel", "kernel"]  # fmt: skip

IMPLS = ("blocked", "reference", "chunked", "cudnn", "splash")


@dataclasses.dataclass(frozen=True)
class Kernel:
    """A kernel: how the start-up line and messages name it, and where its code is."""

    what: str
    where: str


KERNELS = {
    # dense attention (attention_pattern=dense)
    "xla": Kernel("XLA", "model/attention.py (softmax(QK^T) V under a mask)"),
    "chunked": Kernel("chunked XLA", "model/chunked.py"),
    "cudnn": Kernel("cuDNN's fused kernel", "model/kernels.py (jax.nn.dot_product_attention)"),
    "splash": Kernel("splash", "model/kernels.py, masks in sparse/ops/block_sparse/splash.py"),
    # static patterns
    "blocked": Kernel("blocked kernel", "sparse/ops/block_sparse/xla.py"),
    "dense_mask": Kernel("dense mask", "model/head_groups.py (masked_dense_attention)"),
    "band": Kernel("the band kernel (Triton)", "sparse/ops/band/pallas_triton.py"),
    "block_sparse": Kernel(
        "the block-sparse kernel (Triton)", "sparse/ops/block_sparse/pallas_triton.py"
    ),
    # dynamic patterns
    "routed_xla": Kernel("routed block kernel", "sparse/ops/moba/xla.py, sparse/ops/nsa/xla.py"),
    "routed": Kernel(
        "the routed block kernel (Triton)", "sparse/ops/chosen_blocks/pallas_triton_*.py"
    ),
    "topk": Kernel("top-k kernel", "sparse/ops/topk/xla.py"),
}

FAMILIES = ("dense", "full", "causal_window", "window", "static", "routed", "topk")


def family(pattern: P.Pattern | None) -> str:
    """The row of :data:`TABLE` of a head group's pattern (None: dense attention)."""
    if pattern is None:
        return "dense"
    if isinstance(pattern, D.TopK):
        return "topk"
    if isinstance(pattern, D.Dynamic):  # moba, nsa
        return "routed"
    if type(pattern) is P.Full:  # causal or not
        return "full"
    if type(pattern) is P.Local:
        return "causal_window" if pattern.is_causal else "window"
    return "static"


# The refusals, each with what to use instead.
_SPARSE_ONLY = (
    "runs the sparse attention_pattern's kernel; with attention_pattern=dense use "
    "attention_pattern=full (dense through splash) or attention_impl=cudnn / blocked"
)
_DENSE_ONLY = (
    "computes dense attention, not a sparse attention_pattern: use attention_impl=blocked "
    "for sparse patterns, or attention_pattern=dense"
)
_FIXED_MASKS = (
    "its keys depend on the content; splash reads fixed masks: use attention_impl=blocked "
    "(or cudnn on a GPU)"
)
_NO_FUSED_TOPK = (
    "topk attention's keys depend on the scores (every one), and no fused GPU kernel "
    "computes it; use attention_impl=blocked for that model, or moba/nsa (block routing)"
)

# family          blocked        reference      chunked        cudnn            splash
TABLE: dict[str, tuple[str, ...]] = {
    "dense":         ("xla",        "xla",        "chunked",     "cudnn",         _SPARSE_ONLY),
    "full":          ("blocked",    "dense_mask", _DENSE_ONLY,   "cudnn",         "splash"),
    "causal_window": ("blocked",    "dense_mask", _DENSE_ONLY,   "cudnn",         "splash"),
    "window":        ("blocked",    "dense_mask", _DENSE_ONLY,   "band",          "splash"),
    "static":        ("blocked",    "dense_mask", _DENSE_ONLY,   "block_sparse",  "splash"),
    "routed":        ("routed_xla", "routed_xla", _DENSE_ONLY,   "routed",        _FIXED_MASKS),
    "topk":          ("topk",       "topk",       _DENSE_ONLY,   _NO_FUSED_TOPK,  _FIXED_MASKS),
}  # fmt: skip


class Refused(ValueError):
    """A pattern that a kernel choice does not compute, with the reason and the fix."""


def kernel(pattern: P.Pattern | None, impl: str) -> str:
    """The :data:`KERNELS` key that computes ``pattern`` (None: dense attention) under
    ``model.attention_impl=impl``, or :class:`Refused` with the table's reason."""
    if impl not in IMPLS:
        raise Refused(f"attention_impl={impl!r}; choose one of {', '.join(IMPLS)}")
    name = TABLE[family(pattern)][IMPLS.index(impl)]
    if name not in KERNELS:
        raise Refused(name)
    if name == "routed":  # the routed kernel's key tiles are the routing's blocks
        block = pattern.block
        if block < 16 or block & (block - 1):
            raise Refused(
                f"the routed block kernel's key tiles are the routing's blocks, and block="
                f"{block} is no power of two >= 16; use block=16, 32, 64 or 128, or "
                "attention_impl=blocked"
            )
    return name


def gpu_kernel(pattern: P.Pattern) -> str:
    """The kernel of ``pattern`` under ``attention_impl=cudnn`` (``cudnn``, ``band``,
    ``block_sparse`` or ``routed``), or :class:`Refused`."""
    return kernel(pattern, "cudnn")


def cudnn_computes(pattern: P.Pattern) -> bool:
    """True if cuDNN's own kernel computes ``pattern`` (dense, causal, a causal window)."""
    return family(pattern) in ("full", "causal_window")
