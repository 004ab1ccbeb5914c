"""Sparse attention: what a pattern is, apart from how it is computed. The bottom layer.

- ``grammar/``: what a pattern is. ``patterns`` (which keys each query sees: an exact
  rule and a cover of blocks), ``dynamic`` (patterns whose keys depend on the content:
  ``moba``, ``nsa``), ``spec`` (the grammar and registry of ``model.attention_pattern``),
  ``plans`` (a cover as blocks, columns, strides and rows), ``tiles`` (a cover as the
  tiles a fused kernel visits), ``analysis`` (receptive fields of stacked layers). No
  JAX: the config validates specs with them.
- ``ops/``: how it is computed, an op a folder with its backends beside it
  (``xla.py``: XLA, every platform; ``pallas_triton.py``: Pallas lowered by Triton on a
  GPU, Pallas' interpreter elsewhere; ``splash.py``: TPU). ``block_sparse`` (any static
  pattern), ``band`` (a window), ``chosen_blocks`` (the key blocks a routing chose),
  ``moba``, ``nsa``, ``topk``; ``online_softmax`` and ``pallas_flash`` are what they
  share.
- ``dispatch``: the one table of which kernel computes which pattern on which backend,
  with each refusal's reason; the model and the config ask it.

Imports nothing of the project. ``flaxformer_lite.sparse.patterns``, ``.spec`` and
``.analysis`` stay the grammar's public names; the modules' names before the rooms
(``sparse.blocked``, ``sparse.band_gpu``, ...) import their new modules, for one
release (``docs/architecture.md`` lists them).
"""

import importlib
import importlib.abc
import importlib.util
import sys

from flaxformer_lite.sparse.grammar import analysis, patterns, spec

# The grammar's public names: the same module objects under both paths.
for _name, _module in (("analysis", analysis), ("patterns", patterns), ("spec", spec)):
    sys.modules[f"{__name__}.{_name}"] = _module

# Where each module of the flat folder went (kept importable for one release).
MOVED = {
    "dynamic": "grammar.dynamic", "plans": "grammar.plans", "tiles": "grammar.tiles",
    "online_softmax": "ops.online_softmax", "flash_gpu": "ops.pallas_flash",
    "blocked": "ops.block_sparse.xla", "block_kernel": "ops.block_sparse.xla_blocks",
    "block_sparse_gpu": "ops.block_sparse.pallas_triton", "regroup": "ops.block_sparse.regroup",
    "splash_masks": "ops.block_sparse.splash", "band_gpu": "ops.band.pallas_triton",
    "routed_kernel": "ops.chosen_blocks.xla_gather",
    "routed_chunks": "ops.chosen_blocks.xla_chunks",
    "routed_gpu": "ops.chosen_blocks.pallas_triton_tiles",
    "routed_gather_gpu": "ops.chosen_blocks.pallas_triton_gather",
    "routed": "ops.moba.xla", "route_gpu": "ops.moba.routing_triton",
    "nsa": "ops.nsa.xla", "compressed_gpu": "ops.nsa.compressed_triton",
    "topk": "ops.topk.xla",
}  # fmt: skip


class _Moved(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """``import flaxformer_lite.sparse.<old name>`` gives the module's new home (the
    same module object, imported only when asked: the kernels import JAX)."""

    def find_spec(self, name, path=None, target=None):
        old = name.removeprefix(f"{__name__}.")
        if old != name and old in MOVED:
            return importlib.util.spec_from_loader(name, self)
        return None

    def create_module(self, spec):
        return importlib.import_module(f"{__name__}.{MOVED[spec.name.rsplit('.', 1)[1]]}")

    def exec_module(self, module):
        """Imported already, under its new name."""


if not any(isinstance(finder, _Moved) for finder in sys.meta_path):
    sys.meta_path.append(_Moved())
