#!/bin/bash
# Loss A/Bs at the cheap-A/B budget (configs/smollm2_ab_dspark.yaml: 300 steps of 4 sequences x 64 anchors, the
# same seed, data order and held-out rows), one arm after another; rerunning resumes (fit checkpoints).
cd /work/main
mkdir -p logs
run() {
  name=$1; shift
  [ -f runs/loss-ab/$name/DONE ] && return
  echo "== $name $(date -u +%T)"
  python -m train fit --config configs/smollm2_ab_dspark.yaml --set run.out_dir=runs/loss-ab/$name \
    --set 'heldout.sets={t1: data/t1-text, t0: data/t0-text}' "$@" > logs/loss-ab-$name.log 2>&1 \
    && touch runs/loss-ab/$name/DONE
  echo "   $name rc=$? $(date -u +%T)"
}
E3='drafter.overrides={num_layers: 1, intermediate_size: 3328}'
run eagle3 --set drafter.kind=eagle3 --set "$E3"
run dspark-kl --set 'optim.loss={kl: 1.0}'
run eagle3-soft --set drafter.kind=eagle3 --set "$E3" --set 'optim.loss={ce: 0.0, kl: 1.0}'
# Diagnostics of DSpark's gap, run after the loss arms: one slot (L = 1: position 1 without the block),
# DeepSpec's Markov rank 256, and one slot in EAGLE-3's shape (one layer, FFN 3328).
run dspark-L1 --set drafter.block_size=1
run dspark-r256 --set 'drafter.overrides={num_layers: 2, markov_rank: 256, anchor_feature: true}'
run dspark-L1-wide --set drafter.block_size=1 \
  --set 'drafter.overrides={num_layers: 1, intermediate_size: 3328, markov_rank: 32, anchor_feature: true}'
echo "== all done $(date -u +%T)"
