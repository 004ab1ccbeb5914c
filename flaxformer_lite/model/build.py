"""The model of a task: the encoder-decoder for translation, the decoder-only LM for lm
and recall, the sequence classifier for classify."""

from __future__ import annotations

import flax.linen as nn

from flaxformer_lite.config.experiment import TASKS
from flaxformer_lite.config.model import ModelConfig
from flaxformer_lite.model.classifier import Classifier
from flaxformer_lite.model.lm import LanguageModel
from flaxformer_lite.model.transformer import Transformer
from flaxformer_lite.sparse import dispatch
from flaxformer_lite.sparse.grammar import spec

MODELS = {"translation": Transformer, "lm": LanguageModel, "recall": LanguageModel,
          "classify": Classifier}  # fmt: skip


def build_model(model_config: ModelConfig, task: str = "translation") -> nn.Module:
    """The model ``task`` trains (see :data:`MODELS`)."""
    if task not in TASKS:
        raise ValueError(f"task {task!r}; choose one of {', '.join(TASKS)}")
    return MODELS[task](model_config)


__all__ = ["Classifier", "LanguageModel", "Transformer", "build_model"]


def attention_kernels(c: ModelConfig, task: str = "translation") -> str:
    """One line: which kernel runs each self-attention layer's head groups under
    ``model.attention_impl`` (consecutive layers alike are one entry), as a run prints
    it at start-up; e.g. ``encoder layers 0-5: bigbird -> block-sparse kernel``."""
    stacks = [("decoder", c.num_decoder_layers, True)]
    if task == "translation":
        stacks = [("encoder", c.num_encoder_layers, False), *stacks]
    elif task == "classify":
        stacks = [("encoder", c.num_encoder_layers, False)]
    parts = []
    for name, layers, causal in stacks:
        runs: list[tuple[int, int, str]] = []
        for layer in range(layers):
            what = _layer_kernels(c, layer, causal)
            if runs and runs[-1][2] == what:
                runs[-1] = (runs[-1][0], layer, what)
            else:
                runs.append((layer, layer, what))
        for first, last, what in runs:
            span = f"layer {first}" if first == last else f"layers {first}-{last}"
            parts.append(f"{name} {span}: {what}")
    return f"attention (attention_impl={c.attention_impl}): " + "; ".join(parts)


def _layer_kernels(c: ModelConfig, layer: int, causal: bool) -> str:
    """The layer's head groups and the kernel of each (the dispatch table's answer)."""
    if not c.sparse_attention:
        return "dense -> " + dispatch.KERNELS[dispatch.kernel(None, c.attention_impl)].what
    texts = spec.parse_spec_texts(c.attention_pattern, layer)
    patterns = spec.layer_patterns(
        c.attention_pattern, layer, c.num_heads, block_size=c.attention_block_size,
        seed=c.attention_seed, causal=causal,
    )  # fmt: skip
    out = []
    for text, pattern in zip(texts, patterns, strict=True):
        kernel = dispatch.KERNELS[dispatch.kernel(pattern, c.attention_impl)].what
        out.append(f"{'causal ' if causal else ''}{text} -> {kernel}")
    return ", ".join(out)
