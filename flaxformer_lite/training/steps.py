"""Pure train and eval steps (no side effects; jit or pmap them in parallel.py).

A batch is a dict of ``inputs``/``targets`` (+ packing ``*_segment_ids``,
``*_positions``) for the encoder-decoder, ``targets`` alone for the decoder-only LM
(which predicts each token from the ones before it), or ``inputs`` and the label as
``targets[:, 0]`` for the classifier; an optional ``weights`` says which targets the
loss counts (a generated recall task's answers), else every non-padding one.

With ``axis_name`` (pmap), per-device sums are added across devices before
normalising, so the loss is the mean over all non-padding tokens of the
global batch, exactly as the jit path computes it.

``concurrent_splits`` = k > 1 cuts the batch into k row groups whose forward
and backward passes are independent chains of one program; their gradients
are added. The gradient is the same (each token's loss is still divided by
the batch's token count; only the dropout draws differ), but XLA:CPU, which
runs each small matmul on one thread, executes independent chains on
different cores at once. On 2 CPU cores the tiny config's step gets ~10%
faster with k = 2 (benchmarks/train_step.py); on accelerators leave it at 1.
"""

from __future__ import annotations

import flax.linen as nn
import jax
import jax.numpy as jnp
import optax
from jax import lax

from flaxformer_lite.model.build import build_model
from flaxformer_lite.model.classifier import Classifier
from flaxformer_lite.model.lm import LanguageModel
from flaxformer_lite.training import losses
from flaxformer_lite.training.state import TrainState, skipped_updates
from flaxformer_lite.workdir.layer_layout import unrolled


def forward(model: nn.Module, params, batch, *, deterministic: bool = True, rng=None, **apply):
    """The model's logits on a batch, whatever the task (``apply``: flax's ``apply``
    keywords, e.g. ``mutable=["intermediates"]``)."""
    rngs = None if rng is None else {"dropout": rng}
    variables = {"params": params}
    if isinstance(model, Classifier):
        return model.apply(
            variables, batch["inputs"], deterministic=deterministic, rngs=rngs, **apply
        )
    if isinstance(model, LanguageModel):
        return model.apply(
            variables,
            batch["targets"],
            positions=batch.get("targets_positions"),
            segmentation=batch.get("targets_segment_ids"),
            deterministic=deterministic,
            rngs=rngs,
            **apply,
        )
    return model.apply(
        variables,
        batch["inputs"],
        batch["targets"],
        inputs_positions=batch.get("inputs_positions"),
        targets_positions=batch.get("targets_positions"),
        inputs_segmentation=batch.get("inputs_segment_ids"),
        targets_segmentation=batch.get("targets_segment_ids"),
        deterministic=deterministic,
        rngs=rngs,
        **apply,
    )


def _scored(model: nn.Module, batch: dict, pad_id: int) -> tuple[jax.Array, jax.Array]:
    """(targets, weights) the loss is taken over: every non-padding target token, or the
    batch's own ``weights`` (a generated recall task scores only its answers); a
    classifier's one target per row (its label, at position 0)."""
    targets = batch["targets"]
    if "weights" in batch:
        weights = batch["weights"].astype(jnp.float32)
    else:
        weights = (targets != pad_id).astype(jnp.float32)
    if isinstance(model, Classifier):
        return targets[:, :1], weights[:, :1]
    return targets, weights


def _norm(tree) -> jax.Array:
    return jnp.sqrt(sum(jnp.sum(jnp.square(x.astype(jnp.float32))) for x in jax.tree.leaves(tree)))


def train_step(
    state: TrainState,
    batch: dict,
    lr_factor: jax.Array | None = None,
    *,
    model: nn.Module,
    tx: optax.GradientTransformation,
    schedule: optax.Schedule,
    label_smoothing: float,
    pad_id: int = 0,
    grad_accum_steps: int = 1,
    concurrent_splits: int = 1,
    microbatches: int = 1,
    axis_name: str | None = None,
) -> tuple[TrainState, dict]:
    """One optimizer (micro-)step; returns the new state and its measurements.

    ``lr_factor`` (a float32 scalar) is passed on to the optimizer, whose
    :func:`~flaxformer_lite.training.state.scale_by_lr_factor` multiplies the
    learning rate by it: the time-based cooldown. None for an optimizer without one.
    """
    rng = jax.random.fold_in(jax.random.wrap_key_data(state.rng), state.step)
    if axis_name is not None:
        rng = jax.random.fold_in(rng, lax.axis_index(axis_name))
    targets, weights = _scored(model, batch, pad_id)
    batch = {**batch, "targets": targets} if isinstance(model, Classifier) else batch
    total_tokens = jnp.sum(weights)
    if axis_name is not None:
        total_tokens = lax.psum(total_tokens, axis_name)

    def loss_fn(params, part, part_weights, part_rng):
        logits = forward(model, params, part, deterministic=False, rng=part_rng)
        s = losses.sums(logits, part["targets"], part_weights, label_smoothing)
        return s["loss_sum"] / jnp.maximum(total_tokens, 1.0), s

    grad_fn = jax.value_and_grad(loss_fn, has_aux=True)
    if microbatches > 1:
        grads, sums = _accumulate(grad_fn, state.params, batch, weights, rng, microbatches)
    elif concurrent_splits == 1:
        (_, sums), grads = grad_fn(state.params, batch, weights, rng)
    else:
        rows = weights.shape[0]  # divisible: config/rules.py and Parallel checked it

        # Part k takes rows k, k + splits, ...: a batch sharded by rows over a mesh
        # keeps every part spread over all devices (no data movement).
        def rows_of(value, k):
            return value.reshape(rows // concurrent_splits, concurrent_splits, *value.shape[1:])[
                :, k
            ]

        grads = sums = None
        for k in range(concurrent_splits):
            part = {name: rows_of(value, k) for name, value in batch.items()}
            part_rng = jax.random.fold_in(rng, k)
            (_, s), g = grad_fn(state.params, part, rows_of(weights, k), part_rng)
            grads = g if grads is None else jax.tree.map(jnp.add, grads, g)
            sums = s if sums is None else jax.tree.map(jnp.add, sums, s)
    if axis_name is not None:
        grads = lax.psum(grads, axis_name)
        sums = lax.psum(sums, axis_name)
    if lr_factor is None:
        updates, opt_state = tx.update(grads, state.opt_state, state.params)
    else:
        updates, opt_state = tx.update(grads, state.opt_state, state.params, lr_factor=lr_factor)
    params = optax.apply_updates(state.params, updates)
    metrics = losses.summarize(sums)
    metrics.update(
        learning_rate=schedule(state.step // grad_accum_steps)
        * (1.0 if lr_factor is None else lr_factor),
        grad_norm=_norm(grads),
        param_norm=_norm(params),
        update_norm=_norm(updates),
    )
    skipped = skipped_updates(opt_state)
    if skipped is not None:
        metrics["skipped_updates"] = skipped  # the spike guard's total so far
    new_state = state.replace(step=state.step + 1, params=params, opt_state=opt_state)
    return new_state, metrics


def _accumulate(grad_fn, params, batch, weights, rng, microbatches: int):
    """(gradient, loss sums) of the batch, computed as ``microbatches`` micro-batches one
    after another (``lax.scan``): only one micro-batch's activations are alive at a
    time. Each micro-batch's loss is divided by the *whole* batch's token count, so
    the sum is the whole batch's gradient exactly (``train.microbatches``); only the
    dropout draws differ. Micro-batch ``k`` takes rows ``k, k + microbatches, ...``,
    so every micro-batch stays spread over the devices the batch is split over."""
    rows = weights.shape[0]
    if rows % microbatches:
        raise ValueError(
            f"train.microbatches={microbatches} does not divide the {rows} rows of a batch"
        )

    def parts(value):
        value = value.reshape(rows // microbatches, microbatches, *value.shape[1:])
        return jnp.swapaxes(value, 0, 1)

    def body(carry, xs):
        part, part_weights, k = xs
        (_, s), g = grad_fn(params, part, part_weights, jax.random.fold_in(rng, k))
        return jax.tree.map(jnp.add, carry, (g, s)), None

    first = jax.tree.map(lambda v: v[0], (jax.tree.map(parts, batch), parts(weights)))
    shapes = jax.eval_shape(lambda: grad_fn(params, *first, rng))
    zeros = jax.tree.map(lambda x: jnp.zeros(x.shape, x.dtype), (shapes[1], shapes[0][1]))
    xs = (jax.tree.map(parts, batch), parts(weights), jnp.arange(microbatches))
    (grads, sums), _ = lax.scan(body, zeros, xs)
    return grads, sums


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
    targets, weights = _scored(model, batch, pad_id)
    logits = forward(model, params, batch, deterministic=True)
    sums = losses.sums(logits, targets, weights, label_smoothing)
    if axis_name is not None:
        sums = lax.psum(sums, axis_name)
    return sums


def sown_attention(config, batch):
    """A jitted ``params -> intermediates``: the model with its attention weights sown,
    on ``batch`` (a few validation rows), for ``train.attention_stats_every``. The
    layers run unrolled, each one's weights under its name (``model.scan_layers``)."""
    c = config.model
    model = build_model(c.replace(sow_attention_weights=True, scan_layers=False), config.data.task)
    rows = {k: jnp.asarray(v) for k, v in batch.items()}

    @jax.jit
    def sown(params):
        _, state = forward(model, unrolled(c, params)[1], rows, mutable=["intermediates"])
        return state["intermediates"]

    return sown
