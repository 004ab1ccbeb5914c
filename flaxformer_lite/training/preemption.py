"""Stop a run cleanly when asked: SIGTERM (preemptible TPU VMs and SLURM send it
before taking the machine) or Ctrl-C.

The first signal only sets :attr:`Preemption.requested`; the training loop then
finishes its step, writes a checkpoint, prints the command that resumes, and
returns (exit status 0). A second Ctrl-C exits at once with status 130: a save
it interrupts leaves an incomplete folder, which the next start removes, so the
newest complete checkpoint is what the run resumes from.
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
        self._previous: dict[int, object] = {}

    def install(self) -> Preemption:
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
        print(
            f"{name}: finishing this step and saving a checkpoint, then stopping "
            "(Ctrl-C again to stop at once)",
            file=sys.stderr,
            flush=True,
        )


def resume_command() -> str:
    """The command line that resumes this run (the one that started it)."""
    if sys.argv and sys.argv[0].endswith(os.path.join("flaxformer_lite", "main.py")):
        return shlex.join([sys.executable, "-m", "flaxformer_lite.main", *sys.argv[1:]])
    return "train_and_evaluate(config, workdir) again with the same workdir"
