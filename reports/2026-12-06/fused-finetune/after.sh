#!/bin/bash
# After `python -m train fit --config configs/smollm2_dspark_fused.yaml` (stopped after step 1,000's held-out
# evaluation): the best held-out step's (runs/smollm2-dspark-fused/best) held-out acceptance, its calibration (into
# runs/ship-fused, the candidate for the shipped directory) and Table-1 τ at T = 1 and T = 0 (6 prompts a set, 64
# new tokens, γ = 7, before calibration, as the shipped drafter's card measured it).
cd "$(dirname "$0")/../../.."
R=reports/2026-12-06/fused-finetune
D=runs/smollm2-dspark-fused/best
set -x
python -m train heldout --drafters $D --sets t1=data/t1-text t0=data/t0-text --sequences 64 --anchors 16 \
  --out $R/heldout-fused.json
python -m train calibrate --drafter $D --out runs/ship-fused --prompts 16 --max-new-tokens 96 --report $R/calibration
for T in 1.0 0.0; do
  python scripts/reproduce_table1.py --target smollm2-135m-instruct --drafter $D --limit 6 --temperatures $T \
    --max-new-tokens 64 --json $R/table1_t$T.json > $R/table1_t$T.log 2>&1
done
echo "== after.sh done $(date -u +%T)"
