#!/usr/bin/env bash
# Create .venv and install asyncrl with the extras the first argument names (default: test; "none": the
# runtime alone, which the demo needs). torch comes first and on its own, so pip takes the CPU wheel
# (==2.13.0, or whatever torch the venv already has) instead of pulling a multi-GB CUDA build as a
# dependency of transformers.
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}
if [ ! -x .venv/bin/python ]; then
  "$PYTHON" -m venv .venv
fi
. .venv/bin/activate
python -m pip install --quiet --upgrade pip 2>&1 | grep -v "^WARNING: Location" || true
if ! python -c "import torch" 2>/dev/null; then
  echo "setup: installing torch (CPU) ..."
  python -m pip install --quiet "torch==${ASYNCRL_TORCH_VERSION:-2.13.0}" 2>&1 | grep -v "^WARNING: Location" || true
fi
EXTRAS=${1:-test}
target=$([ "$EXTRAS" = none ] && echo "." || echo ".[$EXTRAS]")
echo "setup: installing asyncrl ($target) and its dependencies ..."
python -m pip install --quiet -e "$target" 2>&1 | grep -v "^WARNING: Location" || true
python -c "import asyncrl, torch, transformers, reasoning_gym; print(f'setup: ok (torch {torch.__version__}, transformers {transformers.__version__})')"
