"""flaxformer_lite: the Transformer of "Attention Is All You Need" and sparse attention."""

from flaxformer_lite.architectures.lm import LanguageModel
from flaxformer_lite.architectures.transformer import Transformer
from flaxformer_lite.config import PRESETS, ConfigError, ModelConfig, get_preset

__all__ = ["PRESETS", "ConfigError", "LanguageModel", "ModelConfig", "Transformer", "get_preset"]
__version__ = "0.1.0"
