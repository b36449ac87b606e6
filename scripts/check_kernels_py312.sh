#!/usr/bin/env bash
# The kernel tests and CUDA/TPU lowering checks under Python 3.12 + jax 0.11 (the GPU image's versions), beside
# the main suite's Python 3.11 + jax 0.10, so the Pallas kernels do not drift between the two.
# pallas_kernels imports only jax, so this environment needs jax, numpy, scipy and pytest — no flax.
set -euo pipefail
cd "$(dirname "$0")/.."
if ! PYENV_VERSION=3.12.1 python -c "import sys; assert sys.version_info[:2] == (3, 12)" 2>/dev/null; then
    echo "check_kernels_py312: no Python 3.12 (pyenv 3.12.1) on this machine; skipped"
    exit 0
fi
export PYENV_VERSION=3.12.1
python -m pip install -q "jax>=0.11,<0.12" "numpy>=1.26" "scipy>=1.11" "pytest>=8"
# --noconftest: tests/conftest.py imports flax (not needed by the kernel tests); -p no:cacheprovider keeps the
# 3.11 cache untouched.
PYTHONPATH=. python -m pytest -q --noconftest -p no:cacheprovider tests/test_pallas_markov_sample.py \
    tests/test_pallas_ragged_attention.py
