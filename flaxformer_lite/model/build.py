"""The model of a task: the encoder-decoder for translation, the decoder-only LM for lm
and recall, the sequence classifier for classify."""

from __future__ import annotations

import flax.linen as nn

from flaxformer_lite.config.experiment import TASKS
from flaxformer_lite.config.model import ModelConfig
from flaxformer_lite.model.classifier import Classifier
from flaxformer_lite.model.lm import LanguageModel
from flaxformer_lite.model.transformer import Transformer

MODELS = {"translation": Transformer, "lm": LanguageModel, "recall": LanguageModel,
          "classify": Classifier}  # fmt: skip


def build_model(model_config: ModelConfig, task: str = "translation") -> nn.Module:
    """The model ``task`` trains (see :data:`MODELS`)."""
    if task not in TASKS:
        raise ValueError(f"task {task!r}; choose one of {', '.join(TASKS)}")
    return MODELS[task](model_config)


__all__ = ["Classifier", "LanguageModel", "Transformer", "build_model"]
