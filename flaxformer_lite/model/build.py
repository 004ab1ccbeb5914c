"""The model of a task: the encoder-decoder for translation, the decoder-only LM for lm."""

from __future__ import annotations

import flax.linen as nn

from flaxformer_lite.config.experiment import TASKS
from flaxformer_lite.config.model import ModelConfig
from flaxformer_lite.model.lm import LanguageModel
from flaxformer_lite.model.transformer import Transformer


def build_model(model_config: ModelConfig, task: str = "translation") -> nn.Module:
    """The encoder-decoder for ``translation``, the decoder-only LM for ``lm``."""
    if task not in TASKS:
        raise ValueError(f"task {task!r}; choose one of {', '.join(TASKS)}")
    return LanguageModel(model_config) if task == "lm" else Transformer(model_config)


__all__ = ["LanguageModel", "Transformer", "build_model"]
