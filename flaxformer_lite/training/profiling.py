"""``train.profile=START:STEPS``: a ``jax.profiler`` trace of a few training steps.

The trace goes to ``<workdir>/profile`` (``plugins/profile/<run>/*.xplane.pb``), each
step under a ``train`` step annotation, so TensorBoard's profile plugin (or XProf)
shows the steps apart; Perfetto opens the ``*.trace.json.gz`` beside it. The steps
traced are waited for before the trace stops, so their device work is in it. Process
0 traces (its devices are where a step's time goes like everyone else's).
"""

from __future__ import annotations

import contextlib
import os
import shutil
import tempfile

import jax

from flaxformer_lite.config.profile import profile_steps
from flaxformer_lite.workdir import location, storage


class StepProfile:
    """Starts the trace before step START, stops it after step START + STEPS - 1."""

    def __init__(self, spec: str, folder: location.Path, active: bool = True):
        span = profile_steps(spec) if active else None
        self.first, self.last = (span[0], span[0] + span[1] - 1) if span else (0, -1)
        self.folder, self.tracing, self.staging = folder, False, None

    def step(self, step: int):
        """A context for one step: starts the trace at the first step traced, and
        annotates every traced step."""
        if step == self.first:
            if location.is_remote(self.folder):  # the profiler writes local files only
                self.staging = tempfile.mkdtemp(prefix="flaxformer-profile-")
                jax.profiler.start_trace(self.staging)
            else:
                os.makedirs(location.local(self.folder), exist_ok=True)
                jax.profiler.start_trace(location.local(self.folder))
            self.tracing = True
        if not self.tracing:
            return contextlib.nullcontext()
        return jax.profiler.StepTraceAnnotation("train", step_num=step)

    def done(self, step: int, state) -> None:
        """After a step: at the last step traced, wait for it and write the trace."""
        if self.tracing and step == self.last:
            jax.block_until_ready(state)
            self.close()
            print(
                f"profile: steps {self.first}-{self.last} traced into {self.folder} "
                f"(tensorboard --logdir {self.folder}, Profile tab)"
            )

    def close(self) -> None:
        """Stops a trace still running (training ended before its last step)."""
        if self.tracing:
            self.tracing = False
            jax.profiler.stop_trace()
            if self.staging is not None:  # a bucket's run: the trace goes there now
                storage.copy_tree(location.path(self.staging), self.folder)
                shutil.rmtree(self.staging, ignore_errors=True)
                self.staging = None
