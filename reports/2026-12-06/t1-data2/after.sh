#!/bin/bash
# After `python -m train fit --config configs/smollm2_dspark_t1data2.yaml`: Table-1 τ of the kept step
# (runs/smollm2-dspark-t1data2/best) at T = 1 and T = 0, and its calibration (into runs/ship-t1data2, what shipping
# would copy). The three ran side by side.
cd "$(dirname "$0")/../../.."
R=reports/2026-12-06/t1-data2
D=runs/smollm2-dspark-t1data2/best
set -x
$R/table1.sh t1data2 $D 1.0 &
$R/table1.sh t1data2 $D 0.0 &
python -m train calibrate --drafter $D --out runs/ship-t1data2 --prompts 16 --max-new-tokens 96 --report $R/calibration
wait
echo "== after.sh done $(date -u +%T)"
