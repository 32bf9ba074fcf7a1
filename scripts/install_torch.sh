#!/bin/sh
# Install torch into the environment of the given python, unless it already has one.
# GPU machines (nvidia-smi present) get PyPI's default (CUDA) build; CPU-only
# machines get the CPU build: pip takes it from a local wheel directory when
# PIP_FIND_LINKS provides one, or from TORCH_INDEX_URL (PyTorch's CPU index) if set.
set -eu
PY=${1:-python3}
if "$PY" -c "import torch" 2>/dev/null; then
    echo "torch already installed: $("$PY" -c 'import torch; print(torch.__version__)')"
    exit 0
fi
if command -v nvidia-smi >/dev/null 2>&1; then
    exec "$PY" -m pip install -q "torch==${TORCH_VERSION:-2.13.0}"
fi
if [ -n "${TORCH_INDEX_URL:-}" ]; then
    exec "$PY" -m pip install -q --index-url "$TORCH_INDEX_URL" "torch==${TORCH_VERSION:-2.13.0}"
fi
exec "$PY" -m pip install -q "torch==${TORCH_VERSION:-2.13.0}"
