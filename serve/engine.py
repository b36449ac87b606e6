"""The serving engine: continuous batching with chunked prefill, paged KV, preemption and the schedulers.

`EngineCore` is the host-side state machine, driven by `step()`; it talks to a runner (serve/runner.py, or a
mock in tests) through three calls: `prefill`, `draft` and `step`. `Engine` wraps it in a background thread
and implements the server contract (serve/types.py). One `step()`:
  1. aborts      — cancelled requests leave at once; their pages return to the free list.
  2. admission   — waiting requests take free slots (FIFO) when the pool holds their prompt.
  3. prefill     — one chunk (≤ the largest chunk bucket) of the oldest prefilling request: chunked prefill is
                   interleaved with decoding so running requests keep streaming while a long prompt loads.
  4. decode      — every running request gets pages for its next block (n + L + 1 positions); when the pool is
                   short the most recently admitted running request is preempted (pages freed; it re-queues
                   first in line and, readmitted, recomputes its prompt + generated tokens). Then the scheduler
                   sets ℓ per request (or the capacity K), the pass runs in the smallest bucket that fits, and
                   emitted tokens are streamed, checked against stops and committed (n ← n + m + 1).
Sampling keys: request r's stream is key(seed_r) folded with its round number, so a seeded request gives the
same tokens whatever else is in the batch.
"""

from __future__ import annotations

import collections
import dataclasses
import itertools
import logging
import os
import threading
import time

import numpy as np

from dspark_jax.verification import acceptance_counts
from serve.pages import PageAllocator
from serve.scheduler import SchedulerSpec, dspark_capacity, host_lengths, pick_bucket, token_sps_table
from serve.types import EngineRequest, RequestOutput

log = logging.getLogger("dspark_jax.serve")


@dataclasses.dataclass(eq=False)
class _Req:
    req: EngineRequest
    key: np.ndarray  # uint32 [2]
    prompt: list[int]  # tokens to (re)compute into the cache
    anchor: int | None = None  # set when resuming after preemption
    generated: list[int] = dataclasses.field(default_factory=list)
    prefilled: int = 0
    committed: int = 0  # n: tokens in the cache
    slot: int = -1
    rounds: int = 0
    admitted_at: int = 0
    done: bool = False

    @property
    def rid(self) -> str:
        return self.req.request_id


class EngineCore:
    def __init__(self, runner, *, scheduler: str, max_batch: int, num_pages: int, page_size: int,
                 max_model_len: int, eos_token_ids=(), sps: dict[int, float] | None = None):
        self.runner = runner
        self.spec = SchedulerSpec.parse(scheduler)
        self.L = runner.L
        if self.spec.needs_drafter and self.L == 0:
            raise ValueError(f"scheduler {scheduler!r} needs a drafter")
        if self.spec.needs_confidence and runner.drafter is not None and not runner.drafter.config.confidence:
            raise ValueError(f"scheduler {scheduler!r} needs a confidence head; this "
                             f"{runner.drafter.config.kind} drafter has none")
        self.B, self.max_model_len = max_batch, max_model_len
        self.pages = PageAllocator(num_pages, page_size, runner.max_pages)
        if self.pages.pages_for(max_model_len + self.L + 1) > min(num_pages, runner.max_pages):
            raise ValueError(f"{num_pages} pages of {page_size} (max {runner.max_pages} per request) cannot hold "
                             f"one request of max_model_len={max_model_len} plus a block of {self.L + 1}")
        self.eos = {int(e) for e in eos_token_ids}
        self.capacities = runner.capacities
        self.set_sps(sps or {c: 1.0 for c in self.capacities})
        self.waiting: collections.deque[_Req] = collections.deque()
        self.prefilling: list[_Req] = []
        self.running: list[_Req] = []
        self.slots: list[_Req | None] = [None] * max_batch
        self.by_id: dict[str, _Req] = {}
        self._aborts: set[str] = set()
        self._lock = threading.Lock()
        self._admit_counter = itertools.count()
        self._conf_history: collections.deque = collections.deque(maxlen=2)  # (slot owners, conf [B, L])
        self.stats = collections.Counter()
        self.attempts, self.accepts = np.zeros(max(self.L, 1), np.int64), np.zeros(max(self.L, 1), np.int64)

    # ---- configuration ---------------------------------------------------------------------------------------
    def set_sps(self, sps: dict[int, float]) -> None:
        self.sps = {int(k): float(v) for k, v in sps.items()}
        self.sps_table = token_sps_table([self.sps[c] for c in self.capacities], self.capacities)

    # ---- thread-safe API -------------------------------------------------------------------------------------
    def add_request(self, request: EngineRequest) -> None:
        p = request.params
        n = len(request.prompt_ids)
        if n == 0:
            raise ValueError("the prompt is empty")
        if p.max_tokens < 1:
            raise ValueError(f"max_tokens must be >= 1, got {p.max_tokens}")
        if n + p.max_tokens > self.max_model_len:
            raise ValueError(f"prompt ({n} tokens) + max_tokens ({p.max_tokens}) exceeds the model's context of "
                             f"{self.max_model_len} tokens")
        seed = p.seed if p.seed is not None else int.from_bytes(os.urandom(4), "little")
        key = np.array([0, seed & 0xFFFFFFFF], np.uint32)  # threefry key data of jax.random.key(seed)
        r = _Req(req=request, key=key, prompt=list(request.prompt_ids))
        with self._lock:
            if request.request_id in self.by_id:
                raise ValueError(f"duplicate request id {request.request_id!r}")
            self.by_id[request.request_id] = r
            self.waiting.append(r)
            self.stats["requests_total"] += 1
            self.stats["prompt_tokens_total"] += n

    def abort(self, request_id: str) -> None:
        with self._lock:
            self._aborts.add(request_id)

    def has_work(self) -> bool:
        with self._lock:
            return bool(self.waiting or self.prefilling or self.running or self._aborts)

    # ---- bookkeeping -------------------------------------------------------------------------------------------
    def _emit(self, r: _Req, tokens: list[int], finish: str | None = None, error: str | None = None) -> None:
        try:
            r.req.on_output(RequestOutput(request_id=r.rid, token_ids=tuple(tokens), finish_reason=finish,
                                          error=error))
        except Exception:  # a broken consumer must not take the engine down
            log.exception("on_output callback of %s failed", r.rid)

    def _release(self, r: _Req) -> None:
        self.pages.free(r.rid)
        if r.slot >= 0:
            self.slots[r.slot] = None
            r.slot = -1
        for lst in (self.prefilling, self.running):
            if r in lst:
                lst.remove(r)
        with self._lock:
            if r in self.waiting:
                self.waiting.remove(r)

    def _finish(self, r: _Req, tokens: list[int], reason: str, error: str | None = None) -> None:
        r.done = True
        self._release(r)
        with self._lock:
            self.by_id.pop(r.rid, None)
        self._emit(r, tokens, reason, error)

    def _take(self, r: _Req, tokens) -> tuple[list[int], str | None]:
        """Appends emitted tokens up to a stop; returns (tokens to stream, finish reason or None)."""
        p = r.req.params
        stops = set(p.stop_token_ids) | (set() if p.ignore_eos else self.eos)
        out = []
        for t in tokens:
            t = int(t)
            if t in stops:
                return out, "stop"
            r.generated.append(t)
            out.append(t)
            if len(r.generated) >= p.max_tokens:
                return out, "length"
            if len(r.req.prompt_ids) + len(r.generated) >= self.max_model_len:
                return out, "length"
        return out, None

    def _process_aborts(self) -> None:
        with self._lock:
            ids, self._aborts = self._aborts, set()
        for rid in ids:
            r = self.by_id.get(rid)
            if r is not None and not r.done:
                self.stats["aborted_total"] += 1
                self._finish(r, [], "abort")

    def _admit(self) -> None:
        while self.waiting and None in self.slots:
            r = self.waiting[0]
            if not self.pages.ensure(r.rid, len(r.prompt) + self.L + 1):
                break
            self.waiting.popleft()
            r.slot = self.slots.index(None)
            self.slots[r.slot] = r
            r.admitted_at = next(self._admit_counter)
            r.prefilled = 0
            self.prefilling.append(r)

    def _prefill_one(self) -> None:
        r = self.prefilling[0]
        chunk = r.prompt[r.prefilled : r.prefilled + self.runner.chunk_sizes[-1]]
        p = r.req.params
        tok = self.runner.prefill(chunk, r.prefilled, self.pages.table_row(r.rid, self.pages.num_pages), r.key,
                                  p.temperature, p.top_k, p.top_p)
        r.prefilled += len(chunk)
        self.stats["prefill_chunks_total"] += 1
        if r.prefilled < len(r.prompt):
            return
        self.prefilling.pop(0)
        r.committed = len(r.prompt)
        if r.anchor is None:  # a fresh request: the prefill's token is its first output
            out, reason = self._take(r, [tok])
            self.stats["generation_tokens_total"] += len(out)
            if reason is not None:
                self._finish(r, out, reason)
                return
            self._emit(r, out)
            r.anchor = tok
        self.running.append(r)

    def _preempt_for(self, need: dict) -> list[_Req]:
        """Gives every running request pages for its next block, preempting the newest ones when short."""
        while True:
            short = [r for r in self.running if not self.pages.ensure(r.rid, need[r.rid])]
            if not short:
                return self.running
            victim = max(self.running + self.prefilling, key=lambda x: x.admitted_at)
            self.stats["preemptions_total"] += 1
            log.info("preempting %s (pool short of pages)", victim.rid)
            self._release(victim)
            if victim.generated:  # recompute prompt + generated[:-1]; the last generated token is the anchor
                victim.prompt = list(victim.req.prompt_ids) + victim.generated[:-1]
                victim.anchor = victim.generated[-1]
            victim.prefilled = 0
            self.waiting.appendleft(victim)
            if not self.running:
                return []

    def _slot_batch(self, running):
        b = self.runner.idle_batch()
        for r in running:
            s = r.slot
            p = r.req.params
            b.active[s] = True
            b.lengths[s], b.anchors[s] = r.committed, r.anchor
            b.block_tables[s] = self.pages.table_row(r.rid, self.pages.num_pages)
            b.temperature[s], b.top_k[s], b.top_p[s] = p.temperature, p.top_k, p.top_p
            b.keys[s], b.rounds[s] = r.key, r.rounds + 1
        return b

    def _decode(self) -> None:
        need = {r.rid: r.committed + self.L + 1 for r in self.running}
        running = self._preempt_for(need)
        if not running:
            return
        b = self._slot_batch(running)
        R = len(running)
        spec = self.spec
        drafts = budget = lengths = dev = None
        if spec.kind == "dspark":
            stale = self._stale_confidence(running)
            budget = min(dspark_capacity(stale, b.active, self.L, self.sps_table), self.capacities[-1] - R)
            capacity = pick_bucket(R + budget, self.capacities)
        else:
            conf = None
            if spec.syncs_on_drafts:
                dev = self.runner.device_batch(b)
                drafts = self.runner.draft(b, dev)
                conf = np.asarray(drafts[2])
            lengths = host_lengths(spec, conf, b.active, self.L, self.sps_table)
            capacity = pick_bucket(int(R + lengths.sum()), self.capacities)
        res = self.runner.step(b, capacity=capacity, lengths=lengths, budget=budget, drafts=drafts, dev=dev,
                               want_confidence=spec.kind == "dspark")
        if res.confidence is not None:
            self._conf_history.append(({r.slot: r.rid for r in running}, res.confidence))
        self.stats["steps_total"] += 1
        self.stats["verify_tokens_total"] += int(R + res.lengths[b.active].sum())
        self.stats["capacity_tokens_total"] += capacity
        self.stats["row_steps_total"] += R
        if self.L:
            tried, took = acceptance_counts(res.lengths, res.num_accepted, b.active, self.L)
            self.attempts += tried
            self.accepts += took
        for r in list(running):
            s = r.slot
            m = int(res.num_accepted[s])
            emitted = [int(t) for t in res.emitted[s, : res.num_emitted[s]]]
            self.stats["emitted_total"] += len(emitted)
            r.rounds += 1
            r.committed += m + 1
            r.anchor = emitted[-1]
            out, reason = self._take(r, emitted)
            self.stats["generation_tokens_total"] += len(out)
            if reason is not None:
                self._finish(r, out, reason)
            elif out:
                self._emit(r, out)

    def _stale_confidence(self, running):
        """Confidences two steps old, per slot; rows whose slot changed owner since then count as unknown (1)."""
        if len(self._conf_history) < 2:
            return None
        owners, conf = self._conf_history[0]
        conf = conf.copy()
        for r in running:
            if owners.get(r.slot) != r.rid:
                conf[r.slot] = 1.0
        return conf

    def step(self) -> bool:
        """One engine iteration; returns whether anything ran."""
        self._process_aborts()
        with self._lock:
            self._admit()
        worked = False
        if self.prefilling:
            self._prefill_one()
            worked = True
        if self.running:
            self._decode()
            worked = True
        return worked

    def fail_all(self, message: str) -> None:
        for r in list(self.by_id.values()):
            if not r.done:
                self._finish(r, [], "abort", error=message)

    def metrics(self) -> dict:
        s = self.stats
        rows = max(s["row_steps_total"], 1)
        return {
            "requests_total": s["requests_total"], "requests_running": len(self.running) + len(self.prefilling),
            "requests_waiting": len(self.waiting), "prompt_tokens_total": s["prompt_tokens_total"],
            "generation_tokens_total": s["generation_tokens_total"], "steps_total": s["steps_total"],
            "tokens_per_step": s["emitted_total"] / rows,
            "acceptance_per_position": (self.accepts / np.maximum(self.attempts, 1)).tolist() if self.L else [],
            "verify_tokens_per_pass": s["verify_tokens_total"] / max(s["steps_total"], 1),
            "sps_table": dict(self.sps), "free_pages": self.pages.num_free, "total_pages": self.pages.num_pages,
            "preemptions_total": s["preemptions_total"], "aborted_total": s["aborted_total"],
        }


class Engine:
    """EngineCore in a background thread: the object the HTTP server talks to (serve/types.EngineLike)."""

    def __init__(self, core: EngineCore, *, model_name: str, tokenizer=None, chat_template=None):
        self.core, self.model_name, self.tokenizer, self.chat_template = core, model_name, tokenizer, chat_template
        self.max_model_len = core.max_model_len
        self._wake = threading.Event()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="dspark-engine", daemon=True)
        self._alive = False

    def core_only(self) -> EngineCore:
        """Stops the thread and hands back the core, to be driven by `step()` directly (tests, benchmarks)."""
        self.stop()
        return self.core

    def start(self) -> Engine:
        self._alive = True
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        self._wake.set()
        self._thread.join(timeout=30)

    def _loop(self) -> None:
        try:
            while not self._stop.is_set():
                if not self.core.step():
                    self._wake.wait(0.05)
                    self._wake.clear()
        except Exception as e:  # a device error: fail every request loudly rather than hang them
            log.exception("engine loop died")
            self.core.fail_all(f"engine error: {type(e).__name__}: {e}")
        finally:
            self._alive = False

    def add_request(self, request: EngineRequest) -> None:
        if not self._alive:
            raise RuntimeError("the engine is not running")
        self.core.add_request(request)
        self._wake.set()

    def abort(self, request_id: str) -> None:
        self.core.abort(request_id)
        self._wake.set()

    def metrics(self) -> dict:
        return self.core.metrics()

    def health(self) -> bool:
        return self._alive and self._thread.is_alive()

    def idle(self) -> bool:
        return not self.core.has_work()

    def wait_idle(self, timeout: float = 60.0) -> bool:
        t0 = time.monotonic()
        while time.monotonic() - t0 < timeout:
            if not self.core.has_work():
                return True
            time.sleep(0.01)
        return False


def capacity_buckets(max_batch: int, block_size: int) -> tuple[int, ...]:
    """Static verification capacities: powers of two from 4 up to, and including, max_batch · (L + 1)."""
    top = max_batch * (block_size + 1)
    return tuple(sorted({c for c in (4, 8, 16, 32, 64, 128, 256, 512, 1024) if c < top} | {top}))


def create_engine(*, target: str = "smollm2-135m-instruct", drafter: str | None = "smollm2-135m-instruct/dspark",
                  scheduler: str = "dspark", max_batch: int = 16, max_model_len: int = 2048, page_size: int = 16,
                  num_pages: int | None = None, kernels: str = "auto", mesh_shape: tuple[int, int] = (1, 1),
                  chunk_sizes: tuple[int, ...] = (32, 128), profile: bool = True, progress: bool = True,
                  target_obj=None, drafter_obj=None, runner=None) -> Engine:
    """Loads target and drafter, precompiles every bucket, profiles SPS, and starts the engine thread.

    `target_obj` / `drafter_obj` pass already-loaded models (tests); `drafter=None` or "none" serves the target
    alone (only the `none` scheduler then). `mesh_shape` = (data, model) devices (tensor parallel over `model`).
    `runner` reuses the device side (models, page pools, compiled programs) of an earlier engine, e.g. to compare
    schedulers without recompiling; its sizes then win over the size arguments.
    """
    from dspark_jax.drafter import load_drafter
    from dspark_jax.sharding import make_mesh
    from dspark_jax.target import load_target
    from serve.runner import ModelRunner

    spec = SchedulerSpec.parse(scheduler)
    say = (lambda msg: print(msg, flush=True)) if progress else (lambda msg: None)
    if max_batch < 1 or max_model_len < 2 or page_size < 1:
        raise ValueError(f"bad engine sizes: {max_batch=}, {max_model_len=}, {page_size=}")
    if runner is not None:
        return _engine_on(runner, spec, scheduler, max_model_len, profile, say,
                          getattr(runner.target, "source", "target"))
    tgt = target_obj if target_obj is not None else load_target(target)
    drf = drafter_obj
    if drf is None and drafter not in (None, "none") and spec.needs_drafter:
        say(f"loading drafter {drafter}")
        drf = load_drafter(drafter, tgt)
    if not spec.needs_drafter:
        drf = None
    if drf is not None:
        drf.check_target(tgt)
    if max_model_len > tgt.config.max_position_embeddings:
        raise ValueError(f"max_model_len {max_model_len} exceeds the target's {tgt.config.max_position_embeddings}")
    L = drf.config.block_size if drf is not None else 0
    max_pages = -(-(max_model_len + L + 1) // page_size)
    num_pages = num_pages or max_batch * max_pages
    mesh = make_mesh(*mesh_shape) if mesh_shape != (1, 1) else None
    runner = ModelRunner(tgt, drf, max_batch=max_batch, num_pages=num_pages, page_size=page_size,
                         max_pages=max_pages, capacities=capacity_buckets(max_batch, L),
                         chunk_sizes=tuple(sorted(chunk_sizes)), kernels=kernels, mesh=mesh)
    name = target if target_obj is None else getattr(tgt, "source", "target")
    return _engine_on(runner, spec, scheduler, max_model_len, profile, say, name)


def _engine_on(runner, spec: SchedulerSpec, scheduler: str, max_model_len: int, profile: bool, say,
               name: str) -> Engine:
    """Compiles (if not yet) and profiles the runner for the scheduler's mode, then starts an engine on it."""
    if spec.needs_drafter and runner.drafter is None:
        raise ValueError(f"scheduler {scheduler!r} needs a drafter; this runner has none")
    mode = "topk" if spec.kind == "dspark" else "lengths"
    t0 = time.perf_counter()
    say(f"compiling {len(runner.capacities)} capacity buckets {list(runner.capacities)} and "
        f"{len(runner.chunk_sizes)} prefill chunks {list(runner.chunk_sizes)} ...")
    runner.warmup((mode,))
    say(f"compiled in {time.perf_counter() - t0:.1f}s")
    sps = None
    if profile:
        sps = runner.profile_sps(mode)
        say("SPS table (capacity → steps/s): " + ", ".join(f"{c}: {v:.2f}" for c, v in sps.items()))
    core = EngineCore(runner, scheduler=scheduler, max_batch=runner.B, num_pages=runner.tkv.num_pages,
                      page_size=runner.page_size, max_model_len=max_model_len,
                      eos_token_ids=runner.target.eos_token_ids, sps=sps)
    return Engine(core, model_name=name, tokenizer=runner.target.tokenizer).start()
