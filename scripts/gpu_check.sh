#!/usr/bin/env bash
# One prepared accelerator run (≤ 8 minutes), run from the repo root; every step bounded by `timeout`:
#   1. the Pallas kernel tests compiled for the GPU,
#   2. the attention kernel sweep against its jnp reference (scripts/bench_pallas_attention.py),
#   3. a SmolLM2-shaped and 4. a Qwen3-8B-shaped engine, random bf16 weights built on the device: start-up seconds,
#      programs compiled, peak memory, step time against the HBM weight-read time at c = 1, 4, 16, 64, target-only
#      and speculative (scripts/bench_engine_device.py).
# Everything lands in $OUT (default out/gpu_check) as ≤ 8 flat files: device.txt, pallas_tests.log,
# bench_attention.log, engine_smollm2.{log,json}, engine_qwen3-8b.{log,json}, summary.txt; copy them to
# reports/gpu/<date>/. Wheels for packages the GPU image lacks may travel in .whl/; nothing here imports gguf,
# grain or array_record.
#
#   scripts/gpu_check.sh            # on the GPU machine
#   scripts/gpu_check.sh --smoke    # the same steps on a CPU at tiny shapes: a rehearsal of the script itself
set -uo pipefail
SMOKE=0
case "${1:-}" in
    --smoke|--tiny) SMOKE=1 ;;
    -h|--help) sed -n '2,14p' "$0"; exit 0 ;;
    "") ;;
    *) echo "unknown argument $1 (try --help)" >&2; exit 2 ;;
esac
OUT=${OUT:-out/gpu_check}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
if ls .whl/*.whl >/dev/null 2>&1; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
    export PYTHONPATH=/tmp/site:.
else
    export PYTHONPATH=.
fi
T0=$(date +%s)
{
    date -u
    nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv 2>/dev/null || echo "no nvidia-smi"
    python3 -c "import jax, flax; print('jax', jax.__version__, 'flax', flax.__version__, jax.devices())"
} 2>&1 | tee "$OUT/device.txt"
: > "$OUT/summary.txt"
step() {
    local name=$1 limit=$2; shift 2
    local t=$(date +%s)
    echo "=== $name (limit ${limit}s)"
    timeout "$limit" "$@" > "$OUT/$name.log" 2>&1
    local rc=$?
    tail -n 40 "$OUT/$name.log"
    echo "$name: exit $rc$([ $rc = 124 ] && echo ' (time limit)') in $(( $(date +%s) - t ))s" | tee -a "$OUT/summary.txt"
}
if [ $SMOKE = 1 ]; then  # CPU: tiny shapes of the same structure, generous limits for a slow shared CPU
    SMALL=tiny; LARGE=tiny-qwen3; DTYPE=float32; CONC="1 4"; TOKENS=8; LIMIT_S=900; LIMIT_L=900
    ATTN=(--tiny --repeats 2); PALLAS=(-k "tpu_mosaic and T16")
else
    SMALL=smollm2; LARGE=qwen3-8b; DTYPE=bfloat16; CONC="1 4 16 64"; TOKENS=64; LIMIT_S=120; LIMIT_L=210
    ATTN=(--repeats 10); PALLAS=(-m gpu)
fi
# Only the compiled (gpu-marked) kernel tests on the GPU: the interpreted cases call the kernels with the default
# backend, which is the GPU there, at shapes only the CPU interpreter takes; CI runs them.
step pallas_tests 45 python3 -m pytest -q -p no:cacheprovider tests/test_pallas_ragged_attention.py \
    tests/test_pallas_markov_sample.py "${PALLAS[@]}"
step bench_attention 45 python3 scripts/bench_pallas_attention.py "${ATTN[@]}"
for arch in $SMALL $LARGE; do
    [ $arch = $SMALL ] && limit=$LIMIT_S || limit=$LIMIT_L
    step engine_$arch $limit python3 scripts/bench_engine_device.py --arch $arch --dtype $DTYPE \
        --schedulers none fixed:3 --kernels auto --pipelining on --concurrency $CONC --max-tokens $TOKENS \
        --max-model-len 512 --out "$OUT/engine_$arch.json"
done
echo "all steps done in $(( $(date +%s) - T0 ))s" | tee -a "$OUT/summary.txt"
ls -l "$OUT" | tee -a "$OUT/summary.txt"
