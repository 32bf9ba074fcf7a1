"""A private one-node Slurm for the tests: its own munged, slurmctld and slurmd.

Everything lives under one folder the caller owns (config, state, spool, logs, the
munge key and socket); the daemons listen on free ports and are stopped by their
process ids, so a system Slurm, if there is one, is never touched. ``SLURM_CONF``
points sbatch, squeue and srun at it while it runs. Needs root (slurmd starts jobs
as their users) and Debian's ``slurm-wlm`` and ``munge`` (`scripts/install_cluster.sh`).
"""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import time

from tests.distributed import free_port

#: what the machine needs, with the fix; None when it has it
DAEMONS = ("munged", "slurmctld", "slurmd", "sbatch", "squeue", "scancel", "sinfo")
#: CPUs the node says it has: more engines than cores, as a CPU pool runs them
CPUS = 8


def missing() -> str | None:
    """Why a private Slurm cannot start here (None: it can)."""
    if os.geteuid() != 0:
        return "a private Slurm needs root (slurmd runs jobs as their users)"
    absent = [d for d in DAEMONS if shutil.which(d) is None]
    if absent:
        return (
            f"Slurm is not installed ({', '.join(absent)} missing): "
            f"run `sh scripts/install_cluster.sh` (Debian slurm-wlm, munge)"
        )
    return None


class LocalSlurm:
    """``with LocalSlurm(folder) as slurm:`` a one-node cluster, partition ``nbpar``."""

    partition = "nbpar"

    def __init__(self, folder):
        self.dir = str(folder)
        self.host = socket.gethostname().split(".")[0]  # slurmd names its node so
        self.conf = os.path.join(self.dir, "slurm.conf")
        self.pids: dict[str, int] = {}
        self._env = None

    def _path(self, *parts) -> str:
        return os.path.join(self.dir, *parts)

    def start(self, timeout: float = 30) -> LocalSlurm:
        for sub in ("state", "spool", "log", "key", "sock"):
            os.makedirs(self._path(sub), exist_ok=True)
        os.chmod(self._path("key"), 0o700)
        os.chmod(self._path("sock"), 0o755)
        key = self._path("key", "munge.key")
        with open(key, "wb") as f:
            f.write(os.urandom(1024))
        os.chmod(key, 0o400)
        sock = self._path("sock", "munge.socket")
        # --force: the test folder's parents are not world-searchable, which munged
        # checks for a socket other users would need; only root uses this one
        self._daemon(
            "munged",
            [
                "munged",
                "--force",
                f"--socket={sock}",
                f"--key-file={key}",
                f"--pid-file={self._path('sock', 'munged.pid')}",
                f"--log-file={self._path('log', 'munged.log')}",
                f"--seed-file={self._path('key', 'seed')}",
            ],
            self._path("sock", "munged.pid"),
        )
        with open(self.conf, "w") as f:
            f.write(self._config(sock))
        self._env = os.environ.get("SLURM_CONF")
        os.environ["SLURM_CONF"] = self.conf
        self._daemon("slurmctld", ["slurmctld", "-f", self.conf, "-i"], self._path("ctld.pid"))
        self._daemon("slurmd", ["slurmd", "-f", self.conf], self._path("slurmd.pid"))
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.sinfo().startswith("idle"):
                return self
            time.sleep(0.1)
        raise RuntimeError(
            f"the private Slurm's node is not idle after {timeout:g} s: "
            f"{self.sinfo()!r}; see {self._path('log')}"
        )

    def _config(self, sock: str) -> str:
        mem = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") // 2**20 // 2
        return "\n".join(
            [
                "ClusterName=nbpartest",
                f"SlurmctldHost={self.host}(127.0.0.1)",
                f"SlurmctldPort={free_port()}",
                f"SlurmdPort={free_port()}",
                "AuthType=auth/munge",
                "CredType=cred/munge",
                f"AuthInfo=socket={sock}",
                "SlurmUser=root",
                "SlurmdUser=root",
                f"StateSaveLocation={self._path('state')}",
                f"SlurmdSpoolDir={self._path('spool')}",
                f"SlurmctldPidFile={self._path('ctld.pid')}",
                f"SlurmdPidFile={self._path('slurmd.pid')}",
                f"SlurmctldLogFile={self._path('log', 'slurmctld.log')}",
                f"SlurmdLogFile={self._path('log', 'slurmd.log')}",
                "SelectType=select/cons_tres",
                "SelectTypeParameters=CR_Core",
                "ProctrackType=proctrack/linuxproc",
                "TaskPlugin=task/none",
                "JobAcctGatherType=jobacct_gather/none",
                "AccountingStorageType=accounting_storage/none",
                "MpiDefault=none",
                "ReturnToService=2",
                # the node's CPUs as written here, not as counted: 8 engines on 2 cores
                "SlurmdParameters=config_overrides",
                "EnforcePartLimits=ALL",  # over a partition's limits: refused, not queued
                "MinJobAge=2",  # a finished job leaves squeue 2 s after it ends
                "KillWait=2",
                "InactiveLimit=0",
                f"NodeName={self.host} NodeAddr=127.0.0.1 CPUs={CPUS} RealMemory={mem} "
                f"State=UNKNOWN",
                f"PartitionName={self.partition} Nodes={self.host} Default=YES "
                f"MaxTime=60 State=UP OverSubscribe=FORCE:4",
                "",
            ]
        )

    def _daemon(self, name: str, cmd: list[str], pid_file: str) -> None:
        """Start a daemon that forks, and keep its process id from its pid file."""
        res = subprocess.run(cmd, capture_output=True, text=True, timeout=30)
        if res.returncode != 0:
            raise RuntimeError(f"{name} did not start: {res.stderr.strip() or res.stdout}")
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            try:
                with open(pid_file) as f:
                    self.pids[name] = int(f.read().split()[0])
                return
            except (OSError, ValueError, IndexError):
                time.sleep(0.05)
        raise RuntimeError(f"{name} wrote no pid file at {pid_file}")

    def sinfo(self) -> str:
        res = subprocess.run(["sinfo", "-h", "-o", "%t"], capture_output=True, text=True)
        return res.stdout.strip()

    def jobs(self) -> list[str]:
        """squeue's lines for every job not yet gone: 'id state name'."""
        res = subprocess.run(
            ["squeue", "-h", "-o", "%i %T %j"], capture_output=True, text=True, timeout=10
        )
        return [line for line in res.stdout.splitlines() if line.strip()]

    def wait_no_jobs(self, timeout: float = 30, job: str | None = None) -> list[str]:
        """Wait until squeue lists no job (or not ``job``); what it lists at the deadline."""
        deadline = time.monotonic() + timeout

        def left():
            return [j for j in self.jobs() if job is None or j.split()[0] == job]

        while (still := left()) and time.monotonic() < deadline:
            time.sleep(0.2)
        return still

    def stop(self) -> None:
        """Cancel every job, stop the daemons by pid, drop SLURM_CONF; idempotent."""
        if self.pids.get("slurmctld"):
            subprocess.run(["scancel", "--full", "--user=root"], capture_output=True, timeout=10)
            self.wait_no_jobs(15)  # the job steps end before the daemon that runs them
        for name in ("slurmd", "slurmctld", "munged"):
            pid = self.pids.pop(name, None)
            if pid is None:
                continue
            try:
                os.kill(pid, signal.SIGTERM)
            except ProcessLookupError:
                continue
            deadline = time.monotonic() + 10
            while time.monotonic() < deadline and _alive(pid):
                time.sleep(0.05)
            if _alive(pid):
                os.kill(pid, signal.SIGKILL)
        if self._env is None:
            os.environ.pop("SLURM_CONF", None)
        else:
            os.environ["SLURM_CONF"] = self._env

    def __enter__(self):
        return self.start()

    def __exit__(self, *exc):
        self.stop()


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    try:  # a zombie of ours is not alive
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(") ", 1)[1][0] != "Z"
    except (OSError, IndexError):
        return False
