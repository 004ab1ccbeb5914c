"""Parallelism: ``jit`` over a ``(data, fsdp, model)`` device mesh (default) or ``pmap``.

* ``jit``: one program for all devices of all processes. The batch is split over
  ``data`` x ``fsdp``; parameters and optimizer state are laid out by their logical
  axis names through :data:`flaxformer_lite.model.partitioning.RULES` (replicated over
  ``data``, sharded over ``fsdp``, heads / FFN hidden / vocabulary split over
  ``model``), and XLA inserts the collectives. ``train.mesh="data:-1"`` (the
  default) is plain data parallelism. Each process feeds its local rows
  (``jax.make_array_from_process_local_data``).
* ``pmap``: the classic per-device program; the state is replicated with a
  leading device axis, batches are reshaped to ``[devices, rows/device, ...]``
  and the step sums across devices with ``lax.psum`` (data parallelism only).

Every mesh gives the same losses and parameters as one device
(tests/test_sharding.py, 8 simulated CPU devices); pmap the same as jit
(tests/test_steps.py). The state argument is donated: its buffers are reused.
"""

from __future__ import annotations

import contextlib
import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec

from flaxformer_lite.config.mesh import MESH_AXES, MeshError
from flaxformer_lite.model import partitioning

AXIS = "data"


class Parallel:
    """Compiles steps for ``jit`` over a device mesh or for ``pmap``, and moves states,
    batches and metrics to and from the devices accordingly."""

    def __init__(self, kind: str = "jit", mesh: str = partitioning.DEFAULT_MESH, devices=None):
        if kind not in ("jit", "pmap"):
            raise ValueError(f"parallelism {kind!r}; choose jit or pmap")
        self.kind = kind
        self.devices = list(devices if devices is not None else jax.devices())
        self.num_devices = len(self.devices)
        self.mesh = partitioning.make_mesh(mesh, self.devices)
        if kind == "pmap" and self.mesh.shape["data"] != self.num_devices:
            raise MeshError(
                f"train.mesh={mesh!r} shards parameters, but parallelism=pmap replicates "
                "them on every device; use parallelism=jit, or train.mesh='data:-1'"
            )
        self.replicated = NamedSharding(self.mesh, PartitionSpec())
        self.batch_sharding = NamedSharding(
            self.mesh, partitioning.mesh_axes(PartitionSpec(partitioning.BATCH), self.mesh)
        )
        self.state_shardings = None  # replicated until lay_out() is given the state's specs

    @property
    def shape(self) -> str:
        """``data x fsdp x model``, e.g. ``2x2x2``."""
        return "x".join(str(self.mesh.shape[a]) for a in MESH_AXES)

    def lay_out(self, logical_specs, abstract_state) -> None:
        """Shard the train state as its logical specs say (``jit`` only; pmap replicates):
        :func:`~flaxformer_lite.training.state.state_partitioning` gives both arguments."""
        if self.kind == "jit":
            self.state_shardings = partitioning.shardings(logical_specs, abstract_state, self.mesh)

    def check_batch_size(self, batch_size: int, concurrent_splits: int = 1) -> None:
        """The batch against the devices (the config checked it alone: config/rules.py)."""
        if self.kind == "pmap":
            local = jax.local_device_count()
            if batch_size % local:
                raise ValueError(
                    f"train.batch_size={batch_size} is not divisible by the {local} devices; "
                    f"use a multiple of {local}"
                )
            if (batch_size // local) % concurrent_splits:
                raise ValueError(
                    f"train.concurrent_splits={concurrent_splits} does not divide the "
                    f"{batch_size // local} rows each device gets (train.batch_size="
                    f"{batch_size}); pick a divisor"
                )
            return
        rows = self.mesh.shape["data"] * self.mesh.shape["fsdp"]
        if rows % jax.process_count():
            raise ValueError(
                f"train.mesh {self.shape} splits the batch {rows} ways, which the "
                f"{jax.process_count()} processes cannot share (each feeds its own rows); "
                "make data x fsdp a multiple of the process count (the model axis within "
                "a host)"
            )
        if batch_size % rows:
            raise ValueError(
                f"train.batch_size={batch_size} is not divisible by the {rows} devices the "
                f"batch is split over (train.mesh {self.shape} as data x fsdp x model); "
                f"use a multiple of {rows}"
            )

    @contextlib.contextmanager
    def tracing(self):
        """The mesh that activations' sharding constraints read while a step is traced."""
        with jax.set_mesh(self.mesh):
            yield

    def _state(self):
        return self.state_shardings if self.state_shardings is not None else self.replicated

    # Steps ---------------------------------------------------------------------------
    def train_step(self, step_fn, **static):
        """``step_fn(state, batch, lr_factor, **static)`` compiled for this
        parallelism, called as ``step(state, batch)`` or ``step(state, batch,
        lr_factor)``: the factor (a host float, the same on every device) is
        replicated."""
        if self.kind == "pmap":
            fn = functools.partial(step_fn, axis_name=AXIS, **static)
            compiled = jax.pmap(fn, axis_name=AXIS, in_axes=(0, 0, None), donate_argnums=(0,))

            def step(state, batch, lr_factor=None):
                if lr_factor is not None:
                    lr_factor = np.float32(lr_factor)
                return compiled(state, batch, lr_factor)

            return step

        fn = functools.partial(step_fn, **static)
        compiled = jax.jit(
            fn,
            in_shardings=(self._state(), self.batch_sharding, self.replicated),
            out_shardings=(self._state(), self.replicated),
            donate_argnums=(0,),
        )

        def step(state, batch, lr_factor=None):
            if lr_factor is not None:
                lr_factor = np.float32(lr_factor)
            with self.tracing():
                return compiled(state, batch, lr_factor)

        step.compiled = compiled  # for lower()/memory analysis (benchmarks/scale.py)
        return step

    def eval_step(self, step_fn, **static):
        if self.kind == "pmap":
            fn = functools.partial(step_fn, axis_name=AXIS, **static)
            return jax.pmap(fn, axis_name=AXIS)
        fn = functools.partial(step_fn, **static)
        params = self.state_shardings.params if self.state_shardings is not None else None
        compiled = jax.jit(
            fn,
            in_shardings=(params or self.replicated, self.batch_sharding),
            out_shardings=self.replicated,
        )

        def step(params, batch):
            with self.tracing():
                return compiled(params, batch)

        return step

    # Data movement ----------------------------------------------------------------
    def put_state(self, state):
        if self.kind == "pmap":
            n = jax.local_device_count()
            return jax.tree.map(lambda x: jnp.broadcast_to(x, (n, *jnp.shape(x))), state)
        return jax.device_put(state, self._state())

    def put_batch(self, batch: dict) -> dict:
        if self.kind == "pmap":
            n = jax.local_device_count()
            return {k: v.reshape(n, v.shape[0] // n, *v.shape[1:]) for k, v in batch.items()}
        return {
            k: jax.make_array_from_process_local_data(self.batch_sharding, v)
            for k, v in batch.items()
        }

    def params_of(self, state):
        """Parameters as one (unreplicated) pytree."""
        return self.unreplicate(state).params if self.kind == "pmap" else state.params

    def unreplicate(self, tree):
        if self.kind == "pmap":
            return jax.tree.map(lambda x: x[0], tree)
        return tree

    def metrics_to_host(self, metrics: dict) -> dict:
        metrics = self.unreplicate(metrics)
        return {k: float(v) for k, v in jax.device_get(metrics).items()}
