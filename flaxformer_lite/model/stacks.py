"""How a layer stack runs: each layer recomputed in the backward pass
(``model.remat``), and the stack as one ``nn.scan`` compiled once
(``model.scan_layers``). Used by the encoder and decoder of
:mod:`~flaxformer_lite.model.transformer`, whose layer classes come in as arguments.
"""

from __future__ import annotations

from typing import Any

import flax.linen as nn
import jax

from flaxformer_lite.config.model import ModelConfig
from flaxformer_lite.model import partitioning as P


def rematerialized(layer_class, policy: str, static_argnums: tuple[int, ...]):
    """``layer_class`` whose activations are recomputed in the backward pass under the
    ``model.remat`` policy (``none``: the class itself). ``static_argnums``: the
    positions of its Python-valued arguments (``deterministic``, ``decode``) in
    ``__call__``, ``self`` counted as 0 (flax's lifted remat passes the module too)."""
    if policy == "none":
        return layer_class
    policies = jax.checkpoint_policies
    keep = {
        "full": policies.nothing_saveable,
        "dots": policies.dots_with_no_batch_dims_saveable,
        "dots_all": policies.checkpoint_dots,
    }[policy]
    return nn.remat(layer_class, policy=keep, static_argnums=static_argnums)


class LayerBody(nn.Module):
    """One layer of ``layer_class`` as a scan body: ``(x, shared, positions) -> (x,
    None)``; ``shared`` the arguments every layer gets alike (masks, the encoder
    output), ``static`` its Python-valued ones (``deterministic``, ``decode``), at
    ``static_argnums`` for remat (``self`` counted as 0)."""

    layer_class: Any
    config: ModelConfig
    layer_args: tuple = ()  # after the config: a decoder layer's has_cross_attention
    static: tuple = ()
    static_argnums: tuple = ()

    @nn.compact
    def __call__(self, x, shared: tuple, positions):
        c = self.config
        layer_class = rematerialized(self.layer_class, c.remat, self.static_argnums)
        layer = layer_class(c, *self.layer_args, name="layer")
        return layer(x, *shared, *self.static, positions), None


def scanned(length: int):
    """``length`` copies of a :class:`LayerBody` as one ``nn.scan``: compiled once,
    their parameters stacked along the ``layers`` logical axis, every argument but the
    carried activations the same for each layer. Each copy is the layer of index 0: a
    pattern must be the same in every layer (config/rules.py)."""
    return nn.scan(
        LayerBody,
        variable_axes={"params": 0},
        split_rngs={"params": True, "dropout": True},
        in_axes=nn.broadcast,
        length=length,
        metadata_params={nn.PARTITION_NAME: P.LAYERS},
    )
