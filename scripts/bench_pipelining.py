"""Host stalls, measured: the serving engine with rounds chained on device (round n+1 dispatched before round n
is read back, the default) against the same engine reading every round back before starting the next.

    python scripts/bench_pipelining.py --scheduler none dspark --concurrency 1 4 --max-tokens 64

Both variants share one compiled runner; they alternate `--repeats` times on the same greedy requests (their
outputs must be equal: a check, not a timing) and the median wall-clock tokens/s of each is printed with the
ratio. On a CPU the host and the XLA thread pool share the cores, so the gain is the dispatch and read-back
latency hidden behind the next round; on an accelerator the host work itself is hidden as well.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--target", default="smollm2-135m-instruct")
    p.add_argument("--scheduler", nargs="+", default=["none", "dspark"], help="schedulers to measure")
    p.add_argument("--concurrency", nargs="+", type=int, default=[1, 4], help="requests running together")
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--max-batch", type=int, default=4)
    p.add_argument("--out", default=None, help="write the rows as JSON here")
    return p.parse_args(argv)


def run(core, prompts, max_tokens: int) -> tuple[float, list[list[int]]]:
    from serve.types import EngineRequest, SamplingParams

    out: dict[str, list[int]] = {}
    for i, p in enumerate(prompts):
        core.add_request(EngineRequest(request_id=f"r{i}-{time.monotonic_ns()}", prompt_ids=p,
                                       params=SamplingParams(max_tokens=max_tokens, temperature=0.0,
                                                             ignore_eos=True),
                                       on_output=lambda o, i=i: out.setdefault(i, []).extend(o.token_ids)))
    t0 = time.perf_counter()
    while core.has_work():
        core.step()
    dt = time.perf_counter() - t0
    return dt, [out[i] for i in range(len(prompts))]


def main(argv=None) -> int:
    args = parse_args(argv)
    from dspark_jax.target import load_target
    from serve.startup import create_engine

    target = load_target(args.target)
    texts = ["What is the capital of France?", "Write a Python function that reverses a list.",
             "Explain photosynthesis in two sentences.", "What is 17 times 23?"]
    rows = []
    for sched in args.scheduler:
        loaded = {"target_obj": target, "drafter": None} if sched == "none" else {"drafter": "auto"}
        engine = create_engine(target=args.target, **loaded, scheduler=sched,
                               max_batch=args.max_batch, max_model_len=512, progress=False)
        core = engine.core_only()
        for c in args.concurrency:
            prompts = [target.chat_ids(texts[i % len(texts)]) for i in range(c)]
            run(core, prompts, 4)  # warm: prefill chunk shapes
            times = {True: [], False: []}
            outs = {}
            for _ in range(args.repeats):
                for pipelined in (True, False):
                    core.pipelined = pipelined
                    dt, toks = run(core, prompts, args.max_tokens)
                    times[pipelined].append(dt)
                    outs.setdefault(pipelined, toks)
            core.pipelined = True
            assert outs[True] == outs[False], "pipelining changed the greedy output"
            n = c * args.max_tokens
            tps = {k: n / statistics.median(v) for k, v in times.items()}
            row = {"scheduler": sched, "concurrency": c, "tokens": n, "pipelined_tok_s": round(tps[True], 2),
                   "synchronous_tok_s": round(tps[False], 2), "ratio": round(tps[True] / tps[False], 3),
                   "chained_steps_total": int(core.stats["chained_steps_total"])}
            rows.append(row)
            print(json.dumps(row), flush=True)
    if args.out:
        with open(args.out, "w") as f:
            json.dump(rows, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
