"""Engine start-up: `EngineConfig` and `create_engine`, which load the models, build the runner, compile its
programs, profile (or load) the SPS table and start an `Engine` (serve/engine.py) on it.

Start-up is its own module so serve/engine.py holds only the running engine (EngineCore's step and Engine's
thread) and reads without the loading, compiling and profiling around it. With `EngineConfig.background`, only
the programs one request needs compile before the engine starts; the rest and the SPS profile are a generator
(`_background_startup`) the engine advances in its idle time.
"""

from __future__ import annotations

import dataclasses
import logging
import time

from dspark_jax.policy import Policy
from serve.engine import Engine, EngineCore
from serve.scheduler import warm_scheduler
from serve.sps_table import SpsTable

log = logging.getLogger("dspark_jax.serve")


DEFAULT_MAX_MODEL_LEN = 2048  # cap on the length taken from the target's config
PROFILE_CONTEXTS = (64, 512)  # context lengths the SPS table is profiled at (interpolated between)


def default_drafter(target_name: str) -> str | None:
    """The drafter shipped for a known target name ("<target>/dspark"), else None."""
    from dspark_jax.drafter import shipped_drafters

    name = f"{target_name}/dspark"
    return name if name in shipped_drafters() else None


@dataclasses.dataclass(frozen=True, kw_only=True)
class EngineConfig:
    """What `create_engine` builds: the models, the scheduler, the engine's sizes and its start-up. Validated
    once here; logged at start-up.

    target: a model spec (`dspark_jax.target.load_target`). drafter: "auto" = the drafter shipped for `target`
        if there is one, else none (said in one log line); None or "none" serves the target alone.
    scheduler: a policy string (dspark_jax/policy.py); default "dspark" with a drafter, "none" without.
    max_model_len: default min(the target's max_position_embeddings, 2048).
    num_pages: KV pages in the pool; default enough for max_batch requests of max_model_len.
    kernels: "auto" | "pallas" | "reference" (dspark_jax/kernels.py). mesh_shape: (data, model) devices.
    dtype: the target's (and drafter's) weights and activations: "auto" (bfloat16 on GPU/TPU, float32 on CPU:
        `dspark_jax.target.resolve_dtype`), "bfloat16" or "float32"; with a given target, "auto" or its dtype.
    kv_dtype: the KV page pools': "auto" (= the compute dtype), "bfloat16" or "float32".
    profile: profile the SPS table at start-up (else flat, unless `sps_table` is given). sps_table: a saved
        table (`sps_out` of an earlier start) to load instead; it must cover every shape.
    background: ready after compiling what one request needs (prefill and the batch-of-one steps of the safe
        policy: plain steps for the dspark scheduler); the other programs and the SPS profile follow in the
        engine's idle time, and the dspark scheduler speculates once its table is ready (logged). False: all of
        it before the engine starts.
    max_waiting: the longest queue before requests are refused (None: unbounded)."""

    target: str = "smollm2-135m-instruct"
    drafter: str | None = "auto"
    scheduler: str | None = None
    max_batch: int = 16
    max_model_len: int | None = None
    page_size: int = 16
    num_pages: int | None = None
    kernels: str = "auto"
    mesh_shape: tuple[int, int] = (1, 1)
    chunk_sizes: tuple[int, ...] = (32, 128)
    dtype: str = "auto"
    kv_dtype: str = "auto"
    profile: bool = True
    sps_table: str | None = None
    sps_out: str | None = None
    background: bool = False
    max_waiting: int | None = None

    def __post_init__(self):
        bad = [f"{name}={getattr(self, name)!r}" for name, ok in (
            ("max_batch", self.max_batch >= 1), ("page_size", self.page_size >= 1),
            ("max_model_len", self.max_model_len is None or self.max_model_len >= 2),
            ("num_pages", self.num_pages is None or self.num_pages >= 1),
            ("chunk_sizes", len(self.chunk_sizes) > 0 and all(c >= 1 for c in self.chunk_sizes)),
            ("mesh_shape", len(self.mesh_shape) == 2 and all(m >= 1 for m in self.mesh_shape)),
            ("max_waiting", self.max_waiting is None or self.max_waiting >= 0)) if not ok]
        if bad:
            raise ValueError("bad engine sizes: " + ", ".join(bad))
        for name in ("dtype", "kv_dtype"):
            if getattr(self, name) not in ("auto", "bfloat16", "float32"):
                raise ValueError(f"{name} must be auto, bfloat16 or float32, got {getattr(self, name)!r}")
        if self.scheduler is not None:
            Policy.parse(self.scheduler)  # a clear error for a bad policy string, before anything loads
        object.__setattr__(self, "chunk_sizes", tuple(sorted(int(c) for c in self.chunk_sizes)))
        object.__setattr__(self, "mesh_shape", tuple(int(m) for m in self.mesh_shape))


def create_engine(config: EngineConfig | None = None, *, target_obj=None, drafter_obj=None, runner=None,
                  progress: bool = True, **fields) -> Engine:
    """Loads target and drafter, precompiles every shape, profiles (or loads) the SPS table, starts the engine.

    config: an EngineConfig; keyword `fields` build one (or replace its fields). `target_obj` / `drafter_obj`
    pass already-loaded models (tests); `runner` reuses the device side of an earlier engine (compiled programs,
    pools), whose sizes and dtypes then win. progress: print start-up lines and progress bars.
    """
    from dspark_jax.drafter import load_drafter
    from dspark_jax.runner import ModelRunner, RunnerConfig
    from dspark_jax.sharding import make_mesh
    from dspark_jax.target import dtype_name, load_target, resolve_dtype

    config = dataclasses.replace(config, **fields) if config is not None else EngineConfig(**fields)
    log.info("engine config: %s", config)
    say = (lambda msg: print(msg, flush=True)) if progress else (lambda msg: None)
    if runner is not None:
        policy = Policy.parse(config.scheduler or ("dspark" if runner.drafter is not None else "none"))
        max_model_len = config.max_model_len or (runner.max_pages * runner.page_size - runner.L - 1)
        return _engine_on(runner, policy, config, max_model_len, say, getattr(runner.target, "source", "target"),
                          progress)
    dtype = resolve_dtype(config.dtype, auto=None if target_obj is None else dtype_name(target_obj.dtype))
    if target_obj is not None and dtype != dtype_name(target_obj.dtype):
        raise ValueError(f"dtype={dtype} but the given target is {dtype_name(target_obj.dtype)}; load it in "
                         f"{dtype} or pass dtype='auto'")
    kv_dtype = resolve_dtype(config.kv_dtype, auto=dtype)
    log.info("dtype: %s (weights and activations), KV cache: %s", dtype, kv_dtype)
    # The mesh comes first so a tensor-parallel target streams straight into its shards (weights.load_sharded).
    mesh = make_mesh(*config.mesh_shape) if config.mesh_shape != (1, 1) else None
    target = target_obj if target_obj is not None else load_target(config.target, dtype, mesh=mesh)
    drafter_name = config.drafter
    if drafter_name == "auto" and drafter_obj is None:
        drafter_name = default_drafter(config.target) if target_obj is None else None
        log.info("drafter: %s", drafter_name or f"none (no drafter is shipped for {config.target}); serving the "
                 "target alone")
    has_drafter = drafter_name not in (None, "none") or drafter_obj is not None
    policy = Policy.parse(config.scheduler or ("dspark" if has_drafter else "none"))
    drafter = drafter_obj
    if drafter is None and drafter_name not in (None, "none") and policy.needs_drafter:
        say(f"loading drafter {drafter_name}")
        drafter = load_drafter(drafter_name, target)
    if not policy.needs_drafter:
        drafter = None
    if policy.needs_drafter and drafter is None:
        raise ValueError(f"scheduler {policy.kind!r} needs a drafter; pass --drafter")
    if drafter is not None:
        drafter.check_target(target)
    limit = target.config.max_position_embeddings
    max_model_len = config.max_model_len or min(limit, DEFAULT_MAX_MODEL_LEN)
    if max_model_len > limit:
        raise ValueError(f"max_model_len {max_model_len} exceeds the target's {limit}")
    block_size = drafter.config.block_size if drafter is not None else 0
    max_pages = -(-(max_model_len + block_size + 1) // config.page_size)
    runner_config = RunnerConfig(max_batch=config.max_batch, num_pages=config.num_pages or config.max_batch * max_pages,
                                 page_size=config.page_size, max_pages=max_pages, chunk_sizes=config.chunk_sizes,
                                 kernels=config.kernels, kv_dtype=kv_dtype)
    log.info("runner config: %s", runner_config)
    runner = ModelRunner(target, drafter, runner_config, mesh=mesh)
    name = config.target if target_obj is None else getattr(target, "source", "target")
    return _engine_on(runner, policy, config, max_model_len, say, name, progress)


def _bar(progress: bool, desc: str):
    """(update(done, total) or None, close): a progress bar on a terminal (dspark_jax/logs.py)."""
    if not progress:
        return None, lambda: None
    from dspark_jax.logs import progress_bar

    ctx = progress_bar(desc, unit="shape")
    return ctx.__enter__(), lambda: ctx.__exit__(None, None, None)


def _engine_on(runner, spec: Policy, config: EngineConfig, max_model_len: int, say, name: str,
               progress: bool) -> Engine:
    """Compiles (if not yet) and profiles the runner for the scheduler's mode, then starts an engine on it; with
    `config.background`, only what one request needs first (create_engine)."""
    background, profile, sps_table, sps_out = config.background, config.profile, config.sps_table, config.sps_out
    if spec.needs_drafter and runner.drafter is None:
        raise ValueError(f"scheduler {spec.kind!r} needs a drafter; this runner has none")
    mode = "topk" if spec.kind == "dspark" else "lengths"
    max_draft = spec.max_draft(runner.L)
    plain = spec.kind == "dspark"
    jobs = runner.warmup_jobs((mode,), max_draft=max_draft, plain=plain)
    t0 = time.perf_counter()
    if background:
        first = [j for j in jobs if _first_request_job(j, runner, mode, plain)]
        later = [j for j in jobs if j not in first]
    else:
        first, later = jobs, []
    update, close = _bar(progress, "compiling")
    for i, job in enumerate(first):
        runner.run_warmup_job(job)
        if update is not None:
            update(i + 1, len(first))
    warm_scheduler(spec, runner.batch_buckets, runner.L, runner.capacities[-1])
    close()
    say(f"compiled {len(first)} programs in {time.perf_counter() - t0:.1f}s"
        + (f"; {len(later)} more compile in the background" if later else ""))
    sps = None
    if sps_table is not None:
        sps = SpsTable.load(sps_table)
        if not sps.covers(runner.verify_shapes(max_draft)):
            raise ValueError(f"SPS table {sps_table} does not cover this engine's shapes; profile again")
    elif profile and not background:
        update, close = _bar(progress, "profiling")
        sps = _run_to_end(_profile(runner, mode, max_draft, plain, update))
        close()
    if sps is not None and sps_out:
        sps.save(sps_out)
    if sps is not None:
        say(_summary(runner, spec, sps, name))
    core = EngineCore(runner, scheduler=str(spec), max_model_len=max_model_len,
                      eos_token_ids=runner.target.eos_token_ids, sps=sps, max_waiting=config.max_waiting)
    work = None
    if later or (background and profile and sps is None):
        work = _background_startup(runner, core, spec, name, later, profile and sps is None, mode, max_draft,
                                   plain, sps_out)
        if spec.kind == "dspark" and profile and sps is None:
            core.scheduler.ready = False
            say("serving plain steps until the SPS table is profiled; then the dspark scheduler speculates")
    return Engine(core, model_name=name, tokenizer=runner.target.tokenizer, background=work).start()


def _profile(runner, mode: str, max_draft: int, plain: bool, progress=None):
    """Profiles the SPS table at every PROFILE_CONTEXTS length, a batch bucket at a time: a generator that yields
    after each bucket (so the engine's idle time can take it in steps) and returns the smoothed SpsTable."""
    entries, plain_sps = {}, {}
    for i, ctx in enumerate(PROFILE_CONTEXTS):
        for done, total, full, plain_steps in runner.profile_buckets(mode, context=ctx, max_draft=max_draft,
                                                                     plain=plain):
            entries.update({(bb, cap, ctx): v for (bb, cap), v in full.items()})
            plain_sps.update({(bb, ctx): v for bb, v in plain_steps.items()})
            if progress is not None:
                progress(i * total + done, total * len(PROFILE_CONTEXTS))
            yield
    return SpsTable(entries, plain_sps).smoothed()


def _run_to_end(work):
    """Runs a generator of start-up work (`_profile`) at once and returns what it returns."""
    while True:
        try:
            next(work)
        except StopIteration as done:
            return done.value


def _first_request_job(job: tuple, runner, mode: str, plain: bool) -> bool:
    """Whether a warm-up job serves one request under the start-up policy: prefill alone, and the batch-of-one
    programs of its steps (plain steps for the dspark scheduler, else its own mode)."""
    if job[0] == "prefill":
        return job[2] == 1
    if job[1] != runner.batch_buckets[0]:
        return False
    if job[0] == "advance":
        return True
    if plain:  # dspark: plain steps until the table is ready (no draft pass)
        return job[0] == "verify" and job[3] == "plain"
    return job[0] == "draft" or (job[0] == "verify" and job[3] == mode)


def _background_startup(runner, core: EngineCore, spec: Policy, name: str, jobs: list, profile: bool,
                        mode: str, max_draft: int, plain: bool, sps_out: str | None):
    """Start-up work left for the engine's idle time (`Engine._advance_background`), one small item per
    `next`: compile the remaining programs, then profile the SPS table a batch bucket at a time and hand it to
    the scheduler."""
    t0 = time.perf_counter()
    for job in jobs:
        runner.run_warmup_job(job)
        yield
    if jobs:
        log.info("compiled the other %d programs in the background in %.1fs", len(jobs), time.perf_counter() - t0)
    if not profile:
        return
    t0 = time.perf_counter()
    sps = yield from _profile(runner, mode, max_draft, plain)
    if sps_out:
        sps.save(sps_out)
    core.set_sps(sps)
    log.info("SPS table profiled in the background in %.1fs; %s", time.perf_counter() - t0,
             _summary(runner, spec, sps, name))


def _summary(runner, spec, sps: SpsTable, name: str) -> str:
    """One line: what is served and how fast the profile says a single request and a full batch will step."""
    from dspark_jax.target import dtype_name

    drafter = runner.drafter.config.kind if runner.drafter is not None else "none"
    ctx = sps.contexts[0] if sps.contexts else 0
    def fastest(b):  # a plain step if profiled, else the smallest pass of that batch bucket
        caps = [c for k, c, _ in sps.entries if k == b]
        return sps.plain_at(b, ctx) or (sps.at(b, min(caps), ctx) if caps else 0.0)

    bb = runner.batch_buckets[-1]
    one, full = fastest(1), fastest(bb)
    return (f"serving {name} (drafter: {drafter}, scheduler: {spec}, max batch {runner.B}, "
            f"{dtype_name(runner.target.dtype)}, KV cache {runner.kv_dtype}): profiled "
            f"{one:.1f} plain steps/s for one request, {full * bb:.0f} tokens/s for a full batch of {bb} "
            f"(context {ctx}, before speculation)")
