"""The training loop's clock and throughput meter.

:class:`Clock` keeps the run's time budget (``train.max_minutes``, counted over
resumes), its cooldown (``optimizer.cooldown_fraction``, by steps or by the clock) and
the agreement between processes: every process must stop at the same step, so the
chief's clock and the chief's stop request decide, read by all at agreed steps.
:class:`Throughput` measures tokens per second over the steps since it was last reset;
the loop resets it in one place, after any periodic action (logging, evaluation,
checkpointing), so that neither evaluation nor saving counts as training time.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable

import jax
import numpy as np

from flaxformer_lite.training import distributed, schedules, startup


class Clock:
    """Deadline, cooldown and cross-process agreement of one training command.

    ``spent_before``: minutes of training behind the restored checkpoint (earlier
    commands of the same run); ``every``: the steps at which several processes agree
    (the logging steps, to spare a collective at every step); ``say``: prints a message
    (the cooldown's start) on the chief.
    """

    def __init__(
        self,
        *,
        max_minutes: float,
        num_steps: int,
        every: int,
        cooldown_fraction: float,
        spent_before: float,
        wall_start: float,
        say: Callable[[str], None],
    ):
        self.start, self.spent_before = wall_start, spent_before
        self.max_minutes, self.num_steps, self.every = max_minutes, num_steps, every
        self.cooldown = cooldown_fraction
        self.deadline = wall_start + 60 * (max_minutes - spent_before) if max_minutes else math.inf
        self.budget_seconds = 60 * max_minutes if max_minutes else math.inf
        self.say, self.cooling = say, False

    def agreed(self, flag: bool, step: int) -> bool:
        """``flag`` as the chief sees it, at every step with one process and at the
        agreement steps with several (False in between)."""
        if jax.process_count() > 1 and step % self.every:
            return False
        return distributed.all_agree(flag)

    def out_of_time(self, step: int) -> bool:
        return math.isfinite(self.deadline) and self.agreed(
            time.perf_counter() >= self.deadline, step
        )

    def spent_already(self) -> bool:
        """Whether the budget was used up by the commands before this one."""
        return distributed.all_agree(time.perf_counter() >= self.deadline)

    def lr_factor(self, step: int) -> float | None:
        """The learning-rate factor of the cooldown for ``step`` (the chief's, so that
        every process applies the same update); None without a cooldown."""
        if not self.cooldown:
            return None
        factor = distributed.chief_value(
            schedules.cooldown_factor(
                self.cooldown,
                step,
                self.num_steps,
                self.deadline - time.perf_counter(),
                self.budget_seconds,
            )
        )
        if factor < 1 and not self.cooling:
            self.say(
                f"cooldown from step {step}: the learning rate falls linearly to 0 "
                f"over the last {self.cooldown:g} of the run"
            )
        self.cooling = factor < 1
        return factor

    def minutes(self) -> float:
        """Minutes of training of the run, this command's included."""
        return self.spent_before + (time.perf_counter() - self.start) / 60

    @property
    def timed(self) -> bool:
        return math.isfinite(self.deadline)

    def projected_steps(self, step: int, seconds_per_step: float) -> int:
        """The step the run will stop at if the steps to come take ``seconds_per_step``."""
        if not self.timed or not seconds_per_step > 0:
            return self.num_steps
        left = max(self.deadline - time.perf_counter(), 0.0)
        return min(self.num_steps, step + int(left / seconds_per_step))


def final_fractions(count: int, window: float) -> list[float]:
    """The shares of a run's budget at which its final checkpoints fall: ``count`` of
    them evenly over the last ``window``, the last at the end (1.0)."""
    return [1 - window + window * i / count for i in range(1, count + 1)]


def read_curve(curve: tuple[tuple[int, float], ...], steps: int) -> tuple[float, int]:
    """The value of a measured ``curve`` ((steps, value), ...) at ``steps``: linear
    between its points, its end value beyond them; and where ``steps`` lies: -1 before
    the first point, 1 after the last, 0 inside."""
    (first_step, first_value), (last_step, last_value) = curve[0], curve[-1]
    if steps < first_step:
        return first_value, -1
    if steps > last_step:
        return last_value, 1
    for (s0, v0), (s1, v1) in zip(curve, curve[1:], strict=False):
        if s0 <= steps <= s1:
            return v0 + (v1 - v0) * (steps - s0) / (s1 - s0), 0
    return first_value, 0  # a curve of one point, at ``steps``


def expectation(curve: tuple[tuple[int, float], ...], steps: int) -> str:
    """What a measured BLEU ``curve`` says of a run that stops at ``steps``, in words."""
    value, where = read_curve(curve, steps)
    (first, _), (end, end_value) = curve[0], curve[-1]
    if where < 0:
        return f"below {value:.1f} at {steps:,} steps ({value:.1f} at {first:,}, its first point)"
    if where > 0:
        return f"~{value:.1f} at {steps:,} steps (measured to {end:,})"
    return f"~{value:.1f} at {steps:,} steps" + (
        f" ({end_value:.1f} at {end:,})" if end > steps else ""
    )


class Pace:
    """Seconds a step since the command's first compiled step (evaluations and saves
    included), and where the clock's budget ends at that pace: the outlook a run
    gives after its first logged window."""

    def __init__(self, clock: Clock):
        self.clock = clock
        self.since: tuple[int, float] | None = None  # (step, time) after the first step

    def started(self, step: int) -> None:
        self.since = (step, time.perf_counter())

    def seconds(self, step: int) -> float | None:
        """The pace so far; None before a step has been timed."""
        if self.since is None or step <= self.since[0]:
            return None
        return (time.perf_counter() - self.since[1]) / (step - self.since[0])

    def projected(self, step: int) -> int | None:
        """The step the run will stop at (None before a step has been timed)."""
        seconds = self.seconds(step)
        return None if seconds is None else self.clock.projected_steps(step, seconds)

    def outlook(self, step: int, curve: tuple[tuple[int, float], ...]) -> str:
        """The pace, the step the budget reaches and what a recorded BLEU ``curve``
        (``train.expected_bleu``) gives there."""
        c, seconds, projected = self.clock, self.seconds(step), self.projected(step)
        text = f"outlook: {seconds:.2f} s a step here, " + (
            f"so train.max_minutes={c.max_minutes:g} ends near step {projected:,} of "
            f"{c.num_steps:,}"
            if c.timed
            else f"{projected:,} steps"
        )
        if curve:
            text += (
                "; by its record (train.expected_bleu) this recipe gives test BLEU "
                + expectation(curve, projected)
            )
        return text


class FinalCheckpoints:
    """When a run writes its final checkpoints (``train.final_checkpoints``), so that
    ``average`` finds late ones on any machine: at fixed shares of the steps the run
    will end at. A step budget ends at ``num_steps``; one whose ``checkpoint_every``
    already puts ``count`` checkpoints in the window gets none (the cadence is enough).
    A wall-clock budget ends where the pace of the command's steps (evaluations and
    saves included) projects: shares of its minutes would fall early by the minutes
    spent before the first step (data, tokenizer, embeddings, compilation), which a
    slow machine's short run can ill afford. The end is saved anyway (the loop's
    ``last``); :meth:`due` answers for the rest."""

    def __init__(self, clock: Clock, *, count: int, window: float, every: int, start_step: int):
        self.clock = clock
        marks = final_fractions(count, window)[:-1] if count else []
        if marks and not clock.timed:
            n = clock.num_steps
            cadence = {s for s in range(every, n + 1, every) if s >= (1 - window) * n}
            marks = [] if len(cadence | {n}) >= count else marks
            # A resumed run skips the marks its earlier commands passed (with a wall-clock
            # budget, the first paced step drops them).
            marks = [m for m in marks if m > start_step / n]
        self.marks = marks

    def steps(self) -> list[int]:
        """A step budget's final checkpoint steps (its marks as steps; the end apart)."""
        return sorted({max(1, math.ceil(m * self.clock.num_steps)) for m in self.marks})

    def due(self, step: int, seconds_per_step: float | None = None) -> bool:
        """Whether ``step`` crosses the next mark; ``seconds_per_step``: the pace so far
        (None before a step was timed). With a wall-clock budget the chief's pace
        decides, read by every process at the agreement steps."""
        if not self.marks:
            return False
        if self.clock.timed:
            end = self.clock.projected_steps(step, seconds_per_step) if seconds_per_step else 0
            progress = step / end if end else 0.0
            if not self.clock.agreed(progress >= self.marks[0], step):
                return False
            progress = distributed.chief_value(progress)
        else:
            progress = step / self.clock.num_steps
            if progress < self.marks[0]:
                return False
        self.marks = [m for m in self.marks if m > progress]
        return True


class Throughput:
    """Tokens and steps since the last :meth:`reset`, and the rates they give (with
    ``peak``, the devices' FLOP/s together, the MFU; and the device memory where the
    backend reports it). The tokens are the non-padding ones of the batch's ``counted``
    field: ``targets`` for translation and language models, ``inputs`` for a
    classifier (whose targets hold one label per row), by ``task``."""

    def __init__(self, step_flops: float, task: str = "translation", peak: float | None = None):
        # peak: FLOP/s of every device together (the datasheet's), for the MFU
        self.step_flops, self.peak = step_flops, peak
        self.counted = "inputs" if task == "classify" else "targets"
        self.reset()

    def reset(self) -> None:
        self.tokens, self.steps, self.since = 0, 0, time.perf_counter()

    def add(self, batch: dict[str, np.ndarray]) -> None:
        """One step of this process's batch, counted for every process: each packs as
        many rows of the same length, so the global count differs from this by packing
        only."""
        self.tokens += int((batch[self.counted] != 0).sum()) * jax.process_count()
        self.steps += 1

    def rates(self) -> dict[str, float]:
        elapsed = time.perf_counter() - self.since
        step_time = elapsed / max(self.steps, 1)
        rates = {
            "tokens_per_sec": self.tokens / elapsed,
            "step_time": step_time,
            "tflops_per_sec": self.step_flops / step_time / 1e12,
        }
        if self.peak:
            rates["mfu"] = self.step_flops / step_time / self.peak
        return rates | device_memory()


def device_memory() -> dict[str, float]:
    """GiB in use and at peak on this process's first device, where the backend says
    (GPUs, TPUs; a CPU reports nothing)."""
    stats = jax.local_devices()[0].memory_stats() or {}
    out = {}
    for key, name in (("bytes_in_use", "memory_gib"), ("peak_bytes_in_use", "peak_memory_gib")):
        if key in stats:
            out[name] = stats[key] / 2**30
    return out


def check_finite(m: dict[str, float], step: int, checkpoints, window: int) -> None:
    """A logged loss or gradient norm that is not finite stops the run, naming the last
    good checkpoint (kept) and the fix."""
    if not math.isfinite(m["loss"]) or not math.isfinite(m["grad_norm"]):
        good = checkpoints.latest_step()
        raise startup.TrainingError(
            f"the loss is {m['loss']} (gradient norm {m['grad_norm']}) at step {step} "
            f"(checked every {window} steps); the last good checkpoint is "
            f"{'step ' + str(good) if good is not None else 'none'} and was kept. Lower "
            "optimizer.learning_rate or set optimizer.clip_grad_norm, then rerun to resume"
        )
