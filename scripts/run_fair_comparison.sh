#!/usr/bin/env bash
# The fair comparison's long jobs in order, each resumable: rerun this script after an interruption and every stage
# continues where it stopped (prepare skips finished shards and features; fit restores its Orbax checkpoint).
#   nohup scripts/run_fair_comparison.sh > logs/fair_comparison.log 2>&1 &
# Stages: regenerate the SmolLM2 training data (data_release/smollm2, committed) and its target features
# (data/smollm2), then distil DSpark, DFlash (both forms) and EAGLE-3 with configs/smollm2_fair_*.yaml.
set -euo pipefail
cd "$(dirname "$0")/.."
mkdir -p logs
echo "$(date -u +%FT%TZ) prepare" >&2
nice -n 19 python -m train prepare --out data_release/smollm2 --features-root data/smollm2 \
    --chat 1600 --code 800 --math 800 --max-new-tokens 256 --max-prompt-tokens 256 --batch-size 32 \
    --part-size 128 --seed 0 >> logs/regen_smollm2.log 2>&1
for kind in dspark dflash dflash_deepspec eagle3; do
    echo "$(date -u +%FT%TZ) fit $kind" >&2
    nice -n 19 python -m train fit --config "configs/smollm2_fair_$kind.yaml" >> "logs/fit_fair_$kind.log" 2>&1
done
echo "$(date -u +%FT%TZ) done" >&2
