"""Checkpoints with orbax: save, keep the last K, keep the best, resume, average.

Training writes checkpoints with :class:`Checkpoints`; inference reads parameters with
:func:`restore_params` (:mod:`flaxformer_lite.inference.run`), averaging writes them
with :func:`save_params`. The folder's layout: :mod:`flaxformer_lite.workdir.folder`;
what a failed read or write says: :mod:`flaxformer_lite.workdir.failures`.
"""

from __future__ import annotations

import contextlib
from collections.abc import Mapping
from typing import Any

import jax
import orbax.checkpoint as ocp

from flaxformer_lite.workdir import layer_layout, location, storage
from flaxformer_lite.workdir.failures import disk_error, ignore_closed_loop_reports, unreadable
from flaxformer_lite.workdir.folder import CONFIG_FILE, CheckpointError

__all__ = ["CONFIG_FILE", "CheckpointError", "Checkpoints", "disk_error"]

KINDS = ("last", "best", "averaged")
_DIRS = {"last": "checkpoints", "best": "checkpoints_best", "averaged": "checkpoints_averaged"}


# Where rename is not atomic (a bucket), orbax writes a step in place and marks it
# complete with this file last.
COMMITTED = "commit_success.txt"


def _manager(directory, asynchronous: bool = False, **options) -> ocp.CheckpointManager:
    # Several processes' asynchronous saves meet at barriers named by the step: the
    # last and best managers save the same step at once, so each names its own (with
    # one name for both, the processes paired one's barrier with the other's and hung).
    barriers = ocp.options.MultiprocessingOptions(barrier_sync_key_prefix=directory.name)
    return ocp.CheckpointManager(
        storage.absolute(directory),
        options=ocp.CheckpointManagerOptions(
            create=True,
            enable_async_checkpointing=asynchronous,
            multiprocessing_options=barriers,
            **options,
        ),
    )


def _abstract(tree):
    """Shapes, dtypes and shardings of ``tree``; a leaf without a sharding (e.g. from
    ``jax.eval_shape``) is restored onto one device, whatever mesh saved it."""
    one = _one_device()

    def leaf(x):
        x = ocp.utils.to_shape_dtype_struct(x)
        if getattr(x, "sharding", None) is None:
            x = jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=one)
        return x

    return jax.tree.map(leaf, tree)


def remove_incomplete(directory) -> list[str]:
    """Delete the folders an interrupted save left in ``directory`` and return their
    names. Locally orbax writes a step into ``<step>.orbax-checkpoint-tmp*`` and
    renames it when complete; in a bucket it writes ``<step>`` in place and adds
    ``commit_success.txt`` last. A kill in between leaves the folder, and orbax then
    refuses to save that step again."""
    if not directory.is_dir():
        return []
    remote = location.is_remote(directory)
    committed = _committed(directory) if remote else set()
    removed = []
    for entry in sorted(directory.iterdir()):
        partial = ".orbax-checkpoint-tmp" in entry.name
        if remote and entry.name.isdigit():
            partial = entry.name not in committed
        if partial:
            storage.remove_tree(entry)
            removed.append(entry.name)
    return removed


def _committed(directory) -> set[str]:
    """The step folders of ``directory`` (in a bucket) that hold orbax's commit file."""
    return {p.parent.name for p in directory.glob(f"*/{COMMITTED}")}


class Checkpoints:
    """The checkpoints of one workdir (for training: it clears what an interrupted
    save left behind, so that the run resumes from its newest complete step).

    ``asynchronous`` (default: for a bucket): a save copies the state to host memory
    and returns; the upload goes on beside the next steps (orbax's async save), the
    next save or :meth:`close` waits for it. A local save is a disk write of a
    fraction of a second, kept synchronous so that its errors name their own step."""

    def __init__(
        self, workdir, keep: int = 5, best_mode: str = "min", asynchronous: bool | None = None
    ):
        self.workdir = location.path(workdir)
        if asynchronous is None:
            asynchronous = location.is_remote(self.workdir)
        self.asynchronous = asynchronous
        self.pending = 0  # the step of the newest save (still uploading, if asynchronous)
        if jax.process_index() == 0:
            for kind in ("last", "best"):
                for name in remove_incomplete(self.workdir / _DIRS[kind]):
                    print(
                        f"warning: removed {self.workdir / _DIRS[kind] / name}, an incomplete "
                        "checkpoint of an interrupted save; resuming from the newest complete one"
                    )
        if jax.process_count() > 1:
            from jax.experimental import multihost_utils

            multihost_utils.sync_global_devices("incomplete checkpoints removed")
        self.last = _manager(self.workdir / _DIRS["last"], asynchronous, max_to_keep=keep)
        self.best = _manager(
            self.workdir / _DIRS["best"],
            asynchronous,
            max_to_keep=1,
            best_fn=lambda metrics: metrics["value"],
            best_mode=best_mode,
        )

    def latest_step(self) -> int | None:
        return self.last.latest_step()

    def save(self, step: int, state: Any, data_state: Mapping | None = None) -> None:
        with self._writing("last", step):
            self.last.save(
                step,
                args=ocp.args.Composite(
                    state=ocp.args.StandardSave(state),
                    data=ocp.args.JsonSave(dict(data_state or {})),
                ),
                force=True,
            )
            if not self.asynchronous:
                self.last.wait_until_finished()
            self.pending = step

    @contextlib.contextmanager
    def _writing(self, kind: str, step: int):
        """A save that fails for want of space or permission: its partial folder is
        removed and one :class:`CheckpointError` says what to do; the checkpoints
        written before are untouched."""
        try:
            yield
        except Exception as e:
            reason = disk_error(e)
            if reason is None:
                raise
            ignore_closed_loop_reports()
            directory = self.workdir / _DIRS[kind]
            remove_incomplete(directory)
            newest = self.last.latest_step()
            raise CheckpointError(
                f"cannot write the {kind} checkpoint of step {step} to {directory} "
                f"({reason}); "
                + (
                    f"the checkpoint of step {newest} is intact: "
                    if newest is not None
                    else "no checkpoint was written before: "
                )
                + "free space (or make the folder writable) and rerun the same command to "
                "resume"
            ) from e

    def save_best(self, step: int, state: Any, value: float) -> bool:
        """Offer a state with its validation metric; kept if it is the best so far.
        A best checkpoint of the same step (written before an interruption, then
        computed again after the resume) is replaced."""
        with self._writing("best", step):
            self.best.wait_until_finished()  # the previous best's upload, if any
            if step in self.best.all_steps():
                self.best.delete(step)
            self.best.save(
                step,
                args=ocp.args.Composite(state=ocp.args.StandardSave(state)),
                metrics={"value": float(value)},
                force=True,
            )
            if not self.asynchronous:
                self.best.wait_until_finished()
        return self.best.best_step() == step

    def restore(self, target_state: Any, step: int | None = None) -> tuple[Any, dict]:
        """(state, data iterator state) of ``step``; by default of the newest readable
        step: a newer one that cannot be read (truncated or missing files, shapes of
        another model) is named in a warning and moved aside to ``<step>.unreadable``
        (kept for inspection; a resumed run writes that step again)."""
        if step is not None:
            return self._restore(step, target_state)
        kept = self.last.all_steps()
        if not kept:
            raise CheckpointError(f"no checkpoint in {self.workdir / _DIRS['last']}")
        bad: list[tuple[int, CheckpointError]] = []
        for candidate in sorted(kept, reverse=True):
            try:
                restored = self._restore(candidate, target_state)
            except CheckpointError as e:
                print(f"warning: {e}; trying the checkpoint before it", flush=True)
                bad.append((candidate, e))
                continue
            if bad:
                self._set_aside([s for s, _ in bad])
                print(f"warning: resuming from step {candidate}, the newest readable checkpoint")
            return restored
        raise CheckpointError(
            f"no checkpoint in {self.workdir / _DIRS['last']} can be read (steps "
            f"{', '.join(str(s) for s, _ in bad)}; the newest: {bad[0][1]}); resume with the "
            "config that wrote them, or start over in a new --workdir"
        )

    def _restore(self, step: int, target_state: Any) -> tuple[Any, dict]:
        ignore_closed_loop_reports()

        def read(target):
            return self.last.restore(
                step,
                args=ocp.args.Composite(
                    state=ocp.args.StandardRestore(target), data=ocp.args.JsonRestore()
                ),
            )

        target = _abstract(target_state)
        try:
            restored = _either_layout(read, target, "state")
        except Exception as e:  # truncated, deleted or foreign files; other shapes
            raise unreadable(self.workdir, "last", step, e) from e
        return restored["state"], dict(restored["data"] or {})

    def _set_aside(self, bad_steps: list[int]) -> None:
        if jax.process_index() == 0:
            for step in bad_steps:
                folder = self.workdir / _DIRS["last"] / str(step)
                aside = folder.with_name(f"{step}.unreadable")
                storage.remove_tree(aside)
                storage.move(folder, aside)
                print(f"warning: moved the unreadable checkpoint to {aside}")
        if jax.process_count() > 1:
            from jax.experimental import multihost_utils

            multihost_utils.sync_global_devices("unreadable checkpoints set aside")
        self.last.reload()

    def close(self) -> None:
        """Wait for the saves still uploading, then release orbax's resources."""
        with self._writing("last", self.pending):
            self.last.close()
            self.best.close()


def steps(workdir, kind: str = "last") -> list[int]:
    """The steps of the complete checkpoints of ``kind`` (last/best/averaged), sorted."""
    if kind not in KINDS:
        raise CheckpointError(f"checkpoint kind {kind!r}; choose one of {', '.join(KINDS)}")
    directory = location.path(workdir) / _DIRS[kind]
    if location.is_remote(directory):
        return sorted(int(name) for name in _committed(directory) if name.isdigit())
    if not directory.is_dir():
        return []
    return sorted(int(p.name) for p in directory.iterdir() if p.name.isdigit())


def available(workdir, kind: str) -> int | None:
    """The step of the newest checkpoint of ``kind`` (last/best/averaged), or None."""
    kept = steps(workdir, kind)
    return kept[-1] if kept else None


def _pick_step(workdir, kind: str, step: int | None) -> int:
    """``step`` if a checkpoint of ``kind`` holds it, else (None) the newest; or a clear error."""
    kept = steps(workdir, kind)
    if not kept:
        raise CheckpointError(
            f"no {kind!r} checkpoint in {workdir}: train first "
            f"(python -m flaxformer_lite.main --workdir={workdir} ...)"
            + (
                " or average (python -m flaxformer_lite.main average ...)"
                if kind == "averaged"
                else ""
            )
        )
    if step is None:
        return kept[-1]
    if step not in kept:
        raise CheckpointError(
            f"no checkpoint of step {step} in {location.path(workdir) / _DIRS[kind]}; the "
            f"steps kept are {', '.join(map(str, kept))}"
        )
    return step


def _one_device() -> jax.sharding.Sharding:
    """The first local device as a sharding (``make_single_device_sharding`` since jax
    0.11, which deprecates constructing ``SingleDeviceSharding`` directly)."""
    make = getattr(jax.sharding, "make_single_device_sharding", None)
    if make is None:
        return jax.sharding.SingleDeviceSharding(jax.local_devices()[0])
    return make(jax.local_devices()[0])


def _on_one_device(target):
    device = _one_device()
    return jax.tree.map(lambda x: ocp.ArrayRestoreArgs(dtype=x.dtype, sharding=device), target)


def restore_params(
    workdir, target_params: Any, kind: str = "best", step: int | None = None
) -> tuple[Any, int]:
    """Parameters of a checkpoint of ``kind`` (default: its newest step), on one
    device; returns (params, step). Of a full train state only the parameters are read.

    ``target_params`` gives shapes/dtypes (e.g. ``jax.eval_shape`` of model.init).
    """
    step = _pick_step(workdir, kind, step)
    ignore_closed_loop_reports()
    manager = _manager(location.path(workdir) / _DIRS[kind], read_only=True)
    item = "params" if kind == "averaged" else "state"

    def read(target):
        return manager.restore(
            step,
            args=ocp.args.Composite(
                **{
                    item: ocp.args.PyTreeRestore(
                        item=target, restore_args=_on_one_device(target), partial_restore=True
                    )
                }
            ),
        )

    try:
        restored = _either_layout(read, {"params": _abstract(target_params)}, item)
    except Exception as e:  # truncated, deleted or foreign files; other shapes
        raise unreadable(workdir, kind, step, e) from e
    finally:
        manager.close()
    params = restored[item]["params"]
    check_shapes(params, target_params, f"the {kind} checkpoint of step {step} in {workdir}")
    return params, step


def _either_layout(read, target, key: str) -> dict:
    """``read(target)``; where that fails, ``read`` of the target in the other layer
    layout (``model.scan_layers``), its ``key`` entry turned back into the target's."""
    try:
        return _whole(read(target), key)
    except Exception:
        other, has_layers = layer_layout.switched(target)
        if not has_layers:
            raise
        try:
            restored = _whole(read(_abstract(other)), key)
        except Exception:
            return _whole(read(target), key)  # raises the first error, naming the checkpoint
        restored[key] = layer_layout.switched(restored[key])[0]
        return restored


def _whole(restored, key: str) -> dict:
    """``restored`` as a dict, if it holds every array asked for (a partial restore
    hands back the target's ShapeDtypeStruct where the checkpoint lacks a key)."""
    restored = dict(restored)
    for path, leaf in jax.tree_util.tree_flatten_with_path(restored[key])[0]:
        if isinstance(leaf, jax.ShapeDtypeStruct):
            raise CheckpointError(
                f"parameters of another model: {jax.tree_util.keystr(path)} is missing"
            )
    return restored


def check_shapes(tree: Any, target: Any, what: str) -> None:
    """orbax restores arrays with their stored shapes, whatever the target says: a
    checkpoint of another model would only fail later, inside the model."""
    stored = dict(jax.tree_util.tree_flatten_with_path(tree)[0])
    for path, want in jax.tree_util.tree_flatten_with_path(target)[0]:
        got = stored.get(path)
        if got is None or tuple(got.shape) != tuple(want.shape):
            raise CheckpointError(
                f"{what} cannot be read (parameters of another model: "
                f"{jax.tree_util.keystr(path)} is "
                f"{'missing' if got is None else tuple(got.shape)}, this config needs "
                f"{tuple(want.shape)})"
            )


def restore_state_part(workdir, part: str, step: int | None = None) -> tuple[Any, int]:
    """One top-level field (``params``, ``opt_state``, ...) of a ``last`` checkpoint's
    train state, as stored (nested dicts and lists), on one device; (tree, step).

    Read from the checkpoint's own metadata, so it needs no optimizer to describe it:
    this is how inference reads the parameters' moving average of a run.
    """
    step = _pick_step(workdir, "last", step)
    ignore_closed_loop_reports()
    directory = storage.absolute(location.path(workdir) / _DIRS["last"] / str(step) / "state")
    try:
        stored = ocp.StandardCheckpointer().metadata(directory).item_metadata.tree
    except Exception as e:  # unreadable metadata: truncated, deleted, foreign
        raise unreadable(workdir, "last", step, e) from e
    if part not in stored:
        raise CheckpointError(
            f"the checkpoint at step {step} in {workdir} has no {part!r} (it has "
            f"{', '.join(sorted(stored))})"
        )
    target = {part: jax.tree.map(lambda m: jax.ShapeDtypeStruct(m.shape, m.dtype), stored[part])}
    manager = _manager(location.path(workdir) / _DIRS["last"], read_only=True)
    try:
        restored = manager.restore(
            step,
            args=ocp.args.Composite(
                state=ocp.args.PyTreeRestore(
                    item=target, restore_args=_on_one_device(target), partial_restore=True
                )
            ),
        )
    except Exception as e:
        raise unreadable(workdir, "last", step, e) from e
    finally:
        manager.close()
    return restored["state"][part], step


def save_params(workdir, step: int, params: Any, kind: str = "averaged"):
    """Write ``params`` as the one checkpoint of ``kind`` (the averaged parameters).

    Written beside the old one and swapped in when complete
    (:func:`~flaxformer_lite.workdir.storage.replace_folder`), so a re-run replaces
    it, and an interrupted one leaves it intact. Returns the step's folder.
    """
    target = location.path(workdir) / _DIRS[kind]
    staging = target.with_name(target.name + ".incoming")
    storage.remove_tree(staging)
    manager = _manager(staging, max_to_keep=1)
    manager.save(
        step,
        args=ocp.args.Composite(params=ocp.args.StandardSave({"params": params})),
        force=True,
    )
    manager.wait_until_finished()
    manager.close()
    storage.replace_folder(staging, target, last=(COMMITTED,))
    return target / str(step)
