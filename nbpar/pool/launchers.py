"""How a Pool starts its engines through ipyparallel's launchers (local, mpi, slurm, ssh...).

Two jobs, both before anything runs: check that the launcher can work on this
machine (its command is on PATH, mpi4py is importable), so a Slurm launcher
outside Slurm fails in one clear line instead of after a start timeout; then
configure the Cluster: nbpar's engine command, environment, and the few mpiexec
settings a notebook pool needs (Open MPI refuses root without two variables).
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from importlib.util import find_spec

from nbpar.pool import slurm
from nbpar.pool.engine import DETACHED

#: Command each launcher needs on PATH, and how to get it.
LAUNCHER_NEEDS = {
    "mpi": (
        "mpiexec",
        "install MPI (e.g. `apt-get install openmpi-bin libopenmpi-dev`, "
        "or run scripts/install_mpi.sh) and `pip install mpi4py`",
    ),
    "slurm": (
        "sbatch",
        "run the notebook on a node of a Slurm cluster, or start "
        "`ipcluster` from a batch script and attach with nbpar.Pool.connect()",
    ),
    "pbs": ("qsub", "run on a node of a PBS cluster"),
    "sge": ("qsub", "run on a node of an SGE cluster"),
    "lsf": ("bsub", "run on a node of an LSF cluster"),
    "htcondor": ("condor_submit", "run on an HTCondor submit node"),
    "ssh": ("ssh", "install an ssh client (e.g. `apt-get install openssh-client`)"),
    "sshproxy": ("ssh", "install an ssh client (e.g. `apt-get install openssh-client`)"),
}
#: Set for mpiexec when running as root: Open MPI refuses to start otherwise.
OMPI_ROOT_ENV = {"OMPI_ALLOW_RUN_AS_ROOT": "1", "OMPI_ALLOW_RUN_AS_ROOT_CONFIRM": "1"}


def engine_cmd() -> list[str]:
    """nbpar's engine: ipengine that imports torch while it registers."""
    return [sys.executable, "-m", "nbpar.pool.engine"]


def check_launcher(launcher) -> None:
    """Raise ValueError naming the fix if ``launcher`` cannot start engines here."""
    if not isinstance(launcher, str):
        raise ValueError(
            f"launcher must be a name like 'local', 'mpi', 'slurm' or 'ssh', got {launcher!r}"
        )
    if launcher.lower() == "local":  # ipyparallel's own: nothing to look up (or import)
        return
    from ipyparallel.cluster.launcher import find_launcher_class

    try:
        find_launcher_class(launcher, "engine")
    except KeyError:
        from importlib.metadata import entry_points

        known = sorted(e.name for e in entry_points(group="ipyparallel.engine_launchers"))
        raise ValueError(
            f"unknown launcher {launcher!r}; ipyparallel knows: {', '.join(known)}"
        ) from None
    need = LAUNCHER_NEEDS.get(launcher.lower())
    if need and shutil.which(need[0]) is None:
        raise ValueError(
            f"launcher={launcher!r} needs `{need[0]}` on PATH and this machine has none: {need[1]}"
        )
    if launcher.lower() == "mpi" and find_spec("mpi4py") is None:
        raise ValueError(
            f"launcher='mpi' needs mpi4py in the engines' Python "
            f"({sys.executable}): run `{sys.executable} -m pip install mpi4py`"
        )


def _is_open_mpi(mpiexec: str) -> bool:
    try:
        out = subprocess.run(
            [mpiexec, "--version"], capture_output=True, text=True, timeout=10
        ).stdout
    except (OSError, subprocess.SubprocessError):
        return False
    return "Open MPI" in out or "OpenRTE" in out


def configure(
    cluster, launcher: str, n: int, env: dict, backend: str = "gloo", slurm_options=None
) -> None:
    """Point ``cluster``'s engine launcher at nbpar's engine and fit mpiexec to a pool.

    ``env`` goes to every engine process. For ``launcher="mpi"``: as root, the
    Open MPI root variables; ``--bind-to none`` leaves thread placement to torch
    and more engines than cores get ``--oversubscribe`` (a CPU pool shares cores
    on purpose). mpiexec settings in the user's ``config=`` win. Engine ids are
    the MPI ranks, so engine order is rank order. For ``launcher="slurm"``: the
    engines' batch script that `nbpar.pool.slurm.batch_template` makes from
    ``slurm_options`` (one GPU per engine task on ``backend="nccl"``), unless
    ``config=`` brings a script of its own.
    """
    cfg = cluster.config
    cfg.EngineLauncher.engine_cmd = engine_cmd()
    # a local controller exits with the kernel that started it
    cfg.LocalControllerLauncher.controller_cmd = [sys.executable, "-m", "nbpar.pool.controller"]
    env = dict(env)
    if launcher.lower() == "mpi":
        if os.geteuid() == 0:
            env = {**OMPI_ROOT_ENV, **env}
        user_set = any(
            "mpi_args" in cfg[k] for k in ("MPILauncher", "MPIEngineSetLauncher") if k in cfg
        )
        mpiexec = (
            cfg.MPILauncher.get("mpi_cmd", ["mpiexec"])[0] if "MPILauncher" in cfg else "mpiexec"
        )
        if not user_set and _is_open_mpi(shutil.which(mpiexec) or mpiexec):
            args = ["--bind-to", "none"]
            if n > (os.cpu_count() or 1):
                args.append("--oversubscribe")
            cfg.MPIEngineSetLauncher.mpi_args = args
    if launcher.lower() in ("ssh", "sshproxy"):
        # its remote shim starts the engine in a session of its own and exits at once
        env = {DETACHED: "1", **env}
    if launcher.lower() == "slurm":
        mine = cfg.SlurmEngineSetLauncher if "SlurmEngineSetLauncher" in cfg else {}
        if "batch_file_name" not in mine:  # ipyparallel writes it where the notebook is
            cfg.SlurmEngineSetLauncher.batch_file_name = os.path.join(
                cluster.profile_dir, "log", f"slurm-engines-{cluster.cluster_id}.sbatch"
            )
        if not slurm.own_template(cfg):
            options = slurm.check_options(slurm_options, launcher, cfg)
            cfg.SlurmEngineSetLauncher.batch_template = slurm.batch_template(options, backend)
    if env:
        cfg.EngineLauncher.environment = {**cfg.EngineLauncher.get("environment", {}), **env}
