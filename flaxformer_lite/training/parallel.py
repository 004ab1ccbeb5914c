"""Data parallelism: ``jit`` over a device mesh (default) or ``pmap``.

* ``jit``: one program for all devices; the batch is sharded along its first
  axis over a 1-D mesh ``("data",)``, parameters and optimizer state are
  replicated, and XLA inserts the gradient all-reduce. Multi-host ready: each
  process feeds its local rows (``jax.make_array_from_process_local_data``).
* ``pmap``: the classic per-device program; the state is replicated with a
  leading device axis, batches are reshaped to ``[devices, rows/device, ...]``
  and the step sums across devices with ``lax.psum``.

Both give the same losses (tests/test_training.py, 8 simulated CPU devices).
The state argument is donated: its buffers are reused for the new state.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec

AXIS = "data"


class DataParallel:
    """Compiles steps for ``jit`` over a 1-D ``data`` mesh or for ``pmap``, and moves
    states, batches and metrics to and from the devices accordingly."""

    def __init__(self, kind: str = "jit", devices=None):
        if kind not in ("jit", "pmap"):
            raise ValueError(f"parallelism {kind!r}; choose jit or pmap")
        self.kind = kind
        self.devices = list(devices if devices is not None else jax.devices())
        self.num_devices = len(self.devices)
        self.mesh = Mesh(np.array(self.devices), (AXIS,))
        self.replicated = NamedSharding(self.mesh, PartitionSpec())
        self.batch_sharding = NamedSharding(self.mesh, PartitionSpec(AXIS))

    def check_batch_size(self, batch_size: int) -> None:
        local = jax.local_device_count() if self.kind == "pmap" else self.num_devices
        if batch_size % local:
            raise ValueError(
                f"train.batch_size={batch_size} is not divisible by the {local} devices; "
                f"use a multiple of {local}"
            )

    # Steps ---------------------------------------------------------------------------
    def train_step(self, step_fn, **static):
        """``step_fn(state, batch, lr_factor, **static)`` compiled for this
        parallelism, called as ``step(state, batch)`` or ``step(state, batch,
        lr_factor)``: the factor (a host float, the same on every device) is
        replicated."""
        if self.kind == "pmap":
            fn = functools.partial(step_fn, axis_name=AXIS, **static)
            compiled = jax.pmap(fn, axis_name=AXIS, in_axes=(0, 0, None), donate_argnums=(0,))
        else:
            fn = functools.partial(step_fn, **static)
            compiled = jax.jit(
                fn,
                in_shardings=(self.replicated, self.batch_sharding, self.replicated),
                out_shardings=(self.replicated, self.replicated),
                donate_argnums=(0,),
            )

        def step(state, batch, lr_factor=None):
            if lr_factor is not None:
                lr_factor = np.float32(lr_factor)
            return compiled(state, batch, lr_factor)

        return step

    def eval_step(self, step_fn, **static):
        if self.kind == "pmap":
            fn = functools.partial(step_fn, axis_name=AXIS, **static)
            return jax.pmap(fn, axis_name=AXIS)
        fn = functools.partial(step_fn, **static)
        return jax.jit(
            fn,
            in_shardings=(self.replicated, self.batch_sharding),
            out_shardings=self.replicated,
        )

    # Data movement ----------------------------------------------------------------
    def put_state(self, state):
        if self.kind == "pmap":
            n = jax.local_device_count()
            return jax.tree.map(lambda x: jnp.broadcast_to(x, (n, *jnp.shape(x))), state)
        return jax.device_put(state, self.replicated)

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
