"""Average the last n checkpoints of a run (the paper: the last 5 for base, 20 for big).

  python -m flaxformer_lite.main average --workdir=runs/x --num=5

Averages the parameters each checkpoint evaluates with (the moving average where
the run kept one, ``optimizer.ema_decay`` > 0) into ``checkpoints_averaged/``,
which ``translate`` and ``evaluate`` then prefer.
"""

from __future__ import annotations

from pathlib import Path

import jax
import jax.numpy as jnp

from flaxformer_lite.inference.run import Run
from flaxformer_lite.workdir import checkpoints as ckpt_lib


def average_params(run: Run, steps: list[int]):
    """The float32 mean of the evaluation parameters of ``run``'s ``last`` checkpoints
    of ``steps``, one checkpoint in memory at a time."""
    total = None
    for step in steps:
        params, _ = run.params("last", step)
        params = jax.tree.map(lambda x: jnp.asarray(x, jnp.float32), params)
        total = params if total is None else jax.tree.map(jnp.add, total, params)
    return jax.tree.map(lambda x: x / len(steps), total)


def average_workdir(workdir: str | Path, num: int) -> tuple[int, list[int]]:
    """Average the last ``num`` checkpoints of ``workdir`` into ``checkpoints_averaged``;
    returns (the newest averaged step, the steps averaged)."""
    if num < 1:
        raise ckpt_lib.CheckpointError(f"--num={num}: average at least one checkpoint")
    run = Run.open(workdir)
    steps = run.steps("last")[-num:]
    if not steps:
        raise ckpt_lib.CheckpointError(f"no checkpoints to average in {workdir}")
    if len(steps) < num:
        print(f"warning: only {len(steps)} checkpoints in {workdir}; averaging those")
    where = ckpt_lib.save_params(workdir, steps[-1], average_params(run, steps))
    what = "moving averages" if run.has_ema else "parameters"
    print(f"averaged the {what} of steps {steps} into {where}")
    return steps[-1], steps
