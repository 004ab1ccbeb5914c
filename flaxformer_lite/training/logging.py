"""Where measurements go: TensorBoard event files (tensorboardX, no TensorFlow),
a JSON-lines file, and a one-line console progress bar."""

from __future__ import annotations

import json
import math
import sys
import threading
import time

from flaxformer_lite.workdir import location, storage


def _efficiency(metrics: dict[str, float]) -> str:
    """`` 31.2 TFLOP/s 41% MFU 30.1/33.0 GiB``: what the logged window computed, its
    share of the devices' datasheet peak, and the device memory in use / at peak (the
    last two where the device reports them)."""
    out = f" {metrics['tflops_per_sec']:.3g} TFLOP/s" if "tflops_per_sec" in metrics else ""
    if "mfu" in metrics:
        out += f" {metrics['mfu']:.0%} MFU"
    if "memory_gib" in metrics and "peak_memory_gib" in metrics:
        out += f" {metrics['memory_gib']:.1f}/{metrics['peak_memory_gib']:.1f} GiB"
    return out


def _format_duration(seconds: float) -> str:
    seconds = int(max(seconds, 0))
    h, rem = divmod(seconds, 3600)
    m, s = divmod(rem, 60)
    return f"{h}:{m:02d}:{s:02d}" if h else f"{m}:{s:02d}"


_IMPORT_LOCK = threading.Lock()


def summary_writer_class():
    """tensorboardX's SummaryWriter, imported without PyTorch: its writer module imports
    torch, where installed, only to accept torch tensors (this logger passes floats),
    and that import costs a training process 4-5 s of start-up. Where torch is already
    loaded (or tensorboardX is), the plain import."""
    with _IMPORT_LOCK:  # a sweep's threads: one hides torch and imports at a time
        if "tensorboardX" not in sys.modules and "torch" not in sys.modules:
            sys.modules["torch"] = None  # ``import torch`` raises ImportError meanwhile
            try:
                import tensorboardX  # noqa: F401
            finally:
                if sys.modules.get("torch", 0) is None:
                    del sys.modules["torch"]
    from tensorboardX import SummaryWriter, record_writer

    for scheme in location.REMOTE:  # event files in a bucket: through our layer
        record_writer.register_writer_factory(scheme, _BucketEventFiles())
    return SummaryWriter


class _BucketEventFiles:
    """tensorboardX's writer factory for a bucket's event files: each an
    :class:`~flaxformer_lite.workdir.storage.AppendFile` (uploaded whole, beside the
    steps). tensorboardX's own GCS writer uploads in the step and again when collected,
    after its close."""

    def open(self, path: str) -> storage.AppendFile:
        return storage.AppendFile(location.path(path), binary=True)

    def directory_check(self, path: str) -> None:
        """A bucket needs no folder made first."""


class MetricsLogger:
    """Writes measurements to ``metrics.jsonl`` and TensorBoard event files in the
    workdir (and to ``tracker``, a W&B run, where given), and a progress line to the
    console (only where ``enabled``: process 0)."""

    def __init__(
        self,
        workdir,
        total_steps: int,
        enabled: bool = True,
        deadline: float = math.inf,
        tracker=None,
    ):
        """``deadline``: a ``time.perf_counter()`` time at which training stops anyway
        (``train.max_minutes``); the ETA is then the nearer of the two ends."""
        SummaryWriter = summary_writer_class()
        self.workdir = location.path(workdir)
        self.total_steps = total_steps
        self.deadline = deadline
        self.enabled = enabled
        self.jsonl = storage.AppendFile(self.workdir / "metrics.jsonl") if enabled else None
        self.tb = SummaryWriter(str(self.workdir / "tensorboard")) if enabled else None
        self.start_time = time.perf_counter()
        self.start_step: int | None = None
        self.tty = sys.stdout.isatty()
        self.examples_file = None
        self.tracker = tracker  # a workdir.tracker.WandbRun: the same records go there

    def write(self, step: int, metrics: dict[str, float], prefix: str = "train") -> None:
        if not self.enabled:
            return
        record = {"step": step, "split": prefix, "time": time.time(), **metrics}
        self.jsonl.write(json.dumps(record) + "\n")
        self.jsonl.flush()
        for key, value in metrics.items():
            if isinstance(value, int | float) and math.isfinite(value):
                self.tb.add_scalar(f"{prefix}/{key}", value, step)
        self.tb.flush()
        if self.tracker is not None:
            self.tracker.log(step, metrics, prefix)

    def examples(self, step: int, example_ids) -> None:
        """One ``examples.jsonl`` line: the step and the ids of the examples it trained
        on (``train.log_examples``; ``epoch * 2**32 + index``, in row order)."""
        if not self.enabled:
            return
        if self.examples_file is None:
            self.examples_file = storage.AppendFile(self.workdir / "examples.jsonl")
        ids = [int(i) for i in example_ids.ravel() if i >= 0]
        self.examples_file.write(json.dumps({"step": step, "ids": ids}) + "\n")
        self.examples_file.flush()

    def settle(self) -> None:
        """Wait until the logs written so far are stored (a bucket's upload them beside
        the steps): before a checkpoint, so that a run's logs reach as far as it."""
        for log in (self.jsonl, self.examples_file):
            if log is not None:
                log.wait()

    def progress(self, step: int, metrics: dict[str, float], outlook: str = "") -> None:
        """``step 120/3000 [###.......] loss 4.31 acc 0.31 12.3k tok/s ETA 9:41``, then
        ``outlook`` (where a time budget will stop the run)."""
        if self.start_step is None:
            self.start_step, self.start_time = step, time.perf_counter()
        done = step - self.start_step
        elapsed = time.perf_counter() - self.start_time
        eta = elapsed / done * (self.total_steps - step) if done > 0 else float("nan")
        if math.isfinite(self.deadline):
            left = max(self.deadline - time.perf_counter(), 0.0)
            eta = left if math.isnan(eta) else min(eta, left)
        width = 20
        filled = int(width * step / max(self.total_steps, 1))
        bar = "#" * filled + "." * (width - filled)
        line = (
            f"step {step}/{self.total_steps} [{bar}] loss {metrics['loss']:.3f} "
            f"acc {metrics['accuracy']:.3f} lr {metrics['learning_rate']:.2e} "
            f"{metrics.get('tokens_per_sec', 0.0) / 1000:.1f}k tok/s{_efficiency(metrics)} "
            f"ETA {_format_duration(eta) if math.isfinite(eta) else '?'}{outlook}"
        )
        print(("\r" + line) if self.tty else line, end="" if self.tty else "\n", flush=True)

    def message(self, text: str) -> None:
        print(("\n" if self.tty else "") + text, flush=True)

    def close(self) -> None:
        if self.examples_file:
            self.examples_file.close()
        if self.jsonl:
            self.jsonl.close()
        if self.tb:
            self.tb.close()
        if self.tracker is not None:
            self.tracker.close()
