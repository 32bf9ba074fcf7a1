"""Refresh notebooks/stored/slurm_pool.json: notebook 12 re-executed against a private
one-node Slurm (tests/slurm_cluster.py), its Slurm cell told to store what it saw.
Needs root and Slurm (scripts/install_cluster.sh). Run from the checkout's root."""

import os
import pathlib
import shutil
import subprocess
import sys

ROOT = pathlib.Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from tests.slurm_cluster import LocalSlurm, missing  # noqa: E402

if __name__ == "__main__":
    if reason := missing():
        sys.exit(reason)
    folder = ROOT / ".tmp" / "nbslurm"
    try:
        with LocalSlurm(folder):
            subprocess.run(
                ["make", "notebooks", "NOTEBOOKS=notebooks/12_torchrun_and_slurm.ipynb"],
                cwd=ROOT,
                env={**os.environ, "NBPAR_STORE_SLURM_RUN": "1"},
                check=True,
            )
    finally:
        shutil.rmtree(folder, ignore_errors=True)
