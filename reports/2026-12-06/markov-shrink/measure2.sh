#!/bin/bash
# The rank-1024 arm (ab2.sh) cut to ranks 256, 64 and 32, measured as measure.sh measured the rank-256 arm.
cd "$(dirname "$0")/../../.."
R=reports/2026-12-06/markov-shrink
S=runs/anchor-ab/shrink1024
mkdir -p $S
for r in 256 64 32; do
  python -m train shrink runs/anchor-ab/fused-r1024/drafter $S/r$r --markov-rank $r --report $S/r$r.json
done
python -m train heldout --drafters runs/anchor-ab/fused-r1024/drafter $S/r256 $S/r64 $S/r32 \
  --sets t1=data/t1-text t0=data/t0-text --out $R/heldout-r1024.json
