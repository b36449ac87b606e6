"""Serving benchmark (not a test): total and per-user tokens/s against concurrency for several schedulers.

For each scheduler one engine is built (max batch = the largest concurrency; every capacity bucket compiled
and its SPS profiled at start-up); then for each concurrency c, c requests with mixed real prompts
(MT-Bench, HumanEval, held-out math; chat-templated) run together to completion. Printed per cell: total
tokens/s (all generated tokens / wall time of the wave), per-user tokens/s (mean over requests of generated
tokens / its own latency), τ (tokens per request-step) and mean verification tokens per pass. All numbers come
from this one run; a JSON and a PNG (train/plots.plot_throughput) are written.

    python scripts/bench_serve.py --schedulers none fixed:1 fixed:3 fixed:7 dspark --concurrency 1 2 4 8 16 32 64
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import threading
import time

import numpy as np

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))


def prompts_for(target, n: int, seed: int, max_len: int) -> list[list[int]]:
    """n chat-templated held-out prompts of at most max_len tokens, mixed over the three domains."""
    from train import datasets

    ids = []
    for d in datasets.DOMAINS:
        ids += [x for x in (target.chat_ids(t) for t in datasets.load_prompts("eval", d, 2 * n, seed=seed))
                if len(x) <= max_len][: -(-n // 3)]
    order = np.random.default_rng(seed).permutation(len(ids))
    return [ids[i] for i in order[:n]]


def run_wave(engine, prompts, max_tokens: int, temperature: float) -> dict:
    from serve.types import EngineRequest, SamplingParams

    done = threading.Event()
    lock = threading.Lock()
    state = {"left": len(prompts)}
    t_submit, t_end, counts = {}, {}, {}

    def on_output(o):
        with lock:
            counts[o.request_id] = counts.get(o.request_id, 0) + len(o.token_ids)
            if o.finish_reason is not None:
                t_end[o.request_id] = time.perf_counter()
                state["left"] -= 1
                if state["left"] == 0:
                    done.set()

    before = engine.metrics()
    t0 = time.perf_counter()
    for i, p in enumerate(prompts):
        rid = f"w{time.monotonic_ns()}-{i}"
        t_submit[rid] = time.perf_counter()
        engine.add_request(EngineRequest(request_id=rid, prompt_ids=p, on_output=on_output,
                                         params=SamplingParams(max_tokens=max_tokens, temperature=temperature,
                                                               seed=i)))
    done.wait()
    wall = time.perf_counter() - t0
    after = engine.metrics()
    steps = after["steps_total"] - before["steps_total"]
    total = sum(counts.values())
    per_user = float(np.mean([counts[r] / (t_end[r] - t_submit[r]) for r in counts]))
    return {"total_tps": total / wall, "per_user_tps": per_user, "tokens": total, "wall_s": wall, "steps": steps,
            "tau": after["tokens_per_step"], "verify_tokens_per_pass": after["verify_tokens_per_pass"]}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--target", default="smollm2-135m-instruct")
    p.add_argument("--drafter", default="smollm2-135m-instruct/dspark")
    p.add_argument("--schedulers", nargs="+", default=["none", "fixed:1", "fixed:3", "fixed:7", "dspark"])
    p.add_argument("--concurrency", type=int, nargs="+", default=[1, 2, 4, 8, 16, 32, 64])
    p.add_argument("--max-tokens", type=int, default=64, help="generated tokens per request")
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--max-model-len", type=int, default=512)
    p.add_argument("--out", default="reports/serve", help="directory for bench_serve.json and throughput.png")
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)

    from dspark_jax.drafter import load_drafter
    from dspark_jax.target import load_target
    from serve.engine import create_engine
    from train.plots import plot_throughput

    target = load_target(args.target)
    drafter = load_drafter(args.drafter, target)
    prompts = prompts_for(target, max(args.concurrency), args.seed, args.max_model_len - args.max_tokens)
    results, sps_tables, runners = {}, {}, {}
    for sched in args.schedulers:
        t0 = time.perf_counter()
        kind = "plain" if sched == "none" else "spec"  # speculative schedulers share one compiled runner
        if kind in runners:
            engine = create_engine(runner=runners[kind], scheduler=sched, max_model_len=args.max_model_len,
                                   progress=False)
        else:
            engine = create_engine(target_obj=target, drafter_obj=drafter if kind == "spec" else None,
                                   scheduler=sched, max_batch=max(args.concurrency),
                                   max_model_len=args.max_model_len, progress=False)
            runners[kind] = engine.core.runner
        sps_tables[sched] = engine.metrics()["sps_table"]
        print(f"[{sched}] engine ready in {time.perf_counter() - t0:.0f}s; SPS "
              + ", ".join(f"{k}:{v:.2f}" for k, v in sps_tables[sched].items()), flush=True)
        results[sched] = {}
        for c in args.concurrency:
            r = run_wave(engine, prompts[:c], args.max_tokens, args.temperature)
            results[sched][c] = r
            print(f"[{sched}] c={c:3d}  total {r['total_tps']:7.2f} tok/s  per-user {r['per_user_tps']:6.2f} tok/s  "
                  f"τ {r['tau']:.2f}  verify/pass {r['verify_tokens_per_pass']:.1f}", flush=True)
        engine.stop()
    os.makedirs(args.out, exist_ok=True)
    print("\ntotal tokens/s (ratio to the best fixed:N at the same concurrency)")
    print("c    " + "".join(f"{s:>14}" for s in args.schedulers))
    for c in args.concurrency:
        fixed = [results[s][c]["total_tps"] for s in args.schedulers if s.startswith("fixed")]
        best = max(fixed) if fixed else float("nan")
        cells = "".join(f"{results[s][c]['total_tps']:8.1f} ({results[s][c]['total_tps'] / best:4.2f})"
                        for s in args.schedulers)
        print(f"{c:<5}{cells}")
    with open(os.path.join(args.out, "bench_serve.json"), "w") as f:
        json.dump({"args": vars(args), "results": results, "sps_tables": sps_tables}, f, indent=2)
    plot_throughput(results, os.path.join(args.out, "throughput.png"))
    print(f"wrote {args.out}/bench_serve.json and throughput.png")
    return 0


if __name__ == "__main__":
    sys.exit(main())
