"""Train state and optimizer.

The state is a plain pytree (step, params, opt_state, rng) so that orbax saves
it as it is and jit/pmap donate it. ``rng`` holds raw key data; every step
derives its dropout key as ``fold_in(rng, step)``, so a resumed run draws the
same randomness as an uninterrupted one.
"""

from __future__ import annotations

from typing import Any

import flax
import flax.linen as nn
import jax
import jax.numpy as jnp
import optax

from flaxformer_lite.architectures.lm import LanguageModel
from flaxformer_lite.architectures.transformer import Transformer
from flaxformer_lite.config import ModelConfig
from flaxformer_lite.training.schedules import make_schedule


@flax.struct.dataclass
class TrainState:
    step: jax.Array  # int32 scalar: updates applied so far (micro-steps with accumulation)
    params: Any
    opt_state: Any
    rng: jax.Array  # uint32 key data


def build_model(model_config: ModelConfig, task: str = "translation") -> nn.Module:
    """The encoder-decoder for ``translation``, the decoder-only LM for ``lm``."""
    return LanguageModel(model_config) if task == "lm" else Transformer(model_config)


def make_optimizer(opt, model: ModelConfig, total_steps: int):
    """(optax transformation, schedule) from an ``optimizer`` config section.

    Adam(b1, b2, eps) with the schedule (AdamW if ``weight_decay`` > 0),
    optionally after global-norm clipping; ``grad_accum_steps`` > 1 wraps it
    in ``optax.MultiSteps`` (the schedule then counts real updates).
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
    if opt.grad_accum_steps > 1:
        tx = optax.MultiSteps(tx, every_k_schedule=opt.grad_accum_steps)
    return tx, schedule


def create_train_state(
    model: nn.Module, tx: optax.GradientTransformation, seed: int, length: int
) -> TrainState:
    """Initialise parameters (from ``seed``) and optimizer state."""
    init_rng, dropout_rng = jax.random.split(jax.random.key(seed))
    dummy = jnp.ones((1, length), jnp.int32)
    args = (dummy,) if isinstance(model, LanguageModel) else (dummy, dummy)
    params = jax.jit(lambda r: model.init(r, *args)["params"])(init_rng)
    return TrainState(
        step=jnp.zeros((), jnp.int32),
        params=params,
        opt_state=tx.init(params),
        rng=jax.random.key_data(dropout_rng),
    )


def parameter_count(params) -> int:
    return int(sum(x.size for x in jax.tree.leaves(params)))
