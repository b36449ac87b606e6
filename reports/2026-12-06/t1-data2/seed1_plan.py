"""Saves the seed-1 T = 1 plan (configs/smollm2_dspark_t1data.yaml's `prepare` command, the prompts the drafter
before this one was fine-tuned on) as data/t1-seed1/plan.json.gz without generating anything, so that the seed-2
plan can `--exclude` it. Magpie queries are left out: the target writes them anew for every seed."""

import os

from dspark_jax.target import load_target
from train.prepare import load_or_make_plan

os.makedirs("data/t1-seed1", exist_ok=True)
settings = {"target": "smollm2-135m-instruct",
            "per_domain": {"chat": 4000, "code": 2000, "math": 2000, "chat_turns": 2000},
            "max_prompt_tokens": 256, "max_new_tokens": 256, "temperature": 1.0, "top_p": 1.0, "seed": 1,
            "part_size": 64, "greedy_share": 0.2, "exclude": [os.path.abspath("data/ho-raw")]}
plan = load_or_make_plan("data/t1-seed1", settings, load_target("smollm2-135m-instruct").chat_ids)
print(f"data/t1-seed1: {len(plan)} prompts")
