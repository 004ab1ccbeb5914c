"""Pure train and eval steps (no side effects; jit or pmap them in parallel.py).

A batch is a dict of ``inputs``/``targets`` (+ packing ``*_segment_ids``,
``*_positions``) for the encoder-decoder, or ``targets`` alone for the
decoder-only LM (which predicts each token from the ones before it).

With ``axis_name`` (pmap), per-device sums are added across devices before
normalising, so the loss is the mean over all non-padding tokens of the
global batch, exactly as the jit path computes it.
"""

from __future__ import annotations

import flax.linen as nn
import jax
import jax.numpy as jnp
import optax
from jax import lax

from flaxformer_lite.architectures.lm import LanguageModel
from flaxformer_lite.training import losses
from flaxformer_lite.training.state import TrainState


def _forward(model: nn.Module, params, batch, *, deterministic: bool, rng=None):
    rngs = None if rng is None else {"dropout": rng}
    if isinstance(model, LanguageModel):
        return model.apply(
            {"params": params},
            batch["targets"],
            positions=batch.get("targets_positions"),
            segmentation=batch.get("targets_segment_ids"),
            deterministic=deterministic,
            rngs=rngs,
        )
    return model.apply(
        {"params": params},
        batch["inputs"],
        batch["targets"],
        inputs_positions=batch.get("inputs_positions"),
        targets_positions=batch.get("targets_positions"),
        inputs_segmentation=batch.get("inputs_segment_ids"),
        targets_segmentation=batch.get("targets_segment_ids"),
        deterministic=deterministic,
        rngs=rngs,
    )


def _norm(tree) -> jax.Array:
    return jnp.sqrt(sum(jnp.sum(jnp.square(x.astype(jnp.float32))) for x in jax.tree.leaves(tree)))


def train_step(
    state: TrainState,
    batch: dict,
    *,
    model: nn.Module,
    tx: optax.GradientTransformation,
    schedule: optax.Schedule,
    label_smoothing: float,
    pad_id: int = 0,
    grad_accum_steps: int = 1,
    axis_name: str | None = None,
) -> tuple[TrainState, dict]:
    """One optimizer (micro-)step; returns the new state and its measurements."""
    rng = jax.random.fold_in(jax.random.wrap_key_data(state.rng), state.step)
    if axis_name is not None:
        rng = jax.random.fold_in(rng, lax.axis_index(axis_name))
    weights = (batch["targets"] != pad_id).astype(jnp.float32)
    total_tokens = jnp.sum(weights)
    if axis_name is not None:
        total_tokens = lax.psum(total_tokens, axis_name)

    def loss_fn(params):
        logits = _forward(model, params, batch, deterministic=False, rng=rng)
        s = losses.sums(logits, batch["targets"], weights, label_smoothing)
        return s["loss_sum"] / jnp.maximum(total_tokens, 1.0), s

    (_, sums), grads = jax.value_and_grad(loss_fn, has_aux=True)(state.params)
    if axis_name is not None:
        grads = lax.psum(grads, axis_name)
        sums = lax.psum(sums, axis_name)
    updates, opt_state = tx.update(grads, state.opt_state, state.params)
    params = optax.apply_updates(state.params, updates)
    metrics = losses.summarize(sums)
    metrics.update(
        learning_rate=schedule(state.step // grad_accum_steps),
        grad_norm=_norm(grads),
        param_norm=_norm(params),
        update_norm=_norm(updates),
    )
    new_state = state.replace(step=state.step + 1, params=params, opt_state=opt_state)
    return new_state, metrics


def eval_step(
    params,
    batch: dict,
    *,
    model: nn.Module,
    label_smoothing: float,
    pad_id: int = 0,
    axis_name: str | None = None,
) -> dict:
    """Summed loss statistics of one batch (add them over batches, then ``summarize``)."""
    weights = (batch["targets"] != pad_id).astype(jnp.float32)
    logits = _forward(model, params, batch, deterministic=True)
    sums = losses.sums(logits, batch["targets"], weights, label_smoothing)
    if axis_name is not None:
        sums = lax.psum(sums, axis_name)
    return sums
