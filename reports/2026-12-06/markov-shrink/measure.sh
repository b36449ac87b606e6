#!/bin/bash
# The rank-256 arm (ab.sh) cut to ranks 128, 64 and 32 by `python -m train shrink`, rows equal or weighted by the
# training data's response-token counts, each measured by `python -m train heldout` on the rows ab.sh's `fit`
# evaluated, beside the arm itself and ../anchor-ab's fused arm trained at rank 32.
cd "$(dirname "$0")/../../.."
R=reports/2026-12-06/markov-shrink
S=runs/anchor-ab/shrink
mkdir -p $S
for r in 128 64 32; do
  python -m train shrink runs/anchor-ab/fused-r256/drafter $S/r$r --markov-rank $r --report $S/r$r.json
  python -m train shrink runs/anchor-ab/fused-r256/drafter $S/r$r-w --markov-rank $r \
    --counts-from data_release/smollm2 --report $S/r$r-w.json
done
python -m train heldout --drafters runs/anchor-ab/fused-r256/drafter runs/anchor-ab/fused/drafter \
  $S/r128 $S/r128-w $S/r64 $S/r64-w $S/r32 $S/r32-w \
  --sets t1=data/t1-text t0=data/t0-text --out $R/heldout.json
