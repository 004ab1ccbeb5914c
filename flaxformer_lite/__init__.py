"""flaxformer_lite: the Transformer of "Attention Is All You Need" and sparse attention.

The public names below are imported on first use, so that ``import flaxformer_lite``
(and the command line's start, which installs its signal handlers before anything
else) does not wait for JAX and Flax.
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.util
import sys
from typing import TYPE_CHECKING

_PUBLIC = {
    "LanguageModel": "flaxformer_lite.model.lm",
    "Transformer": "flaxformer_lite.model.transformer",
    "PRESETS": "flaxformer_lite.config.model",
    "ConfigError": "flaxformer_lite.config.model",
    "ModelConfig": "flaxformer_lite.config.model",
    "get_preset": "flaxformer_lite.config.model",
}

__all__ = ["PRESETS", "ConfigError", "LanguageModel", "ModelConfig", "Transformer", "get_preset"]
__version__ = "0.1.0"

# Modules that moved when sparse/ and inference/ were split into rooms, by their old
# names (docs/architecture.md): importing an old name gives the module at its new home,
# the same object. Kept for one release.
MOVED = {
    "sparse.dynamic": "sparse.grammar.dynamic",
    "sparse.plans": "sparse.grammar.plans",
    "sparse.tiles": "sparse.grammar.tiles",
    "sparse.online_softmax": "sparse.ops.online_softmax",
    "sparse.flash_gpu": "sparse.ops.pallas_flash",
    "sparse.blocked": "sparse.ops.block_sparse.xla",
    "sparse.block_kernel": "sparse.ops.block_sparse.xla_blocks",
    "sparse.block_sparse_gpu": "sparse.ops.block_sparse.pallas_triton",
    "sparse.regroup": "sparse.ops.block_sparse.regroup",
    "sparse.splash_masks": "sparse.ops.block_sparse.splash",
    "sparse.band_gpu": "sparse.ops.band.pallas_triton",
    "sparse.routed_kernel": "sparse.ops.chosen_blocks.xla_gather",
    "sparse.routed_chunks": "sparse.ops.chosen_blocks.xla_chunks",
    "sparse.routed_gpu": "sparse.ops.chosen_blocks.pallas_triton_tiles",
    "sparse.routed_gather_gpu": "sparse.ops.chosen_blocks.pallas_triton_gather",
    "sparse.routed": "sparse.ops.moba.xla",
    "sparse.route_gpu": "sparse.ops.moba.routing_triton",
    "sparse.nsa": "sparse.ops.nsa.xla",
    "sparse.compressed_gpu": "sparse.ops.nsa.compressed_triton",
    "sparse.topk": "sparse.ops.topk.xla",
    "config.gpu_kernels": "sparse.dispatch",
    "inference.export": "exchange.export",
    "inference.hf_import": "exchange.hf_import",
    "inference.attention_maps": "views.attention_maps",
    "inference.diagnostics": "views.diagnostics",
}


class _Moved(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Finds a :data:`MOVED` name, and loads it as the module at its new home."""

    def find_spec(self, name, path=None, target=None):
        if name.removeprefix(f"{__name__}.") in MOVED:
            return importlib.util.spec_from_loader(name, self)
        return None

    def create_module(self, spec):
        new = MOVED[spec.name.removeprefix(f"{__name__}.")]
        return importlib.import_module(f"{__name__}.{new}")

    def exec_module(self, module):
        """Imported already, under its new name."""


if not any(type(finder).__name__ == "_Moved" for finder in sys.meta_path):
    sys.meta_path.append(_Moved())


if TYPE_CHECKING:  # what static tools and IDEs see
    from flaxformer_lite.config.model import PRESETS, ConfigError, ModelConfig, get_preset
    from flaxformer_lite.model.lm import LanguageModel
    from flaxformer_lite.model.transformer import Transformer


def __getattr__(name: str):
    if name in _PUBLIC:
        value = getattr(importlib.import_module(_PUBLIC[name]), name)
        globals()[name] = value  # later look-ups skip this function
        return value
    # A submodule (flaxformer_lite.inference.decoding, ...) not imported yet.
    try:
        return importlib.import_module(f"{__name__}.{name}")
    except ModuleNotFoundError as e:
        if e.name != f"{__name__}.{name}":
            raise
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_PUBLIC))
