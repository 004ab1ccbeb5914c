"""Checkpoints with orbax: save, keep the last K, keep the best, resume, average.

Layout of a workdir::

  config.json               the experiment config of the run (checked on resume)
  tokenizer.model           the run's sentencepiece model
  checkpoints/<step>/       the last K train states + the data iterator position
  checkpoints_best/<step>/  the state with the best validation metric
  checkpoints_averaged/<step>/  parameters averaged over the last n checkpoints

Used by training and by decoding; imports neither.
"""

from __future__ import annotations

import json
import shutil
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import orbax.checkpoint as ocp

CONFIG_FILE = "config.json"
KINDS = ("last", "best", "averaged")
_DIRS = {"last": "checkpoints", "best": "checkpoints_best", "averaged": "checkpoints_averaged"}


class CheckpointError(RuntimeError):
    """A checkpoint cannot be used; the message says why and what to do."""


def _manager(directory: Path, **options) -> ocp.CheckpointManager:
    return ocp.CheckpointManager(
        directory.absolute(),
        options=ocp.CheckpointManagerOptions(
            create=True, enable_async_checkpointing=False, **options
        ),
    )


def _abstract(tree):
    return jax.tree.map(ocp.utils.to_shape_dtype_struct, tree)


class Checkpoints:
    """The checkpoints of one workdir."""

    def __init__(self, workdir: str | Path, keep: int = 5, best_mode: str = "min"):
        self.workdir = Path(workdir)
        self.last = _manager(self.workdir / _DIRS["last"], max_to_keep=keep)
        self.best = _manager(
            self.workdir / _DIRS["best"],
            max_to_keep=1,
            best_fn=lambda metrics: metrics["value"],
            best_mode=best_mode,
        )

    def latest_step(self) -> int | None:
        return self.last.latest_step()

    def save(self, step: int, state: Any, data_state: Mapping | None = None) -> None:
        self.last.save(
            step,
            args=ocp.args.Composite(
                state=ocp.args.StandardSave(state),
                data=ocp.args.JsonSave(dict(data_state or {})),
            ),
            force=True,
        )
        self.last.wait_until_finished()

    def save_best(self, step: int, state: Any, value: float) -> bool:
        """Offer a state with its validation metric; kept if it is the best so far."""
        self.best.save(
            step,
            args=ocp.args.Composite(state=ocp.args.StandardSave(state)),
            metrics={"value": float(value)},
            force=True,
        )
        self.best.wait_until_finished()
        return self.best.best_step() == step

    def restore(self, target_state: Any, step: int | None = None) -> tuple[Any, dict]:
        """(state, data iterator state) of ``step`` (default: the latest)."""
        step = self.latest_step() if step is None else step
        if step is None:
            raise CheckpointError(f"no checkpoint in {self.workdir / _DIRS['last']}")
        try:
            restored = self.last.restore(
                step,
                args=ocp.args.Composite(
                    state=ocp.args.StandardRestore(_abstract(target_state)),
                    data=ocp.args.JsonRestore(),
                ),
            )
        except ValueError as e:
            raise CheckpointError(
                f"the checkpoint at step {step} in {self.workdir} does not fit this model "
                f"({str(e)[:300]}); use a new --workdir, or the config it was trained with"
            ) from e
        except Exception as e:  # unreadable files: truncated, deleted, foreign
            raise CheckpointError(
                f"the checkpoint at step {step} in {self.workdir} is unreadable "
                f"({type(e).__name__}: {str(e)[:300]}); delete that step's folder to resume "
                "from the one before"
            ) from e
        return restored["state"], dict(restored["data"] or {})

    def close(self) -> None:
        self.last.close()
        self.best.close()


def available(workdir: str | Path, kind: str) -> int | None:
    """The step of the newest checkpoint of ``kind`` (last/best/averaged), or None."""
    directory = Path(workdir) / _DIRS[kind]
    if not directory.is_dir():
        return None
    steps = [int(p.name) for p in directory.iterdir() if p.name.isdigit()]
    return max(steps) if steps else None


def restore_params(workdir: str | Path, target_params: Any, kind: str = "best") -> tuple[Any, int]:
    """Parameters of the newest checkpoint of ``kind``; returns (params, step).

    ``target_params`` gives shapes/dtypes (e.g. ``jax.eval_shape`` of model.init).
    """
    if kind not in KINDS:
        raise CheckpointError(f"checkpoint kind {kind!r}; choose one of {', '.join(KINDS)}")
    step = available(workdir, kind)
    if step is None:
        raise CheckpointError(
            f"no {kind!r} checkpoint in {workdir}: train first "
            f"(python -m flaxformer_lite.main --workdir={workdir} ...)"
            + (
                " or average (python -m flaxformer_lite.main average ...)"
                if kind == "averaged"
                else ""
            )
        )
    manager = _manager(Path(workdir) / _DIRS[kind], read_only=True)
    item = "params" if kind == "averaged" else "state"
    target = {"params": _abstract(target_params)}
    device = jax.sharding.SingleDeviceSharding(jax.local_devices()[0])
    restore_args = jax.tree.map(
        lambda x: ocp.ArrayRestoreArgs(dtype=x.dtype, sharding=device), target
    )
    try:
        # Partial restore: only the parameters of a full train state are read.
        restored = manager.restore(
            step,
            args=ocp.args.Composite(
                **{
                    item: ocp.args.PyTreeRestore(
                        item=target, restore_args=restore_args, partial_restore=True
                    )
                }
            ),
        )
    except ValueError as e:
        raise CheckpointError(
            f"the {kind} checkpoint (step {step}) in {workdir} does not fit this model: "
            f"{str(e)[:300]}"
        ) from e
    finally:
        manager.close()
    return restored[item]["params"], step


def restore_last_state(
    workdir: str | Path, target_state: Any, step: int | None = None
) -> tuple[Any, int]:
    """The whole train state of the newest ``last`` checkpoint (or of ``step``),
    read-only; (state, step). For what the parameters alone do not hold, such as
    their moving average."""
    if step is None:
        step = available(workdir, "last")
        if step is None:
            raise CheckpointError(f"no checkpoint in {Path(workdir) / _DIRS['last']}: train first")
    else:
        directory = Path(workdir) / _DIRS["last"]
        kept = sorted(int(p.name) for p in directory.glob("*") if p.name.isdigit())
        if step not in kept:
            raise CheckpointError(
                f"no checkpoint of step {step} in {directory}; the steps kept are "
                f"{', '.join(map(str, kept)) or 'none'}"
            )
    manager = _manager(Path(workdir) / _DIRS["last"], read_only=True)
    try:
        restored = manager.restore(
            step,
            args=ocp.args.Composite(state=ocp.args.StandardRestore(_abstract(target_state))),
        )
    except ValueError as e:
        raise CheckpointError(
            f"the checkpoint at step {step} in {workdir} does not fit its config: {str(e)[:300]}"
        ) from e
    finally:
        manager.close()
    return restored["state"], step


def average_last(
    workdir: str | Path, target_state: Any, num: int, params_of=None
) -> tuple[int, list[int]]:
    """Average the parameters of the last ``num`` checkpoints into ``checkpoints_averaged``.

    The paper averages the last 5 (base) or 20 (big) checkpoints. ``params_of``
    picks the parameters of a restored state (default: ``state.params``; a run
    with a parameter EMA passes its average). Returns (step of the newest
    averaged checkpoint, steps averaged).
    """
    if num < 1:
        raise CheckpointError(f"--num={num}: average at least one checkpoint")
    checkpoints = Checkpoints(workdir)
    steps = sorted(checkpoints.last.all_steps())[-num:]
    if not steps:
        raise CheckpointError(f"no checkpoints to average in {workdir}")
    if len(steps) < num:
        print(f"warning: only {len(steps)} checkpoints in {workdir}; averaging those")
    total = None
    for step in steps:
        state, _ = checkpoints.restore(target_state, step)
        if params_of is not None:
            params = params_of(state)
        else:
            params = state.params if hasattr(state, "params") else state["params"]
        params = jax.tree.map(lambda x: jnp.asarray(x, jnp.float32), params)
        total = params if total is None else jax.tree.map(jnp.add, total, params)
    checkpoints.close()
    mean = jax.tree.map(lambda x: x / len(steps), total)
    # Written beside the old average and swapped in when complete, so a re-run
    # (another --num) replaces it, and an interrupted one leaves it intact.
    target = Path(workdir) / _DIRS["averaged"]
    staging = target.with_name(target.name + ".incoming")
    replaced = target.with_name(target.name + ".replaced")
    shutil.rmtree(staging, ignore_errors=True)
    manager = _manager(staging, max_to_keep=1)
    manager.save(
        steps[-1],
        args=ocp.args.Composite(params=ocp.args.StandardSave({"params": mean})),
        force=True,
    )
    manager.wait_until_finished()
    manager.close()
    shutil.rmtree(replaced, ignore_errors=True)
    if target.exists():
        target.rename(replaced)
    staging.rename(target)
    shutil.rmtree(replaced, ignore_errors=True)
    return steps[-1], steps


def write_config(workdir: str | Path, config_json: str) -> None:
    path = Path(workdir) / CONFIG_FILE
    tmp = path.with_suffix(".tmp")
    tmp.write_text(config_json)
    tmp.replace(path)


def read_config(workdir: str | Path) -> dict | None:
    path = Path(workdir) / CONFIG_FILE
    if not path.exists():
        return None
    try:
        return json.loads(path.read_text())
    except json.JSONDecodeError as e:
        raise CheckpointError(f"{path} is not valid JSON ({e}); restore or delete it") from e
