#!/bin/bash
# How the last context feature H_ctx[n-1] joins DSpark's anchor slot (`anchor_mode`), against EAGLE-3, at the
# cheap-A/B budget (configs/smollm2_ab_dspark.yaml: 300 steps of 4 sequences x 64 anchors, one seed, data order and
# held-out rows for every arm); one arm after another, rerunning resumes (fit checkpoints).
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
O='num_layers: 2, markov_rank: 32, anchor_feature: true'
run residual --set "drafter.overrides={$O, anchor_mode: residual}"
run fused --set "drafter.overrides={$O, anchor_mode: fused}"
run eagle3-soft --set drafter.kind=eagle3 --set 'drafter.overrides={num_layers: 1, intermediate_size: 3328}' \
  --set 'optim.loss={ce: 0.0, kl: 1.0}'
run base
echo "== all done $(date -u +%T)"
