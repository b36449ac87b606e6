"""`generate`'s prefill on the real SmolLM2 target: one request per pass (the old path, each row read back
before the next) against the packed passes of `dspark_jax.decoding._prefill_rows`, alternated in one process
on the same runner; the first tokens (greedy) must agree.

    python reports/2026-12-07/generate-prefill/ab.py --out reports/2026-12-07/generate-prefill/ab.json
"""

from __future__ import annotations

import argparse
import json
import time

import numpy as np

from dspark_jax.buckets import pow2_at_least
from dspark_jax.decoding import PAGE_SIZE, _prefill_rows
from dspark_jax.keys import row_key_data
from dspark_jax.runner import ModelRunner, RunnerConfig
from dspark_jax.target import load_target
from train import datasets


def one_per_pass(runner, prompts, tables, keys) -> np.ndarray:
    chunk, out = runner.chunk_sizes[-1], np.zeros(len(prompts), np.int32)
    for b, p in enumerate(prompts):
        for start in range(0, len(p), chunk):
            out[b] = runner.prefill(p[start : start + chunk], start, tables[b], keys[b], 0.0, 0, 1.0)[0]
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--prompts", type=int, default=48, help="chat/code/math eval prompts of ≤ 128 tokens")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    target = load_target("smollm2-135m-instruct")
    pool = (target.chat_ids(p) for d in ("chat", "code", "math") for p in datasets.load_prompts("eval", d, 40, seed=3))
    prompts = [q for q in pool if len(q) <= 128][: args.prompts]
    B = len(prompts)
    max_pages = pow2_at_least(-(-(max(map(len, prompts)) + 8) // PAGE_SIZE))
    runner = ModelRunner(target, None, RunnerConfig(max_batch=B, num_pages=B * max_pages, page_size=PAGE_SIZE,
                                                    max_pages=max_pages))
    tables = np.arange(B * max_pages, dtype=np.int32).reshape(B, max_pages)
    keys = row_key_data(0, B)
    ways = {"one_per_pass": lambda: one_per_pass(runner, prompts, tables, keys),
            "packed": lambda: _prefill_rows(runner, prompts, tables, keys, 0.0, 0, 1.0)}
    first = {name: fn() for name, fn in ways.items()}  # compiles
    assert (first["one_per_pass"] == first["packed"]).all(), "first tokens differ"
    times = {name: [] for name in ways}
    for _ in range(args.rounds):
        for name, fn in ways.items():
            t = time.perf_counter()
            fn()
            times[name].append(time.perf_counter() - t)
    med = {name: float(np.median(v)) for name, v in times.items()}
    result = {"prompts": B, "tokens": int(sum(map(len, prompts))), "seconds": times, "median_s": med,
              "packed_speedup": med["one_per_pass"] / med["packed"]}
    print(json.dumps(result, indent=1))
    with open(args.out, "w") as f:
        json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
