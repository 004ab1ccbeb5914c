"""``config.launch``: where a sweep runs its runs, and what a SLURM job of one asks for.

  python -m flaxformer_lite.main sweep --config=configs/ding_mini.py --workdir=runs/s \\
      --sweep=model.num_heads=1,4 --seeds=3 --config.launch.launcher=slurm \\
      --config.launch.partition=gpu --config.launch.time=4:00:00 \\
      --config.launch.gpus_per_task=1 --config.launch.max_running=4

Local (the default) starts the runs as subprocesses, ``--parallel`` at a time. SLURM
submits them as one job array, each run an array task of ``nodes`` x
``tasks_per_node`` processes (more than one trains with ``--distributed``: JAX reads
SLURM's variables); :mod:`flaxformer_lite.sweep.slurm` writes the job script into the
sweep folder. A training run's own config never depends on these fields: a sweep does
not pass them on to its runs.
"""

from __future__ import annotations

import dataclasses
import re

from flaxformer_lite.config.fields import NON_NEGATIVE, POSITIVE, ConfigError, Rule, Section, option

LAUNCHERS = ("local", "slurm")
# SLURM's time forms: minutes, MM:SS, HH:MM:SS, D-HH, D-HH:MM, D-HH:MM:SS
TIME = re.compile(r"^(\d+-)?\d+(:\d{1,2}){0,2}$")
MEMORY = re.compile(r"^\d+[KMGT]?$")
SLURM_TIME = Rule(
    lambda v: v == "" or bool(TIME.match(v)), "is not a SLURM time (e.g. 90, 2:00:00, 1-12:00:00)"
)
SLURM_MEMORY = Rule(
    lambda v: v == "" or bool(MEMORY.match(v)), "is not a SLURM memory size (e.g. 16G, 4000M)"
)


@dataclasses.dataclass(frozen=True)
class LaunchConfig(Section):
    """``config.launch``: a sweep's launcher and its SLURM settings per run."""

    NAME = "launch"

    launcher: str = option(
        "local",
        "where a sweep runs its runs: local subprocesses, or "
        "slurm jobs (an array, one task per run)",
        choices=LAUNCHERS,
    )
    partition: str = option("", "slurm: the partition ('' = the cluster's default)")
    account: str = option("", "slurm: the account to charge ('' = yours by default)")
    qos: str = option("", "slurm: the quality of service ('' = the default)")
    time: str = option(
        "",
        "slurm: each run's time limit ('' = the partition's); the run "
        "saves before it and is requeued",
        rule=SLURM_TIME,
    )
    nodes: int = option(1, "slurm: nodes per run", rule=POSITIVE)
    tasks_per_node: int = option(
        1, "slurm: processes per node (several: --distributed)", rule=POSITIVE
    )
    gpus_per_task: int = option(
        0, "slurm: GPUs per process (0 = none asked for)", rule=NON_NEGATIVE
    )
    cpus_per_task: int = option(0, "slurm: CPUs per process (0 = the default)", rule=NON_NEGATIVE)
    mem: str = option("", "slurm: memory per node, e.g. 32G ('' = the default)", rule=SLURM_MEMORY)
    max_running: int = option(
        0, "slurm: runs at once (the array's %N; 0 = as many as fit)", rule=NON_NEGATIVE
    )
    signal_seconds: int = option(
        120,
        "slurm: SIGTERM this long before the time limit (the "
        "run saves a checkpoint and is requeued)",
        rule=POSITIVE,
    )
    extra: str = option(
        "", "slurm: more sbatch options, ';'-separated (e.g. '--constraint=a100;--exclusive')"
    )
    score: str = option(
        "job",
        "slurm: score each run in its job, or here once it is done (local)",
        choices=("job", "local"),
    )

    def check(self) -> None:
        for part in self.sbatch_extra():
            if not part.startswith("--") or "\n" in part:
                raise ConfigError(
                    f"config.launch.extra={self.extra!r}: {part!r} is not an sbatch option; "
                    "give options as --name=value, ';'-separated"
                )

    @property
    def processes(self) -> int:
        return self.nodes * self.tasks_per_node

    def sbatch_extra(self) -> list[str]:
        return [p.strip() for p in self.extra.split(";") if p.strip()]
