"""Everything the project's Pallas GPU kernels take from Triton, in one file.

The kernels (``*/pallas_triton*.py``, ``nsa/compressed_triton.py``, ``moba/routing_triton.py``
and the flash pieces they share in :mod:`~flaxformer_lite.sparse.ops.pallas_flash`)
are written in Pallas' portable terms (``pallas_call``, BlockSpecs, ``pl.program_id``,
``pl.ds``, ``lax.fori_loop`` over refs, ``jnp`` on the loaded tiles); the few operations
whose spelling depends on the backend that lowers them come from here:

- :func:`dot`: a tile product with float32 accumulation;
- :func:`load` / :func:`store`: reading and writing rows of a ref under a mask (Triton
  lowers masked pointer accesses; the rows past a length are neither read nor written);
- :func:`compiler_params`: the launch parameters (Triton's warps and pipeline stages).

No other module of the package imports ``jax.experimental.pallas.triton``
(tests/test_layers.py checks it). A port to Mosaic GPU (JAX's successor to Triton for
Pallas on NVIDIA GPUs) is a second file with these four functions and a switch where
the kernels import this one; their tile sizes would be tuned again there (Mosaic GPU
pipelines through TMA and warpgroups, not Triton's stages).
"""

from __future__ import annotations

from jax.experimental.pallas import triton as _triton

BACKEND = "triton"


def dot(a, b):
    """``a @ b`` of two tiles, accumulated in float32."""
    return _triton.dot(a, b)


def load(ref, *, mask=None, other=None):
    """``ref``'s rows (a ref or a ref view), those outside ``mask`` read as ``other``."""
    return _triton.load(ref, mask=mask, other=other)


def store(ref, value, *, mask=None) -> None:
    """``value`` into ``ref``'s rows where ``mask`` holds."""
    _triton.store(ref, value, mask=mask)


def compiler_params(num_warps: int, num_stages: int, interpret: bool):
    """The launch parameters on a GPU (the interpreter takes none)."""
    if interpret:
        return None
    return _triton.CompilerParams(num_warps=num_warps, num_stages=num_stages)
