"""Stop a run cleanly when asked: SIGTERM (preemptible TPU VMs and SLURM send it
before taking the machine) or Ctrl-C.

The first signal only sets :attr:`Preemption.requested`; the training loop then
finishes its step, writes a checkpoint, prints the command that resumes, and
returns (exit status 0). A second Ctrl-C exits at once with status 130: a save
it interrupts leaves an incomplete folder, which the next start removes, so the
newest complete checkpoint is what the run resumes from.

The command line records these signals from its first line (:func:`install_at_start`,
before JAX is imported): a signal that arrives while the run starts (imports, data,
tokenizer, model, restore; minutes for a large model) is taken over by the training
loop's :class:`Preemption`, which then stops before the first step with nothing to
save (:class:`StoppedBeforeTraining`), and the process exits 0.
"""

from __future__ import annotations

import os
import shlex
import signal
import sys
import threading


class Preemption:
    """Context manager installing the handlers (main thread only; elsewhere a no-op)."""

    def __init__(self):
        self.requested: str | None = None
        self.training = False  # set by the loop at its first step
        self._previous: dict[int, object] = {}

    def install(self) -> Preemption:
        if self.requested is None and _AT_START is not None and _AT_START is not self:
            self.requested = _AT_START.requested  # a signal that came while starting
        if threading.current_thread() is threading.main_thread():
            for sig in (signal.SIGTERM, signal.SIGINT):
                self._previous[sig] = signal.signal(sig, self._handle)
        return self

    def restore(self) -> None:
        """Put back the handlers that were there before :meth:`install`."""
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)
        self._previous.clear()

    def __enter__(self) -> Preemption:
        return self.install()

    def __exit__(self, *exc) -> None:
        self.restore()

    def _handle(self, signum, frame) -> None:
        name = signal.Signals(signum).name
        if self.requested is not None and signum == signal.SIGINT:
            print(f"{name} again: stopping now", file=sys.stderr, flush=True)
            sys.stdout.flush()
            os._exit(130)
        self.requested = name
        what = (
            "finishing this step and saving a checkpoint, then stopping"
            if self.training
            else "stopping before the first step (nothing to save yet)"
        )
        print(f"{name}: {what} (Ctrl-C again to stop at once)", file=sys.stderr, flush=True)


class StoppedBeforeTraining(Exception):
    """A stop was asked for before the first training step: there is nothing to save."""

    def __init__(self, signal_name: str, phase: str):
        super().__init__(f"{signal_name} before the first step ({phase})")
        self.signal_name, self.phase = signal_name, phase


_AT_START: Preemption | None = None


def install_at_start() -> None:
    """Record SIGTERM and SIGINT from now on (the command line's first line), so that
    a stop asked for while the run starts is honoured instead of killing it."""
    global _AT_START
    if _AT_START is None:
        _AT_START = Preemption().install()


def release_at_start() -> None:
    """For commands that do not train: the default handlers back, and a signal that
    arrived meanwhile delivered again, so it acts as it always did."""
    global _AT_START
    if _AT_START is None:
        return
    start, _AT_START = _AT_START, None
    start.restore()
    if start.requested is not None:
        signal.raise_signal(signal.Signals[start.requested])


def resume_command() -> str:
    """The command line that resumes this run (the one that started it)."""
    if sys.argv and sys.argv[0].endswith(os.path.join("flaxformer_lite", "main.py")):
        return shlex.join([sys.executable, "-m", "flaxformer_lite.main", *sys.argv[1:]])
    return "train_and_evaluate(config, workdir) again with the same workdir"
