"""Average the last checkpoints of a run, from its late window only (the paper: the
last 5 for base, 20 for big, written over the final ~7% of a 12-hour run).

  python -m flaxformer_lite.main average --workdir=runs/x --num=5 [--window=0.25]

Averages the parameters each checkpoint evaluates with (the moving average where
the run kept one, ``optimizer.ema_decay`` > 0) into ``checkpoints_averaged/``,
which ``translate`` and ``evaluate`` then prefer.

Only checkpoints from the last ``window`` of the run's steps are averaged (default:
the run's ``train.final_window``, 0.25): weights from a third of the way into a short
run are far behind its end, and taking them in cost a 600-step run a BLEU point
(experiments/translation_recipe). A run writes ``train.final_checkpoints`` into that
window whatever its machine's speed; ``--num`` beyond what the window holds averages
what it holds and says so, and names the older checkpoints it left out.

A run still learning fast is ahead at its last step of any mean that reaches back, so
the mean is kept only where its validation loss (nll on ``data.eval_split``, as
training evaluates) is no worse than the newest checkpoint's alone; otherwise that
checkpoint is kept, and the command says which and why (``--novalidate``: the mean
regardless).
"""

from __future__ import annotations

import math
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

from flaxformer_lite.data import assembly, pipeline
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


def validation_nll(run: Run, trees: list) -> list[float]:
    """The validation nll (nats per target token) of each parameter tree: the batches
    of ``data.eval_split`` the training loop evaluates (``train.eval_batches``)."""
    config, model = run.config, run.model()
    d, t = config.data, config.train
    examples, _ = assembly.validation_examples(config, run.tokenizer)
    batches = pipeline.eval_batches(examples, batch_size=t.batch_size, max_length=d.max_length)
    batches = batches[: t.eval_batches] if t.eval_batches else batches
    pad, lm = config.model.pad_id, run.is_lm

    @jax.jit
    def sums(params, batch):
        targets = batch["targets"]
        if lm:
            logits = model.apply(
                {"params": params}, targets, positions=batch.get("targets_positions"),
                segmentation=batch.get("targets_segment_ids"), deterministic=True,
            )  # fmt: skip
        else:
            logits = model.apply(
                {"params": params}, batch["inputs"], targets,
                inputs_positions=batch.get("inputs_positions"),
                targets_positions=batch.get("targets_positions"),
                inputs_segmentation=batch.get("inputs_segment_ids"),
                targets_segmentation=batch.get("targets_segment_ids"), deterministic=True,
            )  # fmt: skip
        logp = jax.nn.log_softmax(logits.astype(jnp.float32))
        nll = -jnp.take_along_axis(logp, targets[..., None], axis=-1)[..., 0]
        weights = (targets != pad).astype(jnp.float32)
        return jnp.stack([jnp.sum(nll * weights), jnp.sum(weights)])

    out = []
    for params in trees:
        total = np.zeros(2, np.float64)
        for batch in batches:
            total += np.asarray(jax.device_get(sums(params, batch)), np.float64)
        out.append(float(total[0] / max(total[1], 1.0)))
    return out


def window_start(newest: int, window: float) -> int:
    """The first step inside the last ``window`` of a run whose newest checkpoint is
    ``newest`` (``window`` 1: every step)."""
    return max(0, math.ceil((1 - window) * newest - 1e-9))


def choose_steps(kept: list[int], num: int, window: float) -> tuple[list[int], list[str]]:
    """The steps to average among the ``kept`` ones (sorted): the last ``num`` of those
    in the last ``window`` of the run; and one line for each reason a kept step was
    left out, and for a ``num`` the window cannot fill."""
    start = window_start(kept[-1], window)
    late = [s for s in kept if s >= start]
    chosen = late[-num:]
    notes = []
    share = f"the last {window:.0%} of the run's {kept[-1]:,} steps (from step {start:,})"
    if len(late) < num:
        notes.append(f"--num={num}: {share} holds {len(late)} checkpoint(s); averaging those")
    newer_unused = [s for s in late if s not in chosen]
    if newer_unused:
        notes.append(f"left out steps {_steps(newer_unused)}: older than the last {num}")
    early = [s for s in kept if s < start]
    if early:
        notes.append(
            f"left out steps {_steps(early)}: before {share}, too far from the end of "
            f"training to average with it (--window={_wider(kept[-1], early[0])} takes them in)"
        )
    return chosen, notes


def _steps(steps: list[int]) -> str:
    return ", ".join(f"{s:,}" for s in steps)


def _wider(newest: int, step: int) -> str:
    """The smallest window (to 0.05) that reaches back to ``step``."""
    return f"{min(1.0, math.ceil(20 * (1 - step / newest)) / 20):g}"


def average_workdir(
    workdir: str | Path, num: int, window: float | None = None, validate: bool = True
) -> tuple[int, list[int]]:
    """Average the last ``num`` checkpoints of the late ``window`` of ``workdir``'s run
    (default: its ``train.final_window``) into ``checkpoints_averaged`` (with
    ``validate``: the newest alone where its validation nll is lower than the mean's);
    returns (the newest averaged step, the steps averaged)."""
    if num < 1:
        raise ckpt_lib.CheckpointError(f"--num={num}: average at least one checkpoint")
    run = Run.open(workdir)
    window = run.config.train.final_window if window is None else window
    if not 0 < window <= 1:
        raise ckpt_lib.CheckpointError(
            f"--window={window}: the late share of the run to average from must be in "
            "(0, 1] (e.g. 0.25 for the last quarter of its steps, 1 for all of them)"
        )
    kept = run.steps("last")
    if not kept:
        raise ckpt_lib.CheckpointError(f"no checkpoints to average in {workdir}")
    steps, notes = choose_steps(kept, num, window)
    for note in notes:
        print(note)
    params = average_params(run, steps)
    if validate and len(steps) > 1 and run.task in ("translation", "lm"):
        steps, params = _better_of(run, steps, params)
    where = ckpt_lib.save_params(workdir, steps[-1], params)
    what = "moving average" if run.has_ema else "parameters"
    if len(steps) == 1:
        print(f"wrote the {what} of step {steps[0]:,} to {where}")
    else:
        what = "moving averages" if run.has_ema else "parameters"
        print(f"averaged the {what} of steps {_steps(steps)} into {where}")
    return steps[-1], steps


def _better_of(run: Run, steps: list[int], mean) -> tuple[list[int], object]:
    """(steps, parameters) of the mean of ``steps`` or of the newest alone, whichever
    has the lower validation nll (the mean on a tie)."""
    newest = average_params(run, steps[-1:])
    mean_nll, newest_nll = validation_nll(run, [mean, newest])
    versus = (
        f"validation nll {mean_nll:.4f} for the mean of steps {_steps(steps)}, "
        f"{newest_nll:.4f} for step {steps[-1]:,} alone"
    )
    if newest_nll < mean_nll:
        print(
            f"{versus}: keeping step {steps[-1]:,} alone (the run was still improving "
            "faster than averaging helps; --novalidate keeps the mean)"
        )
        return steps[-1:], newest
    print(f"{versus}: keeping the mean")
    return steps, mean
