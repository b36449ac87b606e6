"""c=1 engine breakdown: none vs dspark, driving EngineCore.step() directly with timed runner calls."""
import collections, sys, time, os
sys.path.insert(0, os.getcwd())
import numpy as np
import jax
from dspark_jax.drafter import load_drafter
from dspark_jax.target import load_target
from serve.engine import create_engine
from serve.types import EngineRequest, SamplingParams
sys.path.insert(0, "scripts")
from bench_serve import prompts_for

jax.config.update("jax_compilation_cache_dir", os.path.expanduser("~/.cache/dspark_jax/xla"))
jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.5)
N = int(os.environ.get("NREQ", 6)); TOK = int(os.environ.get("TOK", 64)); MB = int(os.environ.get("MB", 4))
target = load_target("smollm2-135m-instruct")
drafter = load_drafter("smollm2-135m-instruct/dspark", target)
prompts = prompts_for(target, 8, 0, 512 - 64)[:N]
cores = {}
for sched in ("none", "dspark"):
    t0 = time.perf_counter()
    path = f"/tmp/eng/sps_{sched}_{MB}.json"
    kw = dict(sps_table=path) if os.path.exists(path) else dict(sps_out=path)
    eng = create_engine(target_obj=target, drafter_obj=drafter if sched != "none" else None, scheduler=sched,
                        max_batch=MB, progress=False, **kw)
    cores[sched] = eng.core_only()
    print(sched, "ready", round(time.perf_counter() - t0), "s", flush=True)

def timed(core):
    T = collections.defaultdict(float); C = collections.Counter()
    r = core.runner
    orig_plan = type(core)._plan
    def plan(*a, **k):
        t = time.perf_counter(); out = orig_plan(core, *a, **k); T["_plan"] += time.perf_counter() - t; C["_plan"] += 1
        kind = "plain" if isinstance(out.drafts, str) else ("probe" if out.budget == 0 else "spec")
        C["plan_" + kind] += 1; return out
    core._plan = plan
    orig_proc = type(core)._process
    def proc(*a, **k):
        t = time.perf_counter(); out = orig_proc(core, *a, **k); T["_process"] += time.perf_counter() - t; C["_process"] += 1; return out
    core._process = proc
    for name in ("prefill", "dispatch", "fetch", "advance", "step", "draft", "device_batch"):
        if not hasattr(r, name): continue
        f = getattr(type(r), name)
        def w(*a, _f=f, _n=name, **k):
            t = time.perf_counter(); out = _f(r, *a, **k); T[_n] += time.perf_counter() - t; C[_n] += 1; return out
        setattr(r, name, w)
    return T, C

def run(core):
    T, C = timed(core)
    before = dict(core.stats)
    done = []
    t0 = time.perf_counter()
    lat = []
    for i, p in enumerate(prompts):
        ts = time.perf_counter()
        core.add_request(EngineRequest(request_id=f"{time.monotonic_ns()}", prompt_ids=p,
                                       params=SamplingParams(max_tokens=TOK, temperature=0.0, seed=i),
                                       on_output=lambda o: done.append(o.finish_reason) if o.finish_reason else None))
        while core.has_work():
            core.step()
        lat.append(time.perf_counter() - ts)
    wall = time.perf_counter() - t0
    del core._plan, core._process
    for k in list(vars(core.runner)):
        if k in T: delattr(core.runner, k)
    st = {k: core.stats[k] - before.get(k, 0) for k in core.stats}
    return wall, dict(T), dict(C), st

for rnd in range(int(os.environ.get("ROUNDS", 2))):
    for sched in (("none", "dspark") if rnd % 2 == 0 else ("dspark", "none")):
        wall, T, C, st = run(cores[sched])
        host = wall - sum(v for k, v in T.items() if k != "step")
        print(f"[{sched}] wall {wall:.2f}s steps {st.get('steps_total')} plain {st.get('plain_steps_total')} "
              f"chained {st.get('chained_steps_total')} prefill_chunks {st.get('prefill_chunks_total')}", flush=True)
        print("   ms total:", {k: round(1e3 * v) for k, v in T.items()}, "counts:", C, flush=True)
        print("   ms/call:", {k: round(1e3 * v / C[k], 2) for k, v in T.items()}, flush=True)
