#!/bin/bash
# After `python -m train fit --config configs/smollm2_dspark_t1data3.yaml`: Table-1 τ of the kept step
# (runs/smollm2-dspark-t1data3/best) at T = 1 and T = 0, and its calibration (into runs/ship-t1data3, what shipping
# would copy). The three run side by side.
cd "$(dirname "$0")/../../.."
R=reports/2026-12-07/t1-data3
D=runs/smollm2-dspark-t1data3/best
set -x
$R/table1.sh t1data3 $D 1.0 &
$R/table1.sh t1data3 $D 0.0 &
python -m train calibrate --drafter $D --out runs/ship-t1data3 --prompts 16 --max-new-tokens 96 --report $R/calibration
wait
echo "== after.sh done $(date -u +%T)"
