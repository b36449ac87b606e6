#!/usr/bin/env bash
# One accelerator session's checks, in priority order, each bounded in time (run from the repo root):
#   1. the Pallas kernel tests compiled for the GPU (plus their interpret-mode cases),
#   2. the engine on the GPU: greedy equality with the kernels, hostile pages, sampled chi-square,
#   3. kernel benchmarks at deployment shapes, 4. engine step cost with random weights of SmolLM2's shape.
# Logs go to $OUT (or out/gpu_check). Wheels for packages the GPU image lacks travel in .whl/ (gguf).
set -uo pipefail
OUT=${OUT:-out/gpu_check}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
if ls .whl/*.whl >/dev/null 2>&1; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
    export PYTHONPATH=/tmp/site:.
else
    export PYTHONPATH=.
fi
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv | tee "$OUT/device.txt"
python3 -c "import jax, flax; print('jax', jax.__version__, 'flax', flax.__version__, jax.devices())" | tee -a "$OUT/device.txt"
step() { local name=$1 limit=$2; shift 2; echo "=== $name (limit ${limit}s)"; timeout "$limit" "$@" 2>&1 | tee "$OUT/$name.log"; echo "=== $name exit ${PIPESTATUS[0]}"; }
# Only the compiled (gpu-marked) kernel tests: the interpreted cases call the kernels with the default backend,
# which is the GPU here, at shapes (page_size 8, rank 8) only the CPU interpreter takes; CI runs them.
step pallas_tests 120 python3 -m pytest -q -p no:cacheprovider tests/test_pallas_ragged_attention.py \
    tests/test_pallas_markov_sample.py -m gpu
step engine_tests 120 python3 -m pytest -q -p no:cacheprovider tests/test_engine.py -k "pallas_kernels"
step bench_attention 50 python3 scripts/bench_pallas_attention.py --repeats 20
step bench_markov 50 python3 scripts/bench_pallas_markov.py --repeats 20
step bench_engine 240 python3 scripts/bench_engine_device.py --arch smollm2 --dtype bfloat16 \
    --schedulers ${BENCH_SCHEDULERS:-none fixed:3} --pipelining ${BENCH_PIPELINING:-both} --kernels auto \
    --concurrency 1 4 16 --max-batch 16 --out "$OUT/bench_engine.json"
echo "all steps done"
