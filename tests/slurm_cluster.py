"""A SLURM cluster of one node on this machine, for the tests (Debian's slurm-wlm and
munge, as `make test` installs them).

``start(folder)`` writes a ``slurm.conf`` for ``localhost`` in ``folder`` (its own
ports, state and spool folders, a munge socket and key of its own, process tracking
by /proc, no cgroups: nothing outside the folder is touched; a credential lifetime of
5 s and a scheduler that looks every second, so that a requeued task, held back for the
credential lifetime + 1 s, starts again within seconds on its own: starting it sooner by
hand races slurmd's revocation of its old credential, which counts whole seconds, and
SLURM then kills it as it starts), starts munged,
slurmctld and slurmd, and waits for the node to be idle; the returned cluster's
``env`` points SLURM's commands at it (``SLURM_CONF``) and ``stop()`` ends it.
"""

from __future__ import annotations

import dataclasses
import os
import shutil
import socket
import subprocess
import time
from pathlib import Path

DAEMONS = ("munged", "slurmctld", "slurmd", "sbatch", "squeue", "srun", "scontrol")


def missing() -> str | None:
    """Why a cluster cannot start here (None: it can)."""
    found = [d for d in DAEMONS if shutil.which(d)]
    absent = sorted(set(DAEMONS) - set(found))
    if absent:
        return f"SLURM is not installed ({', '.join(absent)} missing): make test installs it"
    if os.geteuid() != 0:
        return "the test cluster runs its daemons as root"
    return None


def _free_ports(n: int) -> list[int]:
    sockets = [socket.socket() for _ in range(n)]
    for s in sockets:
        s.bind(("127.0.0.1", 0))
    ports = [s.getsockname()[1] for s in sockets]
    for s in sockets:
        s.close()
    return ports


@dataclasses.dataclass
class Cluster:
    folder: Path
    env: dict[str, str]
    pids: list[Path]

    def run(self, *command: str, check: bool = True) -> subprocess.CompletedProcess:
        out = subprocess.run(command, env=self.env, capture_output=True, text=True)
        if check and out.returncode:
            raise RuntimeError(f"{' '.join(command)}: {out.stderr.strip()}")
        return out

    def stop(self) -> None:
        self.run("scancel", "--user=root", check=False)
        for pid_file in reversed(self.pids):
            try:
                os.kill(int(pid_file.read_text().strip()), 15)
            except (OSError, ValueError):
                pass
        time.sleep(0.5)


CONF = """ClusterName=flaxtest
SlurmctldHost=localhost
SlurmctldPort={ctld}
SlurmdPort={slurmd}
AuthType=auth/munge
AuthInfo=socket={d}/munge.sock,cred_expire=5
CryptoType=crypto/munge
MpiDefault=none
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
ReturnToService=2
SlurmctldPidFile={d}/slurmctld.pid
SlurmdPidFile={d}/slurmd.pid
SlurmdSpoolDir={d}/spool
StateSaveLocation={d}/state
SlurmUser=root
SlurmdUser=root
SchedulerType=sched/backfill
SchedulerParameters=bf_interval=1,sched_interval=1
SelectType=select/cons_tres
SelectTypeParameters=CR_Core
JobCompType=jobcomp/none
AccountingStorageType=accounting_storage/none
SlurmctldLogFile={d}/slurmctld.log
SlurmdLogFile={d}/slurmd.log
MinJobAge=600
NodeName=localhost CPUs={cpus} State=UNKNOWN
PartitionName=debug Nodes=localhost Default=YES MaxTime=INFINITE State=UP
"""


def start(folder: Path, timeout: float = 60) -> Cluster:
    folder = Path(folder)
    for sub in ("state", "spool"):
        (folder / sub).mkdir(parents=True, exist_ok=True)
    folder.chmod(0o700)  # munged refuses a socket folder others may write
    key = folder / "munge.key"
    key.write_bytes(os.urandom(1024))
    key.chmod(0o400)
    ctld, slurmd = _free_ports(2)
    conf = folder / "slurm.conf"
    conf.write_text(CONF.format(d=folder, ctld=ctld, slurmd=slurmd, cpus=os.cpu_count() or 2))
    env = dict(os.environ, SLURM_CONF=str(conf))
    cluster = Cluster(folder, env, [folder / "munged.pid", folder / "slurmctld.pid",
                                    folder / "slurmd.pid"])  # fmt: skip
    cluster.run("munged", "--force", f"--socket={folder}/munge.sock", f"--key-file={key}",
                f"--pid-file={folder}/munged.pid", f"--log-file={folder}/munged.log",
                f"--seed-file={folder}/munged.seed")  # fmt: skip
    cluster.run("slurmctld", "-i", "-f", str(conf))
    cluster.run("slurmd", "-f", str(conf), "-N", "localhost")
    deadline = time.monotonic() + timeout
    while "idle" not in cluster.run("sinfo", "-h", "-o", "%t", check=False).stdout:
        if time.monotonic() > deadline:
            cluster.stop()
            raise RuntimeError(f"the test cluster's node did not come up: see {folder}/*.log")
        time.sleep(0.3)
    return cluster
