#!/bin/bash
# The cheap A/Bs of configs/smollm2_ab_dspark.yaml, one arm after another; rerunning resumes (fit checkpoints).
cd /work/main
run() {
  name=$1; shift
  [ -f runs/ab/$name/DONE ] && return
  echo "== $name $(date -u +%T)"
  python -m train fit --config configs/smollm2_ab_dspark.yaml --set run.out_dir=runs/ab/$name \
    --set 'heldout.sets={t1: data/t1-text, t0: data/t0-text}' "$@" > logs/ab-$name.log 2>&1 \
    && touch runs/ab/$name/DONE
  echo "   $name rc=$? $(date -u +%T)"
}
run base
run feature-norm --set 'drafter.overrides={num_layers: 2, markov_rank: 32, anchor_feature: true, feature_norm: true}'
run final-feature --set 'drafter.overrides={num_layers: 2, markov_rank: 32, anchor_feature: true, target_layers: [1, 15, 27, 29]}'
run gamma4 --set 'optim.loss={gamma: 4}'
run layers4 --set 'drafter.overrides={num_layers: 4, markov_rank: 32, anchor_feature: true}'
echo "== all done $(date -u +%T)"
