#!/bin/bash
# The factory's DSpark (fused anchor input, Markov rank 256) at the cheap-A/B budget (configs/smollm2_ab_dspark.yaml:
# 300 steps of 4 sequences x 64 anchors, the 8,192-token draft vocabulary; same seed, data order and held-out rows as
# ../anchor-ab's fused arm, rank 32), so the rank-256 head can be truncated to a shippable rank and measured.
# Rerunning resumes (fit checkpoints).
cd "$(dirname "$0")/../../.."
mkdir -p logs
name=fused-r256
[ -f runs/anchor-ab/$name/DONE ] && exit 0
echo "== $name $(date -u +%T)"
python -m train fit --config configs/smollm2_ab_dspark.yaml --set run.out_dir=runs/anchor-ab/$name \
  --set 'heldout.sets={t1: data/t1-text, t0: data/t0-text}' \
  --set "drafter.overrides={num_layers: 2, markov_rank: 256, anchor_feature: true, anchor_mode: fused}" \
  --export runs/anchor-ab/$name/drafter > logs/anchor-ab-$name.log 2>&1 && touch runs/anchor-ab/$name/DONE
echo "   $name rc=$? $(date -u +%T)"
