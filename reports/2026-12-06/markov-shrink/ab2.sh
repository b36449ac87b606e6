#!/bin/bash
# Is rank 256's gain learning speed? Under Adam the bigram W1·W2 moves by about rank × σ × lr a step (σ: W1's
# initial scale, 0.02), so a rank-32 head drawn at σ = 0.16 should learn as the rank-256 one at 0.02, and a
# rank-256 head at σ = 0.06 faster still. Same budget, seed, data order and held-out rows as ab.sh.
cd "$(dirname "$0")/../../.."
mkdir -p logs
run() {
  name=$1; shift
  [ -f runs/anchor-ab/$name/DONE ] && return
  echo "== $name $(date -u +%T)"
  python -m train fit --config configs/smollm2_ab_dspark.yaml --set run.out_dir=runs/anchor-ab/$name \
    --set 'heldout.sets={t1: data/t1-text, t0: data/t0-text}' "$@" > logs/anchor-ab-$name.log 2>&1 \
    && touch runs/anchor-ab/$name/DONE
  echo "   $name rc=$? $(date -u +%T)"
}
O='num_layers: 2, anchor_feature: true, anchor_mode: fused'
run fused-r32-s016 --set "drafter.overrides={$O, markov_rank: 32}" --set drafter.markov_init_std=0.16
run fused-r256-s006 --set "drafter.overrides={$O, markov_rank: 256}" --set drafter.markov_init_std=0.06
# Rank, not scale: does a rank beyond DeepSpec's 256 help further?
run fused-r1024 --set "drafter.overrides={$O, markov_rank: 1024}"
# Has the gain flattened by 1,024? (a quarter of full rank at this 8,192-token vocabulary)
run fused-r2048 --set "drafter.overrides={$O, markov_rank: 2048}"
echo "== all done $(date -u +%T)"
