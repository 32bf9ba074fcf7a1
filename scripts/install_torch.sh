#!/bin/sh
# Install torch into the environment of the given python, unless it already has one.
# GPU machines (an NVIDIA device or nvidia-smi present) get PyPI's default (CUDA) build;
# CPU-only machines get the CPU build only where one is named: from a local wheel
# directory when PIP_FIND_LINKS provides one, or from TORCH_INDEX_URL (PyTorch's CPU
# index, https://download.pytorch.org/whl/cpu) if set; with neither, pip installs PyPI's
# default, which on Linux x86-64 is the CUDA build (several GB; it runs on the CPU too).
# On a GPU machine a torch without CUDA (already there, or a CPU wheel pip found) is an
# error: every run would silently train on the CPU. NBPAR_ALLOW_CPU_TORCH=1 accepts it.
# NBPAR_NVIDIA_DEV names the device file looked for (default /dev/nvidia0).
set -eu
PY=${1:-python3}
TORCH="torch==${TORCH_VERSION:-2.13.0}"

has_gpu() {
    [ -e "${NBPAR_NVIDIA_DEV:-/dev/nvidia0}" ] || command -v nvidia-smi >/dev/null 2>&1
}

check_cuda() {
    has_gpu || return 0
    cuda=$("$PY" -c 'import torch; print(torch.version.cuda or "")')
    [ -n "$cuda" ] && return 0
    version=$("$PY" -c 'import torch; print(torch.__version__)')
    cat >&2 <<EOF
************************************************************************
nbpar: this machine has an NVIDIA GPU, but torch $version has no CUDA:
every Pool would run on the CPU with gloo.
Fix: install PyPI's CUDA build, not a CPU wheel from PIP_FIND_LINKS:
    env -u PIP_FIND_LINKS "$PY" -m pip install --force-reinstall \
        --index-url https://pypi.org/simple "$TORCH"
or keep the CPU build on purpose with NBPAR_ALLOW_CPU_TORCH=1.
************************************************************************
EOF
    [ "${NBPAR_ALLOW_CPU_TORCH:-0}" = 1 ] || exit 1
}

if "$PY" -c "import torch" 2>/dev/null; then
    echo "torch already installed: $("$PY" -c 'import torch; print(torch.__version__)')"
    check_cuda
    exit 0
fi
if has_gpu; then
    "$PY" -m pip install -q "$TORCH"
elif [ -n "${TORCH_INDEX_URL:-}" ]; then
    "$PY" -m pip install -q --index-url "$TORCH_INDEX_URL" "$TORCH"
else
    "$PY" -m pip install -q "$TORCH"
fi
check_cuda
