#!/bin/sh
# Install MPI for nbpar.Pool(n, launcher="mpi"): OpenMPI (Debian packages
# openmpi-bin libopenmpi-dev) and mpi4py into the environment of the given
# python. Idempotent: does nothing when mpiexec and mpi4py are both present.
set -eu
PY=${1:-python3}
if command -v mpiexec >/dev/null 2>&1 && "$PY" -c "import mpi4py" 2>/dev/null; then
    echo "MPI already installed: $(mpiexec --version 2>/dev/null | head -n 1), mpi4py $("$PY" -c 'import mpi4py; print(mpi4py.__version__)')"
    exit 0
fi
if ! command -v mpiexec >/dev/null 2>&1 || ! command -v mpicc >/dev/null 2>&1; then
    SUDO=""
    [ "$(id -u)" -eq 0 ] || SUDO="sudo"
    $SUDO apt-get install -y openmpi-bin libopenmpi-dev || {
        $SUDO apt-get update && $SUDO apt-get install -y openmpi-bin libopenmpi-dev; }
fi
"$PY" -m pip install -q mpi4py
"$PY" -c "import mpi4py; print('mpi4py', mpi4py.__version__)"
