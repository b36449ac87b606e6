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
E3='drafter.overrides={num_layers: 1, intermediate_size: 3328}'
run residual --set "drafter.overrides={$O, anchor_mode: residual}"
run base
run eagle3-soft --set drafter.kind=eagle3 --set "$E3" --set 'optim.loss={ce: 0.0, kl: 1.0}'
# Not the input path? Then the count of position-1 examples a step: every window position an anchor (A = 256,
# 4x), and EAGLE-3 without its training-time-test unroll (L = 1: one prediction per anchor, as DSpark's slot 1).
run dspark-a256 --set data.anchors_per_seq=256
run eagle3-soft-L1 --set drafter.kind=eagle3 --set "$E3" --set 'optim.loss={ce: 0.0, kl: 1.0}' \
  --set drafter.block_size=1
# Neither? Then the loss: DSpark trained on EAGLE-3's loss alone (soft cross-entropy; no TV, CE or confidence).
run dspark-e3loss --set 'optim.loss={ce: 0.0, tv: 0.0, conf: 0.0, kl: 1.0}'
# Nor those? Then the context entries: EAGLE-3's pairs f_t with the token x_{t+1} that followed it, DSpark's is f_t
# alone (`context_tokens`: f_t + RMSNorm(e(x_{t+1}))·W, entry n-1 made with the anchor).
run context-tokens --set "drafter.overrides={$O, context_tokens: true}"
run fused --set "drafter.overrides={$O, anchor_mode: fused}"
# Fused helps position 1: do paired context entries add to it?
run fused-context-tokens --set "drafter.overrides={$O, anchor_mode: fused, context_tokens: true}"
echo "== all done $(date -u +%T)"
