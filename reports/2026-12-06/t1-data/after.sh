#!/bin/bash
# After `python -m train fit --config configs/smollm2_dspark_t1data.yaml --set optim.steps=800 --set
# heldout.every=200`: Table-1 τ of the kept step (runs/smollm2-dspark-t1data/best) at T = 1 and T = 0, and its
# calibration (into runs/ship-t1data, what was shipped). The two ran side by side.
cd "$(dirname "$0")/../../.."
R=reports/2026-12-06/t1-data
D=runs/smollm2-dspark-t1data/best
set -x
$R/table1.sh t1data $D &
python -m train calibrate --drafter $D --out runs/ship-t1data --prompts 16 --max-new-tokens 96 --report $R/calibration
wait
echo "== after.sh done $(date -u +%T)"
