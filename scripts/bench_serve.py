"""Serving benchmark (not a test): total and per-user tokens/s against concurrency for several schedulers,
beside transformers' and our own batch-1 `generate` on the same weights, in one run.

For each scheduler one engine is built with the server's default sizes (`--max-batch 16`, max_model_len from
the target; every step shape compiled and the SPS table profiled at start-up, as `python -m dspark_jax.serve`
does); then for each concurrency c a closed loop over max(c, --min-requests) requests with mixed real prompts
(MT-Bench, HumanEval, held-out math; chat-templated): c in flight, the next submitted as one finishes (beyond
max batch they queue, as on the server). Every engine is built first; at each level the schedulers then take
turns (`--rounds` times, the order rotated each round), so a machine whose speed drifts over the run slows them
alike: a cell is the median round, and the ratio to `none` pairs runs of the same round. Printed per
cell: total tokens/s (all generated tokens / wall time of the level), per-user tokens/s (mean over requests of
generated tokens / its own latency), τ (tokens per request-step), mean verification tokens per pass and the
share of plain steps (no draft pass).
Reference lines at batch 1 on the same prompts, one after another: transformers' `model.generate` (greedy,
torch, the same GGUF weights), our `dspark_jax.generate` target-only and with the drafter. Per-phase times of
one step (draft, schedule, verify, host) are measured at concurrency 1 and 16. A JSON and a PNG are written.

    python scripts/bench_serve.py --schedulers none fixed:1 fixed:3 fixed:7 dspark --concurrency 1 2 4 8 16 32 64
"""

from __future__ import annotations

import argparse
import datetime
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


def run_load(engine, prompts, concurrency: int, max_tokens: int, temperature: float) -> dict:
    """A closed loop: `concurrency` requests in flight, the next submitted as one finishes, until every prompt
    has been served (len(prompts) ≥ concurrency requests in all; beyond max batch they queue, as on the server)."""
    from serve.types import EngineRequest, SamplingParams

    lock = threading.Lock()
    slots = threading.Semaphore(concurrency)
    done = threading.Event()
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
        if o.finish_reason is not None:
            slots.release()

    before = engine.metrics()
    t0 = time.perf_counter()
    for i, p in enumerate(prompts):
        slots.acquire()
        rid = f"w{time.monotonic_ns()}-{i}"
        with lock:
            t_submit[rid] = time.perf_counter()
        engine.add_request(EngineRequest(request_id=rid, prompt_ids=p, on_output=on_output,
                                         params=SamplingParams(max_tokens=max_tokens, temperature=temperature,
                                                               seed=i)))
    done.wait()
    wall = time.perf_counter() - t0
    after = engine.metrics()
    steps = after["steps_total"] - before["steps_total"]
    d = {k: after[k] - before[k] for k in ("plain_steps_total", "emitted_total", "row_steps_total",
                                            "verify_tokens_total")}
    total = sum(counts.values())
    per_user = float(np.mean([counts[r] / (t_end[r] - t_submit[r]) for r in counts]))
    return {"total_tps": total / wall, "per_user_tps": per_user, "requests": len(prompts), "tokens": total,
            "wall_s": wall, "steps": steps, "plain_step_share": d["plain_steps_total"] / max(steps, 1),
            "tau": d["emitted_total"] / max(d["row_steps_total"], 1),
            "verify_tokens_per_pass": d["verify_tokens_total"] / max(steps, 1),
            "draft_gain_ratio": after.get("draft_gain_ratio")}  # dspark's ρ at the end of the load


def reference_lines(target, drafter, prompts, max_tokens: int, target_spec: str) -> dict:
    """tokens/s at batch 1 over `prompts`, one after another: transformers' greedy `model.generate` on the
    same GGUF weights, ours target-only, ours with the drafter (default policy). Compilation is excluded (every
    prompt runs once untimed per path first)."""
    import dspark_jax

    out = {}
    for name, d in (("generate (target only)", None), ("generate (drafter)", drafter)):
        for p in prompts:  # compile every shape the timed calls use (the page table follows the prompt's length)
            dspark_jax.generate(target, [p], d, max_new_tokens=max_tokens, ignore_eos=True)
        t0, n = time.perf_counter(), 0
        for p in prompts:
            n += len(dspark_jax.generate(target, [p], d, max_new_tokens=max_tokens, ignore_eos=True).tokens[0])
        out[name] = n / (time.perf_counter() - t0)
    try:
        import torch

        from dspark_jax.hub import resolve_target
        from scripts.bench_target_decode import torch_gguf_model

        _, path = resolve_target(target_spec)
        model = torch_gguf_model(path)
        with torch.no_grad():
            model.generate(torch.tensor([prompts[0]]), max_new_tokens=4, do_sample=False)
            t0, n = time.perf_counter(), 0
            for p in prompts:
                o = model.generate(torch.tensor([p]), max_new_tokens=max_tokens, min_new_tokens=max_tokens,
                                   do_sample=False)
                n += o.shape[1] - len(p)
        out["transformers generate"] = n / (time.perf_counter() - t0)
    except Exception as e:  # the reference is part of the report: say loudly that it is missing
        print(f"transformers reference FAILED: {type(e).__name__}: {e}", flush=True)
        out["transformers generate"] = float("nan")
    return out


def phase_times(engine, prompts, rows: int, repeats: int = 5) -> dict:
    """Median ms of one step's phases for `rows` running requests: draft (device, synced), schedule (the
    host's capacity search), verify (device pass given the drafts), host (everything else of an engine step:
    building arrays, bookkeeping)."""
    from dspark_jax.runner import StepKind
    from serve.scheduler import dspark_capacity

    core = engine.core
    runner = core.runner
    b = runner.empty_batch(rows)
    for i in range(rows):
        b.lengths[i], b.anchors[i] = len(prompts[i % len(prompts)]), 1
    dev = runner.device_batch(b)
    sps = core.scheduler.token_sps(b.lengths.shape[0], int(b.lengths.max()))[0]
    times = {"draft": [], "schedule": [], "verify": [], "step": []}
    for _ in range(repeats + 1):
        t0 = time.perf_counter()
        drafts = jax_block(runner.draft(b, dev)) if runner.L else None
        t1 = time.perf_counter()
        conf = np.ones((b.lengths.shape[0], max(runner.L, 1)), np.float32)
        K = dspark_capacity(conf, b.active, runner.L, sps) if runner.L else 0
        t2 = time.perf_counter()
        cap = min(c for c in runner.capacities if c >= rows + min(K, rows * runner.L))
        budget = min(K, cap - rows) if runner.L else 0
        kind = StepKind.SPECULATE if budget else StepKind.PROBE if runner.L else StepKind.PLAIN
        runner.step(b, kind, capacity=cap, budget=budget or None, drafts=drafts, dev=dev)
        t3 = time.perf_counter()
        times["draft"].append(t1 - t0)
        times["schedule"].append(t2 - t1)
        times["verify"].append(t3 - t2)
    med = {k: 1e3 * float(np.median(v[1:])) for k, v in times.items() if v}
    return med


def median_run(runs: list[dict]) -> dict:
    """The run with the median total tokens/s (the lower middle for an even count), with every run's figure."""
    ordered = sorted(runs, key=lambda r: r["total_tps"])
    out = dict(ordered[(len(ordered) - 1) // 2])
    out["total_tps_runs"] = [r["total_tps"] for r in runs]
    return out


def jax_block(x):
    import jax

    return jax.block_until_ready(x)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--target", default="smollm2-135m-instruct")
    p.add_argument("--drafter", default="smollm2-135m-instruct/dspark")
    p.add_argument("--max-batch", type=int, default=16, help="engine batch slots (the server's default)")
    p.add_argument("--reference-prompts", type=int, default=6, help="prompts for the batch-1 reference lines")
    p.add_argument("--schedulers", nargs="+", default=["none", "fixed:1", "fixed:3", "fixed:7", "dspark"])
    p.add_argument("--concurrency", type=int, nargs="+", default=[1, 2, 4, 8, 16, 32, 64])
    p.add_argument("--max-tokens", type=int, default=64, help="generated tokens per request")
    p.add_argument("--min-requests", type=int, default=8,
                   help="requests served per concurrency level at least (closed loop: c in flight, max(c, this) "
                        "in all)")
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--rounds", type=int, default=1,
                   help="runs of every (scheduler, concurrency) cell; the schedulers take turns at each level, so "
                        "machine drift hits them alike; cells report the median run and ratios pair runs of the same "
                        "round (default: %(default)s)")
    p.add_argument("--max-model-len", type=int, default=None, help="default: the server's (from the target)")
    p.add_argument("--out", default=f"reports/{datetime.date.today()}/serve",
                   help="directory for bench_serve.json and throughput.png (default: reports/<today>/serve)")
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    if args.rounds < 1:
        p.error(f"--rounds must be >= 1, got {args.rounds}")

    from dspark_jax.drafter import load_drafter
    from dspark_jax.target import load_target
    from serve.startup import create_engine
    from train.plots import plot_throughput

    target = load_target(args.target)
    drafter = load_drafter(args.drafter, target)
    prompts = prompts_for(target, max(max(args.concurrency), args.min_requests), args.seed, 512 - args.max_tokens)
    print(f"load average {os.getloadavg()[0]:.1f}", flush=True)
    refs = reference_lines(target, drafter, prompts[: args.reference_prompts], args.max_tokens, args.target)
    for k, v in refs.items():
        print(f"[reference] {k}: {v:.2f} tok/s (batch 1)", flush=True)
    sps_tables, runners, phases, engines = {}, {}, {}, {}
    for sched in args.schedulers:
        t0 = time.perf_counter()
        kind = "plain" if sched == "none" else "spec"  # speculative schedulers share one compiled runner
        if kind in runners:
            engine = create_engine(runner=runners[kind], scheduler=sched, max_model_len=args.max_model_len,
                                   progress=False)
        else:
            engine = create_engine(target_obj=target, drafter_obj=drafter if kind == "spec" else None,
                                   scheduler=sched, max_batch=args.max_batch,
                                   max_model_len=args.max_model_len, progress=False)
            runners[kind] = engine.core.runner
        sps_tables[sched] = engine.metrics()["sps_table"]
        print(f"[{sched}] engine ready in {time.perf_counter() - t0:.0f}s; SPS "
              + ", ".join(f"{k}:{v:.2f}" for k, v in sps_tables[sched].items()), flush=True)
        if sched in ("none", "dspark"):
            core = engine.core_only()
            phases[sched] = {r: phase_times(engine, prompts, r) for r in (1, min(16, args.max_batch))}
            print(f"[{sched}] phase ms: {phases[sched]}", flush=True)
            engine = create_engine(runner=core.runner, scheduler=sched, max_model_len=args.max_model_len,
                                   progress=False)
        engines[sched] = engine
    # The schedulers take turns at each level (order rotated every round), so a machine that drifts slows them
    # alike; a cell is the median round, and ratios are taken between runs of the same round.
    runs = {s: {c: [] for c in args.concurrency} for s in args.schedulers}
    for i, c in enumerate(args.concurrency):
        for rnd in range(args.rounds):
            k = (i + rnd) % len(args.schedulers)
            for sched in args.schedulers[k:] + args.schedulers[:k]:
                r = run_load(engines[sched], prompts[: max(c, args.min_requests)], c, args.max_tokens,
                             args.temperature)
                runs[sched][c].append(r)
                print(f"[{sched}] c={c:3d} round {rnd + 1}/{args.rounds}  {r['requests']:3d} requests  total "
                      f"{r['total_tps']:7.2f} tok/s  per-user {r['per_user_tps']:6.2f} tok/s  τ {r['tau']:.2f}  "
                      f"verify/pass {r['verify_tokens_per_pass']:.1f}  plain steps {100 * r['plain_step_share']:.0f}%",
                      flush=True)
    for engine in engines.values():
        engine.stop()
    results = {s: {c: median_run(runs[s][c]) for c in args.concurrency} for s in args.schedulers}
    if "none" in args.schedulers:
        for s in args.schedulers:
            for c in args.concurrency:
                pairs = zip(runs[s][c], runs["none"][c], strict=True)
                results[s][c]["vs_none_paired"] = float(np.median([a["total_tps"] / b["total_tps"] for a, b in pairs]))
    os.makedirs(args.out, exist_ok=True)
    print("\ntotal tokens/s (ratio to the best fixed:N at the same concurrency)")
    print("c    " + "".join(f"{s:>14}" for s in args.schedulers))
    for c in args.concurrency:
        fixed = [results[s][c]["total_tps"] for s in args.schedulers if s.startswith("fixed")]
        best = max(fixed) if fixed else float("nan")
        cells = "".join(f"{results[s][c]['total_tps']:8.1f} ({results[s][c]['total_tps'] / best:4.2f})"
                        for s in args.schedulers)
        print(f"{c:<5}{cells}")
    if "none" in args.schedulers:
        print("\ntotal tokens/s against none, median over rounds of the same round's ratio")
        print("c    " + "".join(f"{s:>14}" for s in args.schedulers))
        for c in args.concurrency:
            print(f"{c:<5}" + "".join(f"{results[s][c]['vs_none_paired']:14.2f}" for s in args.schedulers))
    with open(os.path.join(args.out, "bench_serve.json"), "w") as f:
        json.dump({"args": vars(args), "results": results, "sps_tables": sps_tables, "references": refs,
                   "phase_ms": phases, "load_average_end": os.getloadavg()[0]}, f, indent=2)
    c1 = {s: results[s][1]["total_tps"] for s in args.schedulers if 1 in results[s]}
    tf = refs.get("transformers generate", float("nan"))
    for s, v in c1.items():
        print(f"c=1 {s}: {v:.2f} tok/s = {v / tf:.2f}x transformers, {v / refs['generate (drafter)']:.2f}x our "
              f"generate with the drafter, {v / refs['generate (target only)']:.2f}x our target-only generate")
    plotted = dict(results)
    for k, v in refs.items():  # batch-1 reference points at concurrency 1
        plotted[k + " (batch 1)"] = {1: {"total_tps": v, "per_user_tps": v}}
    plot_throughput(plotted, os.path.join(args.out, "throughput.png"))
    print(f"wrote {args.out}/bench_serve.json and throughput.png")
    return 0


if __name__ == "__main__":
    sys.exit(main())
