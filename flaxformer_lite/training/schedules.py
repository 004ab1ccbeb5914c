"""Learning-rate schedules (optax ``count -> lr``; ``count`` = updates done so far).

``noam`` is the paper's (Section 5.3), exactly:
    lrate = d_model^-0.5 * min(step^-0.5, step * warmup^-1.5)
with ``step = count + 1`` (the paper counts steps from 1), times an optional
``scale`` (1.0 in the paper).

Any of them can end in a cooldown (``with_cooldown``): over the last
``cooldown_steps`` updates the rate is scaled down linearly to zero, as in
warmup-stable-decay schedules. A short run otherwise stops with noam still at
about half its peak, where the parameters rattle around a minimum they could
settle into. A run with a wall-clock budget does not know its last step in
advance: ``cooldown_factor`` is the same ramp over the last fraction of the
run by steps or by the clock, computed by the training loop at every step and
applied by the optimizer (``state.scale_by_lr_factor``).
"""

from __future__ import annotations

import math

import jax.numpy as jnp
import optax

from flaxformer_lite.config.experiment import SCHEDULES, OptimizerConfig


def noam(d_model: int, warmup_steps: int, scale: float = 1.0) -> optax.Schedule:
    if warmup_steps <= 0:
        raise ValueError(f"warmup_steps={warmup_steps} must be positive for the noam schedule")

    def schedule(count):
        step = jnp.asarray(count, jnp.float32) + 1.0
        return scale * d_model**-0.5 * jnp.minimum(step**-0.5, step * warmup_steps**-1.5)

    return schedule


def warmup_cosine(
    peak: float, warmup_steps: int, total_steps: int, end_fraction: float = 0.0
) -> optax.Schedule:
    """Linear warmup to ``peak``, then cosine decay to ``end_fraction * peak``."""
    return optax.warmup_cosine_decay_schedule(
        init_value=0.0,
        peak_value=peak,
        warmup_steps=max(warmup_steps, 1),
        decay_steps=max(total_steps, warmup_steps + 1),
        end_value=peak * end_fraction,
    )


def constant(value: float, warmup_steps: int = 0) -> optax.Schedule:
    if warmup_steps <= 0:
        return optax.constant_schedule(value)
    return optax.join_schedules(
        [optax.linear_schedule(0.0, value, warmup_steps), optax.constant_schedule(value)],
        [warmup_steps],
    )


def with_cooldown(schedule: optax.Schedule, total_steps: int, cooldown_steps: int):
    """``schedule`` times a factor that falls linearly from 1 to 0 over the last
    ``cooldown_steps`` of ``total_steps`` updates (update ``total - k`` is scaled
    by ``k / cooldown_steps``; the last one by ``1 / cooldown_steps``)."""
    if cooldown_steps <= 0:
        return schedule
    if cooldown_steps > total_steps:
        raise ValueError(f"cooldown_steps={cooldown_steps} exceeds the run's {total_steps} updates")

    def cooled(count):
        left = total_steps - jnp.asarray(count, jnp.float32)
        return schedule(count) * jnp.clip(left / cooldown_steps, 0.0, 1.0)

    return cooled


def cooldown_factor(
    fraction: float,
    step: int,
    num_steps: int,
    seconds_left: float = math.inf,
    budget_seconds: float = math.inf,
) -> float:
    """The learning-rate factor for update ``step`` (1-based) of a run that ends
    after ``num_steps`` updates or when the ``seconds_left`` of its
    ``budget_seconds`` run out, whichever comes first: 1 until the last
    ``fraction`` of the run, then falling linearly to 0 at its end.

    By steps it is :func:`with_cooldown` with ``cooldown_steps = fraction *
    num_steps``: update ``num_steps - k + 1`` is scaled by ``k / (fraction *
    num_steps)``. By time, the factor is the seconds left over ``fraction *
    budget_seconds``.
    """
    if fraction <= 0:
        return 1.0
    if not 0 < fraction < 1:
        raise ValueError(f"cooldown fraction {fraction} must be in (0, 1)")
    left = (num_steps - step + 1) / (fraction * num_steps)
    if math.isfinite(budget_seconds):
        left = min(left, seconds_left / (fraction * budget_seconds))
    return min(max(left, 0.0), 1.0)


def make_schedule(opt: OptimizerConfig, d_model: int, total_steps: int) -> optax.Schedule:
    """The schedule named by ``opt.schedule`` (an ``optimizer`` config section),
    with its ``cooldown_steps`` if any."""
    if opt.schedule == "noam":
        schedule = noam(d_model, opt.warmup_steps, opt.learning_rate)
    elif opt.schedule == "warmup_cosine":
        schedule = warmup_cosine(opt.learning_rate, opt.warmup_steps, total_steps)
    elif opt.schedule == "constant":
        schedule = constant(opt.learning_rate, opt.warmup_steps)
    else:
        raise ValueError(
            f"optimizer.schedule={opt.schedule!r}; choose one of {', '.join(SCHEDULES)}"
        )
    return with_cooldown(schedule, total_steps, opt.cooldown_steps)
