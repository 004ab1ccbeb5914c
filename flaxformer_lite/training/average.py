"""Average the last n checkpoints of a workdir (the paper: last 5 for base, 20 for big)."""

from __future__ import annotations

from pathlib import Path

import jax
import ml_collections

from flaxformer_lite import checkpoints as ckpt_lib
from flaxformer_lite.experiment import validate_experiment, with_added_fields
from flaxformer_lite.training.state import (
    build_model,
    create_train_state,
    evaluation_params,
    make_optimizer,
)


def load_run_config(workdir: str | Path) -> ml_collections.ConfigDict:
    values = ckpt_lib.read_config(workdir)
    if values is None:
        raise ckpt_lib.CheckpointError(f"{workdir} has no {ckpt_lib.CONFIG_FILE}: not a run folder")
    return ml_collections.ConfigDict(with_added_fields(values))


def abstract_train_state(config):
    """Shapes/dtypes of the run's TrainState, without allocating it."""
    model_config = validate_experiment(config)
    tx, _ = make_optimizer(config.optimizer, model_config, config.train.num_steps)
    model = build_model(model_config, config.data.task)
    return jax.eval_shape(
        lambda: create_train_state(model, tx, config.train.seed, config.data.max_length)
    )


def average_workdir(workdir: str | Path, num: int) -> int:
    """Average the last ``num`` checkpoints: of the parameters' moving average where the
    run kept one (``optimizer.ema_decay`` > 0: what it evaluated and kept as best),
    else of the trained parameters."""
    config = load_run_config(workdir)
    step, steps = ckpt_lib.average_last(
        workdir, abstract_train_state(config), num, params_of=evaluation_params
    )
    what = "moving averages" if config.optimizer.ema_decay > 0 else "parameters"
    print(f"averaged the {what} of steps {steps} into {workdir}/checkpoints_averaged/{step}")
    return step
