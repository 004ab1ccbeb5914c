"""Train state and optimizer.

The state is a plain pytree (step, params, opt_state, rng) so that orbax saves
it as it is and jit/pmap donate it. ``rng`` holds raw key data; every step
derives its dropout key as ``fold_in(rng, step)``, so a resumed run draws the
same randomness as an uninterrupted one.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import flax
import flax.linen as nn
import jax
import jax.numpy as jnp
import optax
from jax.sharding import PartitionSpec

from flaxformer_lite.config.experiment import ExperimentConfig, OptimizerConfig
from flaxformer_lite.config.model import ModelConfig
from flaxformer_lite.model import partitioning, stacks
from flaxformer_lite.model.build import build_model
from flaxformer_lite.model.classifier import Classifier
from flaxformer_lite.model.lm import LanguageModel
from flaxformer_lite.training.schedules import make_schedule

# The gradients' global norm: optax.tree.norm where optax has it (0.2.5 and later deprecate
# optax.global_norm in its favour).
_global_norm = getattr(getattr(optax, "tree", None), "norm", None) or optax.global_norm


@flax.struct.dataclass
class TrainState:
    """What a training checkpoint holds: step, parameters, optimizer state, dropout key."""

    step: jax.Array  # int32 scalar: updates applied so far (micro-steps with accumulation)
    params: Any
    opt_state: Any
    rng: jax.Array  # uint32 key data


class ParamsEMAState(NamedTuple):
    """Stored in checkpoints as a ``{count, ema}`` node, which is how
    :func:`flaxformer_lite.workdir.folder.find_params_ema` finds the average without the
    optimizer."""

    count: jax.Array  # updates averaged so far
    ema: Any  # the bias-corrected moving average of the parameters (float32)


def params_ema(decay: float) -> optax.GradientTransformation:
    """An exponential moving average of the parameters, kept in the optimizer state.

    Chained after the optimizer: the updates pass through unchanged, and the
    state averages the parameters they produce. The average is bias-corrected
    like Adam's moments (the same as starting from zeros and dividing by
    ``1 - decay**t``), so it never leans on the initialisation: after one step it
    is that step's parameters, later ``ema += (1 - decay) / (1 - decay**t) * (p - ema)``.
    """
    if not 0.0 < decay < 1.0:
        raise ValueError(f"EMA decay {decay} must be in (0, 1)")

    def init(params):
        # A copy: a buffer shared with the parameters would be donated twice by the step.
        ema = jax.tree.map(lambda p: jnp.array(p, jnp.float32, copy=True), params)
        return ParamsEMAState(jnp.zeros([], jnp.int32), ema)

    def update(updates, state, params=None):
        if params is None:
            raise ValueError("params_ema needs the parameters: call tx.update(g, s, params)")
        new = optax.apply_updates(params, updates)
        t = (state.count + 1).astype(jnp.float32)
        w = (1.0 - decay) / (1.0 - decay**t)
        ema = jax.tree.map(lambda e, p: e + w * (p.astype(jnp.float32) - e), state.ema, new)
        return updates, ParamsEMAState(state.count + 1, ema)

    return optax.GradientTransformation(init, update)


def scale_by_lr_factor() -> optax.GradientTransformationExtraArgs:
    """Scales the updates by a factor the caller passes to every update
    (``tx.update(g, s, params, lr_factor=f)``), stateless.

    Chained after Adam this scales the learning rate by ``f`` exactly. It is how a
    factor that is not a function of the step count reaches the step: the
    cooldown over the last part of a wall-clock budget (``optimizer.cooldown_fraction``),
    which the training loop computes from its clock.
    """

    def init(params):
        del params
        return optax.EmptyState()

    def update(updates, state, params=None, *, lr_factor=None, **extra_args):
        del params, extra_args
        if lr_factor is None:
            raise ValueError(
                "this optimizer scales its learning rate by a factor given at each "
                "update: call tx.update(g, s, params, lr_factor=f)"
            )
        factor = jnp.asarray(lr_factor, jnp.float32)
        return jax.tree.map(lambda u: u * factor.astype(u.dtype), updates), state

    return optax.GradientTransformationExtraArgs(init, update)


class SpikeGuardState(NamedTuple):
    """The loss-spike guard's part of the optimizer state (:func:`skip_spikes`)."""

    inner: Any  # the guarded optimizer's state
    norms: jax.Array  # [window] the last accepted gradient norms (NaN: not yet filled)
    accepted: jax.Array  # updates applied so far
    skipped: jax.Array  # updates skipped so far (logged as skipped_updates)


SPIKE_GUARD_MIN = 10  # accepted norms needed before the guard judges


def skip_spikes(
    inner: optax.GradientTransformation, factor: float, window: int
) -> optax.GradientTransformationExtraArgs:
    """``inner``, except that an update whose gradient's global norm exceeds ``factor``
    times the median of the last ``window`` accepted norms is skipped: the parameters
    and ``inner``'s state (Adam's moments, counts, the EMA) stay as they were. The
    guard judges once it has seen :data:`SPIKE_GUARD_MIN` accepted norms; skipped
    norms do not enter the median. A NaN norm is not skipped (the run stops on it)."""

    def init(params):
        return SpikeGuardState(
            inner.init(params),
            jnp.full([window], jnp.nan, jnp.float32),
            jnp.zeros([], jnp.int32),
            jnp.zeros([], jnp.int32),
        )

    def update(grads, state, params=None, **extra_args):
        norm = _global_norm(grads).astype(jnp.float32)
        median = jnp.nanmedian(state.norms)
        spike = (state.accepted >= SPIKE_GUARD_MIN) & (norm > factor * median)
        updates, inner_state = optax.with_extra_args_support(inner).update(
            grads, state.inner, params, **extra_args
        )
        keep = lambda new, old: jnp.where(spike, old, new)  # noqa: E731
        updates = jax.tree.map(lambda u: jnp.where(spike, jnp.zeros_like(u), u), updates)
        slot = state.accepted % window
        return updates, SpikeGuardState(
            jax.tree.map(keep, inner_state, state.inner),
            keep(state.norms.at[slot].set(norm), state.norms),
            state.accepted + (~spike).astype(jnp.int32),
            state.skipped + spike.astype(jnp.int32),
        )

    return optax.GradientTransformationExtraArgs(init, update)


def skipped_updates(opt_state) -> jax.Array | None:
    """The spike guard's count of skipped updates in ``opt_state``, or None without one."""
    for leaf in jax.tree.leaves(opt_state, is_leaf=lambda x: isinstance(x, SpikeGuardState)):
        if isinstance(leaf, SpikeGuardState):
            return leaf.skipped
    return None


def evaluation_params(state: TrainState):
    """The parameters to evaluate and translate with: the moving average when the
    optimizer keeps one (``optimizer.ema_decay`` > 0), else the trained ones."""
    for leaf in jax.tree.leaves(state.opt_state, is_leaf=lambda x: isinstance(x, ParamsEMAState)):
        if isinstance(leaf, ParamsEMAState):
            return jax.tree.map(lambda e, p: e.astype(p.dtype), leaf.ema, state.params)
    return state.params


def is_token_embedding(path) -> bool:
    """Whether a parameter path names a token embedding table (``.../embedding``,
    not a learned position table ``.../positions/embedding``)."""
    keys = [getattr(k, "key", None) for k in path]
    return keys[-1:] == ["embedding"] and "positions" not in keys


def _embedding_tables(params):
    return jax.tree_util.tree_map_with_path(lambda path, _: is_token_embedding(path), params)


def make_optimizer(opt: OptimizerConfig, model: ModelConfig, total_steps: int):
    """(optax transformation, schedule) from an ``optimizer`` config section.

    Adam(b1, b2, eps) with the schedule (AdamW if ``weight_decay`` > 0),
    optionally after global-norm clipping, with the token embeddings' updates
    scaled by ``embedding_lr_scale``, then (``cooldown_fraction`` > 0) by the
    factor each update is given (:func:`scale_by_lr_factor`), then (``ema_decay`` > 0) the
    parameters' moving average (:func:`params_ema`), all of it (``spike_factor`` > 0)
    under the loss-spike guard (:func:`skip_spikes`); ``grad_accum_steps`` > 1
    wraps it in ``optax.MultiSteps`` (the schedule then counts real updates).
    """
    schedule = make_schedule(opt, model.d_model, total_steps // opt.grad_accum_steps)
    if opt.weight_decay > 0:
        adam = optax.adamw(
            schedule, b1=opt.b1, b2=opt.b2, eps=opt.eps, weight_decay=opt.weight_decay
        )
    else:
        adam = optax.adam(schedule, b1=opt.b1, b2=opt.b2, eps=opt.eps)
    tx = adam
    if opt.clip_grad_norm > 0:
        tx = optax.chain(optax.clip_by_global_norm(opt.clip_grad_norm), adam)
    if opt.embedding_lr_scale != 1.0:
        tx = optax.chain(tx, optax.masked(optax.scale(opt.embedding_lr_scale), _embedding_tables))
    if opt.cooldown_fraction > 0:
        tx = optax.chain(tx, scale_by_lr_factor())
    if opt.ema_decay > 0:
        tx = optax.chain(tx, params_ema(opt.ema_decay))
    if opt.spike_factor > 0:
        tx = skip_spikes(tx, opt.spike_factor, opt.spike_window)
    if opt.grad_accum_steps > 1:
        tx = optax.MultiSteps(tx, every_k_schedule=opt.grad_accum_steps)
    return tx, schedule


def _init_args(model: nn.Module, length: int) -> tuple:
    dummy = jnp.ones((1, length), jnp.int32)
    return (dummy,) if isinstance(model, LanguageModel | Classifier) else (dummy, dummy)


def create_train_state(
    model: nn.Module,
    tx: optax.GradientTransformation,
    seed: int,
    length: int,
    shardings: TrainState | None = None,
) -> TrainState:
    """Initialise parameters (from ``seed``) and optimizer state, in one compiled
    program; with ``shardings`` (:func:`state_partitioning` through the mesh) each
    device creates only its own shards, so a model larger than one device fits."""
    args = _init_args(model, length)

    def init() -> TrainState:
        init_rng, dropout_rng = jax.random.split(jax.random.key(seed))
        params = partitioning.unbox(stacks.init(model, init_rng, *args)["params"])
        return TrainState(
            step=jnp.zeros((), jnp.int32),
            params=params,
            opt_state=tx.init(params),
            rng=jax.random.key_data(dropout_rng),
        )

    return jax.jit(init, out_shardings=shardings)()


def state_partitioning(
    model: nn.Module, tx: optax.GradientTransformation, length: int
) -> tuple[TrainState, TrainState]:
    """(logical PartitionSpecs, shapes) of the train state, nothing allocated.

    Parameters carry the axis names their modules gave them; every optimizer-state
    leaf shaped like a parameter (Adam's moments, the EMA, accumulated gradients)
    takes its parameter's names, matched by the parameter's path at the end of its
    own; the rest (counts, the step, the key) is replicated.
    """
    args = _init_args(model, length)
    boxed = jax.eval_shape(lambda: model.init(jax.random.key(0), *args)["params"])
    param_specs = partitioning.logical_specs(boxed)
    params = partitioning.unbox(boxed)
    by_path = {
        _path_names(path): (spec, x.shape)
        for (path, x), spec in zip(
            jax.tree_util.tree_flatten_with_path(params)[0],
            jax.tree.leaves(param_specs, is_leaf=lambda x: isinstance(x, PartitionSpec)),
            strict=True,
        )
    }
    opt_state = jax.eval_shape(tx.init, params)

    def spec_of(path, leaf):
        names = _path_names(path)
        for start in range(len(names)):
            found = by_path.get(names[start:])
            if found is not None and found[1] == leaf.shape:
                return found[0]
        return PartitionSpec()

    opt_specs = jax.tree_util.tree_map_with_path(spec_of, opt_state)
    abstract = TrainState(
        step=jax.ShapeDtypeStruct((), jnp.int32),
        params=params,
        opt_state=opt_state,
        rng=jax.eval_shape(lambda: jax.random.key_data(jax.random.key(0))),
    )
    specs = TrainState(
        step=PartitionSpec(), params=param_specs, opt_state=opt_specs, rng=PartitionSpec()
    )
    return specs, abstract


def _path_names(path) -> tuple[str, ...]:
    return tuple(str(getattr(k, "key", getattr(k, "name", getattr(k, "idx", k)))) for k in path)


def parameter_count(params) -> int:
    return int(sum(x.size for x in jax.tree.leaves(params)))


def abstract_train_state(config) -> TrainState:
    """Shapes/dtypes of the TrainState of an experiment config, nothing allocated
    (for restoring a whole training checkpoint)."""
    config = ExperimentConfig.from_config(config)
    tx, _ = make_optimizer(config.optimizer, config.model, config.train.num_steps)
    model = build_model(config.model, config.data.task)
    return jax.eval_shape(
        lambda: create_train_state(model, tx, config.train.seed, config.data.max_length)
    )
