#!/bin/bash
# Table-1 τ at temperature $3 (6 prompts a set, 64 new tokens, γ = 7, before calibration, the shipped cards'
# command) for one drafter: table1.sh NAME DRAFTER T (a shipped name or a directory).
cd "$(dirname "$0")/../../.."
R=reports/2026-12-07/t1-data3
python scripts/reproduce_table1.py --target smollm2-135m-instruct --drafter "$2" --limit 6 --temperatures "$3" \
  --max-new-tokens 64 --json "$R/table1_$1_t$3.json" > "$R/table1_$1_t$3.log" 2>&1
echo "== table1 $1 T = $3 done (rc $?) $(date -u +%T)"
