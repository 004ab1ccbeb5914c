"""flaxformer_lite: the Transformer of "Attention Is All You Need" and sparse attention.

The public names below are imported on first use, so that ``import flaxformer_lite``
(and the command line's start, which installs its signal handlers before anything
else) does not wait for JAX and Flax.
"""

from __future__ import annotations

import importlib
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
