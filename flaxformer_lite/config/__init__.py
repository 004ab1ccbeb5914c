"""Configuration: what a run is, checked before anything runs.

Holds the field machinery (``fields``: typed options with defaults, allowed values and
meanings), the model section and its presets (``model``), the experiment's other
sections and config files (``experiment``), and the rules across fields. Imports
nothing of the project above ``sparse/`` (pattern specs are validated here), and no
JAX at import time, so that ``main --help`` and ``fields`` answer at once.

The public names below are what config files use: ``from flaxformer_lite.config
import ModelConfig, base_config, apply_variants``.
"""

from flaxformer_lite.config.experiment import ExperimentConfig
from flaxformer_lite.config.fields import ConfigError
from flaxformer_lite.config.files import apply_variants, base_config, load_config
from flaxformer_lite.config.model import PRESETS, ModelConfig, get_preset

__all__ = [
    "PRESETS",
    "ConfigError",
    "ExperimentConfig",
    "ModelConfig",
    "apply_variants",
    "base_config",
    "get_preset",
    "load_config",
]
