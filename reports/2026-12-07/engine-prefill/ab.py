"""The serving engine's prefill on the real SmolLM2 target with its shipped drafter (`fixed:2`, max_batch 16,
chunk buckets 32/128): one request per prefill pass (`runner.prefill_rows = (1,)`, the engine's old policy)
against the packed passes (`EngineCore._prefill_batch`), alternated on one engine after warm-up. Two
workloads, each a burst submitted at once and stepped to the end:

  score  — lm-eval-style loglikelihood requests: eval prompts' first ≤ 48 tokens, `max_tokens` 0 with prompt
           logprobs (echo), so the work is prefill alone;
  chat   — chat-templated eval prompts of ≤ 64 tokens, 16 greedy tokens each;
  mixed  — 4 long prompts (eval prompts' tokens run together to 300) each followed by 15 short ones (first
           ≤ 16 tokens), all scored as in `score`: long chunks beside short prompts, where the jnp attention
           path limits what packs (`ModelRunner.prefill_fits`).

Both ways must give the same tokens and the same prompt logprobs to float32 rounding (rtol 1e-4, atol 1e-4:
a pass of another shape sums in another order).

    python reports/2026-12-07/engine-prefill/ab.py --out reports/2026-12-07/engine-prefill/ab.json
"""

from __future__ import annotations

import argparse
import json
import time

import numpy as np

from serve.startup import create_engine
from serve.types import EngineRequest, SamplingParams
from train import datasets


def run(core, prompts, params) -> tuple[float, list]:
    outs: dict[str, list] = {}
    t = time.perf_counter()
    for i, p in enumerate(prompts):
        core.add_request(EngineRequest(request_id=f"{time.perf_counter_ns()}-{i}", prompt_ids=p, params=params,
                                       on_output=lambda o, i=i: outs.setdefault(i, []).append(o)))
    while core.has_work():
        core.step()
    seconds = time.perf_counter() - t
    result = []
    for i in range(len(prompts)):
        toks = [t for o in outs[i] for t in o.token_ids]
        plp = next((o.prompt_logprobs for o in outs[i] if o.prompt_logprobs), None)
        result.append((toks, [lp.logprob for lp in plp[1:]] if plp else []))
    return seconds, result


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--requests", type=int, default=128, help="score requests (chat: a quarter as many)")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    engine = create_engine(scheduler="fixed:2", profile=False, progress=False)
    core = engine.core_only()
    runner = core.runner
    tok = runner.target.tokenizer
    texts = [p for d in ("chat", "code", "math") for p in datasets.load_prompts("eval", d, args.requests, seed=5)]
    score = [ids[:48] for ids in (tok.encode(t) for t in texts) if len(ids) >= 8][: args.requests]
    chat = [q for q in (runner.target.chat_ids(t) for t in texts) if len(q) <= 64][: args.requests // 4]
    stream = [t for ids in (tok.encode(t) for t in texts) for t in ids]
    shorts = [ids[:16] for ids in (tok.encode(t) for t in texts[::-1]) if len(ids) >= 4]
    mixed = [q for i in range(4) for q in [stream[i * 300 : (i + 1) * 300]] + shorts[i * 15 : (i + 1) * 15]]
    workloads = {"score": (score, SamplingParams(max_tokens=0, prompt_logprobs=0)),
                 "mixed": (mixed, SamplingParams(max_tokens=0, prompt_logprobs=0)),
                 "chat": (chat, SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True))}
    packed_rows = runner.prefill_rows
    ways = {"one_per_pass": (1,), "packed": packed_rows}
    result = {"prefill_rows": list(packed_rows), "chunk_sizes": list(runner.chunk_sizes)}
    for name, (prompts, params) in workloads.items():
        times, outs = {w: [] for w in ways}, {}
        for _ in range(args.rounds):
            for way, rows in ways.items():
                runner.prefill_rows = rows
                passes = core.stats["prefill_passes_total"]
                seconds, out = run(core, prompts, params)
                times[way].append(seconds)
                outs[way] = out
                result[f"{name}_{way}_passes"] = core.stats["prefill_passes_total"] - passes
        a, b = outs["one_per_pass"], outs["packed"]
        assert [x[0] for x in a] == [x[0] for x in b], f"{name}: tokens differ"
        lps_a = np.concatenate([x[1] for x in a] + [[]]).astype(float)
        lps_b = np.concatenate([x[1] for x in b] + [[]]).astype(float)
        lp_diff = float(np.max(np.abs(lps_a - lps_b), initial=0.0))
        # float32 sums in other shapes (a 32- or 128-row pass): rounding, not another distribution
        assert np.allclose(lps_a, lps_b, rtol=1e-4, atol=1e-4), f"{name}: prompt logprobs differ by {lp_diff}"
        med = {w: float(np.median(v)) for w, v in times.items()}
        result[name] = {"requests": len(prompts), "prompt_tokens": int(sum(map(len, prompts))), "seconds": times,
                        "median_s": med, "requests_per_s": {w: len(prompts) / s for w, s in med.items()},
                        "packed_speedup": med["one_per_pass"] / med["packed"], "max_prompt_logprob_diff": lp_diff}
        print(name, json.dumps(result[name]), flush=True)
    runner.prefill_rows = packed_rows
    engine.stop()
    with open(args.out, "w") as f:
        json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
