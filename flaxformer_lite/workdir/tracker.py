"""Weights & Biases, beside TensorBoard: ``train.wandb_project=NAME`` (the ``wandb``
extra: ``pip install flaxformer_lite[wandb]``).

Process 0 logs every measurement it writes to ``metrics.jsonl`` (``train/...``,
``val/...``), the run's config, and — when ``main evaluate`` scores a split — the
scores (``test/bleu``, ...) into the run's summary. The W&B run id is kept in
``<workdir>/wandb_run_id``, so a resumed run (or a later evaluation) continues the same
W&B run. W&B's own settings apply: ``WANDB_MODE=offline`` writes the run under
``<workdir>/wandb`` (a bucket's run: under ``~/.cache/flaxformer_lite/wandb``) without
a network (``wandb sync`` uploads it later), ``WANDB_ENTITY`` picks the team. Without
``train.wandb_project`` nothing is imported.
"""

from __future__ import annotations

import math
import uuid

from flaxformer_lite.workdir import location, storage

RUN_ID_FILE = "wandb_run_id"


class TrackerError(RuntimeError):
    """The tracker cannot start; the message names the fix."""


class WandbRun:
    """One W&B run of a workdir (opened, or resumed by the id the workdir keeps)."""

    def __init__(self, workdir, project: str, config: dict | None = None):
        try:
            import wandb
        except ImportError:
            raise TrackerError(
                f"config.train.wandb_project={project!r} needs Weights & Biases: pip install "
                "'flaxformer_lite[wandb]' (or wandb), or set train.wandb_project=''"
            ) from None
        workdir = location.path(workdir)
        id_file = workdir / RUN_ID_FILE
        run_id = id_file.read_text().strip() if id_file.exists() else uuid.uuid4().hex[:12]
        # W&B keeps its files in a local folder: a bucket's run keeps them in this
        # machine's cache (the run id, in the bucket, finds the run again)
        local = storage.cache_folder("wandb", run_id) if location.is_remote(workdir) else workdir
        self.run = wandb.init(
            project=project, id=run_id, resume="allow", dir=str(local), config=config,
            name=workdir.name,
        )  # fmt: skip
        if not id_file.exists():
            storage.write_atomic(id_file, run_id)

    def log(self, step: int, metrics: dict[str, float], prefix: str) -> None:
        values = {
            f"{prefix}/{k}": v
            for k, v in metrics.items()
            if isinstance(v, int | float) and math.isfinite(v)
        }
        self.run.log(values, step=step)

    def summary(self, values: dict[str, float]) -> None:
        self.run.summary.update(values)

    def close(self) -> None:
        self.run.finish()
