#!/bin/bash
# DSpark's Markov head started from the data's bigram PMI (make_init.py) against the zero-started head, at the
# cheap-A/B budget: same config, seed, data order and held-out rows as ../markov-shrink/ab.sh's rank-256 arm.
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
[ -d runs/anchor-ab/pmi-init-r256 ] || python reports/2026-12-06/markov-pmi/make_init.py --rank 256 \
  --out runs/anchor-ab/pmi-init-r256
run fused-r256-pmi --set "drafter.overrides={$O, markov_rank: 256}" --set drafter.init_from=runs/anchor-ab/pmi-init-r256
# The same through the library: `drafter.markov_init: pmi` (train/markov_init.py: its own randomized SVD, one power
# iteration, as the factory runs it)
run fused-r256-pmi-lib --set "drafter.overrides={$O, markov_rank: 256}" --set drafter.markov_init=pmi
echo "== all done $(date -u +%T)"
