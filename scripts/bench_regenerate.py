"""Tokens/s of training-data regeneration: `dspark_jax.decoding.generate` (batch by batch) against
train/regenerate.py's slots refilled as rows finish, on real chat-templated training prompts (default: SmolLM2's
sampling, T = 0.2 and top-p 0.9; `--temperature 1 --top-p 1` for T = 1 data).

    python scripts/bench_regenerate.py --batch 32 64 --max-new-tokens 64 --prompts 64

"before": sorted by prompt length, batches of B through `generate`; timed on a second pass (compiled), and the
first pass (with its compiles) reported too. "after": `generate_slots` over the same prompts, first run (with
compiles) and a second run reusing the compiled steps. Tokens = response tokens produced (EOS included).
"""

from __future__ import annotations

import argparse
import json
import time

import numpy as np


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--batch", type=int, nargs="+", default=[32, 64])
    p.add_argument("--prompts", type=int, default=64, help="prompts per measurement (mixed chat/code/math)")
    p.add_argument("--max-new-tokens", type=int, default=64)
    p.add_argument("--max-prompt-tokens", type=int, default=256)
    p.add_argument("--temperature", type=float, default=0.2)
    p.add_argument("--top-p", type=float, default=0.9)
    p.add_argument("--which", nargs="+", default=["before", "after"], choices=["before", "after"])
    p.add_argument("--out", default=None, help="also write the results as JSON here")
    args = p.parse_args()

    from dspark_jax.decoding import generate
    from dspark_jax.target import load_target
    from train import datasets
    from train.regenerate import SlotDecoder, SlotSettings, generate_slots

    target = load_target("smollm2-135m-instruct")
    per = -(-args.prompts // 3)
    texts = sum((datasets.load_prompts("train", d, per, seed=123) for d in datasets.DOMAINS), [])
    enc = [ids for ids in (target.chat_ids(t) for t in texts) if len(ids) <= args.max_prompt_tokens][: args.prompts]
    print(f"{len(enc)} prompts, mean {np.mean([len(e) for e in enc]):.0f} tokens", flush=True)
    results = []
    for B in args.batch:
        if "before" in args.which:
            order = np.argsort([len(e) for e in enc], kind="stable")
            for rnd in ("first", "second"):
                t0, n = time.perf_counter(), 0
                for s in range(0, len(order), B):
                    batch = [enc[i] for i in order[s : s + B]]
                    res = generate(target, batch, max_new_tokens=args.max_new_tokens,
                                   temperature=args.temperature, top_p=args.top_p, seed=s)
                    n += sum(len(r) for r in res.tokens)
                dt = time.perf_counter() - t0
                results.append({"impl": "decoding.generate", "batch": B, "run": rnd, "tokens": n,
                                "seconds": round(dt, 1), "tokens_per_s": round(n / dt, 1)})
                print(json.dumps(results[-1]), flush=True)
        if "after" in args.which:
            settings = SlotSettings(batch=B, capacity=-(-(args.max_prompt_tokens + args.max_new_tokens + 1) // 64) * 64,
                                    max_new_tokens=args.max_new_tokens, temperature=args.temperature,
                                    top_p=args.top_p)
            dec = SlotDecoder(target, settings, seed=0)
            for rnd in ("first", "second"):
                got, stats = {}, {}
                generate_slots(target, list(enumerate(enc)), settings=settings, seed=0, eos_ids=target.eos_token_ids,
                               on_done=got.__setitem__, stats=stats, decoder=dec)
                n = sum(len(r) for r in got.values())
                results.append({"impl": "train.regenerate", "batch": B, "run": rnd, "tokens": n,
                                "seconds": round(stats["seconds"], 1), "tokens_per_s": round(n / stats["seconds"], 1),
                                "steps": stats["steps"], "prefills": stats["prefills"], "traces": stats["traces"]})
                print(json.dumps(results[-1]), flush=True)
    if args.out:
        with open(args.out, "w") as f:
            json.dump(results, f, indent=2)


if __name__ == "__main__":
    main()
