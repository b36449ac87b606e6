#!/usr/bin/env bash
# The kernel tests and CUDA/TPU lowering checks under Python 3.12 + jax 0.11 (the GPU image's versions), beside
# the main suite's Python 3.11 + jax 0.10, so the Pallas kernels do not drift between the two.
# pallas_kernels imports only jax, so this environment needs jax, numpy, scipy and pytest — no flax.
#
# The interpreter is found by absolute path, so an active virtualenv (whose `python` is the venv's 3.11 whatever
# PYENV_VERSION says) does not hide it. Tried in order: $DSPARK_PY312 (must work if set), every
# `$(pyenv root)/versions/3.12*/bin/python3.12`, `~/.pyenv/versions/3.12*/bin/python3.12`, `python3.12` on PATH.
# No Python 3.12 is a FAILURE (exit 1): this leg never passes without running. DSPARK_ALLOW_NO_PY312=1 turns it
# into a loud skip for machines that knowingly lack 3.12.
set -euo pipefail
cd "$(dirname "$0")/.."

is_py312() {
    [ -n "$1" ] && [ -x "$1" ] && "$1" -c "import sys; sys.exit(sys.version_info[:2] != (3, 12))" >/dev/null 2>&1
}

find_py312() {
    if [ -n "${DSPARK_PY312:-}" ]; then
        # An explicit choice is not second-guessed: it works or the check fails.
        is_py312 "$DSPARK_PY312" && { echo "$DSPARK_PY312"; return 0; }
        echo "check_kernels_py312: DSPARK_PY312=$DSPARK_PY312 is not a Python 3.12 interpreter" >&2
        return 1
    fi
    local roots=() c
    if command -v pyenv >/dev/null 2>&1; then
        roots+=("$(pyenv root 2>/dev/null || true)")
    fi
    roots+=("${PYENV_ROOT:-}" "$HOME/.pyenv")
    for root in "${roots[@]}"; do
        [ -n "$root" ] || continue
        # Newest 3.12.x first.
        for c in $(ls -d "$root"/versions/3.12*/bin/python3.12 2>/dev/null | sort -rV); do
            is_py312 "$c" && { echo "$c"; return 0; }
        done
    done
    c="$(command -v python3.12 2>/dev/null || true)"
    is_py312 "$c" && { echo "$c"; return 0; }
    return 1
}

if ! PY="$(find_py312)"; then
    if [ "${DSPARK_ALLOW_NO_PY312:-0}" = "1" ]; then
        echo "check_kernels_py312: SKIPPED — no Python 3.12 found and DSPARK_ALLOW_NO_PY312=1 is set;" \
             "the Pallas kernels were NOT checked under jax 0.11"
        exit 0
    fi
    echo "check_kernels_py312: FAILED — no Python 3.12 interpreter found (tried \$DSPARK_PY312, pyenv root," \
         "~/.pyenv/versions/3.12*, python3.12 on PATH). Install one (pyenv install 3.12), point DSPARK_PY312 at" \
         "one, or set DSPARK_ALLOW_NO_PY312=1 to skip this leg knowingly." >&2
    exit 1
fi
echo "check_kernels_py312: using $PY ($("$PY" -c 'import sys; print(sys.version.split()[0])'))"

if ! "$PY" -c "import jax, numpy, scipy, pytest; assert jax.__version__.startswith('0.11.')" >/dev/null 2>&1; then
    "$PY" -m pip install -q "jax>=0.11,<0.12" "numpy>=1.26" "scipy>=1.11" "pytest>=8"
fi
JAX_VERSION="$("$PY" -c 'import jax; print(jax.__version__)')"
case "$JAX_VERSION" in
    0.11.*) echo "check_kernels_py312: jax $JAX_VERSION" ;;
    *) echo "check_kernels_py312: FAILED — expected jax 0.11.x under $PY, got $JAX_VERSION" >&2; exit 1 ;;
esac
# --noconftest: tests/conftest.py imports flax (not needed by the kernel tests); -p no:cacheprovider keeps the
# 3.11 cache untouched.
PYTHONPATH=. "$PY" -m pytest -q --noconftest -p no:cacheprovider tests/test_pallas_markov_sample.py \
    tests/test_pallas_ragged_attention.py
