#!/bin/bash
# Table-1 τ at T = 1 and T = 0 (6 prompts a set, 64 new tokens, γ = 7, before calibration, the shipped cards'
# command) for one drafter: table1.sh NAME DRAFTER (a shipped name or a directory).
cd "$(dirname "$0")/../../.."
R=reports/2026-12-06/t1-data
for T in 1.0 0.0; do
  python scripts/reproduce_table1.py --target smollm2-135m-instruct --drafter "$2" --limit 6 --temperatures $T \
    --max-new-tokens 64 --json $R/table1_$1_t$T.json > $R/table1_$1_t$T.log 2>&1
done
echo "== table1 $1 done $(date -u +%T)"
