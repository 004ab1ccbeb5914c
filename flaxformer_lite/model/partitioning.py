"""Logical axis names, the one table that maps them to mesh axes, and the mesh.

Every parameter is created with logical axis names (``nn.with_logical_partitioning``
on its initializer, see :func:`param_init`), and activations are constrained at
layer boundaries with :func:`constrain`. Neither names a device: :data:`RULES`
below is the only place where logical axes meet the mesh axes

* ``data``  -- pure data parallelism: the batch is split, parameters replicated;
* ``fsdp``  -- the batch is split *and* parameters and optimizer state are sharded
  (ZeRO-3 / FSDP): each device holds 1/fsdp of every matrix, gathered per layer;
* ``model`` -- tensor parallelism (Megatron): heads split Q/K/V column-wise and W^O
  row-wise, the FFN hidden splits W1 column-wise and W2 row-wise, and the shared
  embedding splits its vocabulary.

``train.mesh="data:-1,fsdp:1,model:1"`` sets the shape (-1: the devices left over);
:func:`~flaxformer_lite.config.mesh.mesh_shape` checks it against the device count
and :func:`check_model`
against the model, each with one message naming the value and the fix.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import flax.linen as nn
import jax
import numpy as np
from flax.core import meta
from jax.sharding import AxisType, Mesh, NamedSharding, PartitionSpec

from flaxformer_lite.config.mesh import DEFAULT_MESH, MESH_AXES, MeshError, mesh_shape

# Parameter axes.
VOCAB = "vocab"
EMBED = "embed"  # d_model
HEADS = "heads"
HEAD_DIM = "head_dim"  # d_k / d_v
MLP = "mlp"  # d_ff
POSITION = "position"  # rows of a learned position table
# Activation axes.
BATCH = "activation_batch"
LENGTH = "activation_length"
ACT_EMBED = "activation_embed"
ACT_HEADS = "activation_heads"
ACT_MLP = "activation_mlp"
ACT_VOCAB = "activation_vocab"
LAYERS = "layers"  # the stacked layers of model.scan_layers (replicated: each device holds all)

# The rules table: logical axis -> mesh axis (or axes, or None = replicated).
RULES: tuple[tuple[str, str | tuple[str, ...] | None], ...] = (
    (VOCAB, "model"),
    (EMBED, "fsdp"),
    (HEADS, "model"),
    (HEAD_DIM, None),
    (MLP, "model"),
    (POSITION, None),
    (BATCH, ("data", "fsdp")),
    (LENGTH, None),
    (ACT_EMBED, None),
    (ACT_HEADS, "model"),
    (ACT_MLP, "model"),
    (ACT_VOCAB, "model"),
    (LAYERS, None),
)


def param_init(init, *names: str | None):
    """``init`` whose parameter carries the logical axis ``names`` (one per dimension)."""
    return nn.with_logical_partitioning(init, names)


def constrain(x: jax.Array, *names: str | None) -> jax.Array:
    """Shard activation ``x`` as its logical axis ``names`` say, on the mesh that
    :class:`~flaxformer_lite.training.parallel.Parallel` sets while tracing a step;
    anywhere else (pmap, decoding, one device) it returns ``x`` unchanged.

    The rules are applied here rather than through flax's global rules context: with
    that context set, flax re-runs ``DenseGeneral``'s initializer at every call to
    check shapes and constrains the flattened kernel with the 3-d kernel's names."""
    mesh = jax.sharding.get_abstract_mesh()
    if mesh.empty or not set(MESH_AXES) <= set(mesh.axis_names):
        return x
    return jax.lax.with_sharding_constraint(x, mesh_axes(PartitionSpec(*names), mesh, x.shape))


def unbox(tree):
    """The arrays of a tree of logically partitioned parameters (``model.init``'s)."""
    return meta.unbox(tree)


def logical_specs(boxed_tree):
    """A PartitionSpec of logical names per leaf (``PartitionSpec()`` for unnamed ones)."""
    return nn.get_partition_spec(boxed_tree)


# The mesh -------------------------------------------------------------------------------


def make_mesh(spec: str = DEFAULT_MESH, devices: Sequence | None = None) -> Mesh:
    """The ``(data, fsdp, model)`` mesh of ``spec`` over ``devices`` (default: all,
    of every process), laid out by ``jax.make_mesh`` for the hardware's topology."""
    devices = list(jax.devices() if devices is None else devices)
    shape = mesh_shape(spec, len(devices))
    # Auto axes: XLA's partitioner propagates the shardings we constrain (jax's
    # explicit "sharding in types" would ask every gather for its output sharding).
    auto = (AxisType.Auto,) * len(MESH_AXES)
    if devices == list(jax.devices()):
        return jax.make_mesh(shape, MESH_AXES, axis_types=auto, devices=devices)
    return Mesh(np.array(devices).reshape(shape), MESH_AXES, axis_types=auto)


def check_model(mesh: Mesh, model, batch_size: int | None = None) -> None:
    """The model's split dimensions divide their mesh axes, and the batch divides
    the data-parallel devices; else one MeshError naming the field."""
    tp = mesh.shape["model"]
    rows = mesh.shape["data"] * mesh.shape["fsdp"]
    shape = "x".join(str(mesh.shape[a]) for a in MESH_AXES)
    for field, value in (
        ("num_heads", model.num_heads),
        ("d_ff", model.d_ff),
        ("vocab_size", model.vocab_size),
    ):
        if value % tp:
            raise MeshError(
                f"model.{field}={value} is not divisible by the model axis ({tp}) of "
                f"train.mesh ({shape} as data x fsdp x model); pick a model size dividing "
                f"{value}"
            )
    if model.d_model % mesh.shape["fsdp"]:
        raise MeshError(
            f"model.d_model={model.d_model} is not divisible by the fsdp axis "
            f"({mesh.shape['fsdp']}) of train.mesh ({shape}); pick an fsdp size dividing it"
        )
    if batch_size is not None and batch_size % rows:
        raise MeshError(
            f"train.batch_size={batch_size} is not divisible by the {rows} data x fsdp "
            f"devices of train.mesh ({shape}); use a multiple of {rows}"
        )


def mesh_axes(logical: PartitionSpec, mesh: Mesh, shape: Sequence[int] = ()) -> PartitionSpec:
    """The mesh PartitionSpec of a logical one under :data:`RULES`. A dimension whose
    size the mesh axes do not divide stays whole (``shape``: the array's, when known)."""
    rules = dict(RULES)
    out = []
    for i, name in enumerate(logical):
        axes = rules.get(name) if name is not None else None
        if isinstance(axes, str):
            axes = (axes,)
        axes = tuple(a for a in axes or () if mesh.shape[a] > 1)
        if axes and i < len(shape) and shape[i] % math.prod(mesh.shape[a] for a in axes):
            axes = ()
        out.append(None if not axes else axes[0] if len(axes) == 1 else axes)
    while out and out[-1] is None:
        out.pop()
    return PartitionSpec(*out)


def shardings(logical_tree, abstract_tree, mesh: Mesh):
    """NamedShardings for ``abstract_tree`` from a matching tree of logical specs."""
    return jax.tree.map(
        lambda spec, x: NamedSharding(mesh, mesh_axes(spec, mesh, np.shape(x))),
        logical_tree,
        abstract_tree,
        is_leaf=lambda x: isinstance(x, PartitionSpec),
    )
