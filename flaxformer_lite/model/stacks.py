"""How a layer stack runs: each layer recomputed in the backward pass
(``model.remat``), and the stack as one ``nn.scan`` compiled once
(``model.scan_layers``). Used by the encoder and decoder of
:mod:`~flaxformer_lite.model.transformer`, whose layer classes come in as arguments.
"""

from __future__ import annotations

from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp

from flaxformer_lite.config.model import ModelConfig
from flaxformer_lite.model import partitioning as P
from flaxformer_lite.model.dropout import scanned_layer
from flaxformer_lite.workdir.layer_layout import switched


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
    """One layer of ``layer_class`` as a scan body: ``(x, shared, positions, index) ->
    (x, None)``; ``shared`` the arguments every layer gets alike (masks, the encoder
    output), ``static`` its Python-valued ones (``deterministic``, ``decode``), at
    ``static_argnums`` for remat (``self`` counted as 0); ``index`` the layer's number,
    scanned, so that its dropout draws the unrolled layer's keys (model/dropout.py)."""

    layer_class: Any
    config: ModelConfig
    layer_args: tuple = ()  # after the config: a decoder layer's has_cross_attention
    static: tuple = ()
    static_argnums: tuple = ()

    length: int = 1

    @nn.compact
    def __call__(self, x, shared: tuple, positions, index):
        c = self.config
        layer_class = rematerialized(self.layer_class, c.remat, self.static_argnums)
        layer = layer_class(c, *self.layer_args, name="layer")
        path = self.scope.rngs["dropout"].suffix if "dropout" in self.scope.rngs else ()
        with scanned_layer(index, self.length, path):
            return layer(x, *shared, *self.static, positions), None


def scanned(length: int):
    """``length`` copies of a :class:`LayerBody` as one ``nn.scan``: compiled once,
    their parameters stacked along the ``layers`` logical axis, every argument but the
    carried activations and the layer's index the same for each layer. Each copy is the
    layer of index 0: a pattern must be the same in every layer (config/rules.py).

    Call the result with ``(x, shared, positions)``. The dropout key is broadcast and
    each layer derives the unrolled layer's keys from it (:func:`dropout.make_rng`);
    parameters are split per layer here, and :func:`init` makes them the unrolled
    model's, so that the field changes how a step compiles, never its numbers."""
    stack = nn.scan(
        LayerBody,
        variable_axes={"params": 0},
        split_rngs={"params": True, "dropout": False},
        in_axes=(nn.broadcast, nn.broadcast, 0),
        length=length,
        metadata_params={nn.PARTITION_NAME: P.LAYERS},
    )

    def make(*args, **kwargs):
        body = stack(*args, length=length, **kwargs)
        return lambda x, shared, positions: body(x, shared, positions, jnp.arange(length))

    return make


def init(model: nn.Module, rngs, *args, **kwargs):
    """``model.init(rngs, *args, **kwargs)``, whose parameters are the same numbers
    whether ``model.scan_layers`` is on or off: a scanned model is initialised as its
    unrolled twin and its layers stacked, in the scanned model's boxes (axis names)."""
    config = getattr(model, "config", None)
    if not getattr(config, "scan_layers", False):
        return model.init(rngs, *args, **kwargs)
    twin = model.clone(config=config.replace(scan_layers=False))
    values = P.unbox(twin.init(rngs, *args, **kwargs))
    stacked, _ = switched(values)
    boxes = jax.eval_shape(lambda: model.init(rngs, *args, **kwargs))
    return jax.tree.map(
        lambda box, value: box.replace_boxed(value) if isinstance(box, nn.meta.AxisMetadata)
        else value,
        boxes, stacked, is_leaf=lambda x: isinstance(x, nn.meta.AxisMetadata),
    )  # fmt: skip
