"""Regeneration speed of one tree: 64 real T = 1 training prompts (the CPU data job's plan, from prompt 1,000) on
SmolLM2-135M-Instruct, batch 64, 64 new tokens, twice (the first run compiles). Run once per tree:

    PYTHONPATH=<checkout of the old commit> python reports/2026-12-05/factory-gpu-readiness/regen_ab.py 64 64 64
    python reports/2026-12-05/factory-gpu-readiness/regen_ab.py 64 64 64
"""

import gzip
import json
import sys

from dspark_jax.target import load_target
from train.regenerate import SlotSettings, generate_slots

B, N, M = (int(x) for x in sys.argv[1:4])
t = load_target("smollm2-135m-instruct")
plan = json.load(gzip.open("/work/datagen/smollm2-t1/plan.json.gz"))["prompts"]
prompts = [(i, p["ids"]) for i, p in enumerate(plan[1000:1000 + N])]
cap = -(-(max(len(p) for _, p in prompts) + M + 1) // 64) * 64
s = SlotSettings(batch=B, capacity=cap, max_new_tokens=M, temperature=1.0, top_p=1.0)
for rep in range(2):
    st = {}
    generate_slots(t, prompts, settings=s, seed=0, eos_ids=t.eos_token_ids, on_done=lambda i, r: None, stats=st)
    print(rep, st, f"{st['tokens'] / st['seconds']:.1f} tok/s", flush=True)
