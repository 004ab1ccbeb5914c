"""Checkpoints of either layer layout restore into the other (``model.scan_layers``).

An unrolled model names its layers ``layer_0 .. layer_{L-1}``; a scanned one holds one
``layers/layer`` subtree whose every array has the layers stacked along a new first
axis (model/transformer.py's ``_scanned``). :func:`switched` turns every such part of
a tree (parameters, the optimizer's moments, abstract shapes) into the other layout,
so that a run can resume, evaluate or average across a change of the field.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

_LAYER = re.compile(r"layer_(\d+)")
STACK, BODY = "layers", "layer"  # the scanned module's names


def _is_shape(x) -> bool:
    return isinstance(x, jax.ShapeDtypeStruct)


def _stack(*leaves):
    if _is_shape(leaves[0]):
        return jax.ShapeDtypeStruct((len(leaves), *leaves[0].shape), leaves[0].dtype)
    if isinstance(leaves[0], np.ndarray):
        return np.stack(leaves)
    return jnp.stack(leaves)


def _unstack(x, i: int):
    if _is_shape(x):
        return jax.ShapeDtypeStruct(x.shape[1:], x.dtype)
    return x[i]


def _switch_dict(d: Mapping) -> tuple[dict, bool]:
    out, changed = {}, False
    for key, value in d.items():
        out[key], inner = _switch(value)
        changed |= inner
    layers = sorted((int(m.group(1)), k) for k in out if (m := _LAYER.fullmatch(k)))
    if layers and [i for i, _ in layers] == list(range(len(layers))):
        stacked = jax.tree.map(_stack, *(out.pop(k) for _, k in layers))
        out[STACK] = {BODY: stacked}
        return out, True
    if STACK in out and isinstance(out[STACK], Mapping) and set(out[STACK]) == {BODY}:
        body = out.pop(STACK)[BODY]
        count = jax.tree.leaves(body)[0].shape[0]
        for i in range(count):
            out[f"layer_{i}"] = jax.tree.map(lambda x, i=i: _unstack(x, i), body)
        return out, True
    return out, changed


def _switch(tree: Any) -> tuple[Any, bool]:
    if isinstance(tree, Mapping):
        return _switch_dict(tree)
    found = [False]

    def each(x):
        if isinstance(x, Mapping):
            new, changed = _switch_dict(x)
            found[0] |= changed
            return new
        return x

    out = jax.tree_util.tree_map(each, tree, is_leaf=lambda x: isinstance(x, Mapping))
    return out, found[0]


def switched(tree: Any) -> tuple[Any, bool]:
    """(``tree`` with every layer stack in the other layout, whether it held one)."""
    return _switch(tree)


def unrolled(config, params):
    """(the model config with ``scan_layers`` off, ``params`` in its layout): for the
    code that reads each layer by name (cached decoding, the attention maps)."""
    if not getattr(config, "scan_layers", False):
        return config, params
    return config.replace(scan_layers=False), switched(params)[0]
