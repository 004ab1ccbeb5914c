"""The layer extension points an ablation touches besides score functions and sparse
patterns: the feed-forward block (``model.ffn``), the normalisation around each
sublayer and after a pre-LN stack (``model.norm``), an added position encoding
(``model.positional``) and the whole attention sublayer (``model.attention``). Each
is a registry of the shape of ``register_score_fn``: a decorator that names a factory,
after which the config accepts the name (and lists it among the field's choices in
errors, ``fields`` and ``sweep``)::

    @register_ffn("glu")
    def _glu(config, name):            # -> a flax module: module(x, deterministic=...)
        return MyGatedFeedForward(config, name=name)

    @register_norm("scale_only")       # -> module(x)
    @register_positional("alibi_like") # -> module(positions [b, l]) -> [b, l, d_model],
                                       #    added to the embeddings
    @register_attention("my_attention")  # factory(config, name, layer=, causal=,
                                       #   self_attention=) -> a module called as
                                       #   MultiHeadAttention is (decode= included)

Factories get the :class:`ModelConfig` and the submodule's name, and are called inside
the layer's compact method (their parameters live under that name). Built in:
``standard`` (the paper's act(x W1) W2), ``layer_norm`` and ``rms_norm``, and the
positional encodings computed in the embedding and attention code (``sinusoidal``,
``learned``, ``rotary``, ``none``).
"""

from __future__ import annotations

from collections.abc import Callable

import flax.linen as nn

from flaxformer_lite.config import extensions
from flaxformer_lite.config.model import ATTENTIONS, FFNS, NORMS, POSITIONALS, ModelConfig
from flaxformer_lite.model import partitioning as P
from flaxformer_lite.model.feedforward import FeedForward
from flaxformer_lite.model.multihead import MultiHeadAttention

Factory = Callable[[ModelConfig, str], nn.Module]


class _Registry:
    """A name -> factory table whose names are the choices of one config field."""

    def __init__(self, kind: str, choices: list[str], builtins: dict[str, Factory]):
        self.kind, self.choices, self.factories = kind, choices, dict(builtins)

    def register(self, name: str) -> Callable[[Factory], Factory]:
        def add(factory: Factory) -> Factory:
            taken = name in self.choices
            if extensions.claim(self.kind, name, factory, taken=taken):
                self.factories[name] = factory
                self.choices.append(name)  # a valid config value from now on
            return factory

        return add

    def make(self, config: ModelConfig, value: str, name: str, **kw) -> nn.Module:
        if value not in self.factories:
            raise ValueError(
                f"unknown {self.kind} {value!r}; registered: {', '.join(self.factories)}"
            )
        return self.factories[value](config, name, **kw)


def _layer_norm(c: ModelConfig, name: str) -> nn.Module:
    return nn.LayerNorm(
        epsilon=c.layer_norm_epsilon,
        dtype=c.compute_dtype,
        param_dtype=c.parameter_dtype,
        scale_init=P.param_init(nn.initializers.ones_init(), P.EMBED),
        bias_init=P.param_init(nn.initializers.zeros_init(), P.EMBED),
        name=name,
    )


def _rms_norm(c: ModelConfig, name: str) -> nn.Module:
    """RMSNorm (Zhang & Sennrich 2019): x / rms(x) * g, no centring and no bias."""
    return nn.RMSNorm(
        epsilon=c.layer_norm_epsilon,
        dtype=c.compute_dtype,
        param_dtype=c.parameter_dtype,
        scale_init=P.param_init(nn.initializers.ones_init(), P.EMBED),
        name=name,
    )


FFN = _Registry("feed-forward block", FFNS, {"standard": lambda c, name: FeedForward(c, name=name)})
NORM = _Registry("normalisation", NORMS, {"layer_norm": _layer_norm, "rms_norm": _rms_norm})
# sinusoidal, learned, rotary and none are computed where they act (embedding, attention)
POSITIONAL = _Registry("position encoding", POSITIONALS, {})
ATTENTION = _Registry(
    "attention layer", ATTENTIONS,
    {"multihead": lambda c, name, **kw: MultiHeadAttention(c, name=name, **kw)},
)  # fmt: skip

register_ffn = FFN.register
register_norm = NORM.register
register_positional = POSITIONAL.register
register_attention = ATTENTION.register


def ffn_layer(c: ModelConfig, name: str = "ffn") -> nn.Module:
    return FFN.make(c, c.ffn, name)


def norm_layer(c: ModelConfig, name: str) -> nn.Module:
    return NORM.make(c, c.norm, name)


def attention_layer(c: ModelConfig, name: str, **kw) -> nn.Module:
    """The attention sublayer ``name``: ``kw`` as MultiHeadAttention's fields (``layer``,
    ``causal``, ``self_attention``), called as it is (queries, keys/values or None,
    mask, deterministic=, decode=, positions=)."""
    return ATTENTION.make(c, c.attention, name, **kw)


def added_positions(c: ModelConfig) -> nn.Module | None:
    """A registered position encoding's module (named ``positions``), or None."""
    if c.positional in POSITIONAL.factories:
        return POSITIONAL.make(c, c.positional, "positions")
    return None
