"""The serving engine: continuous batching with chunked prefill, paged KV, preemption and the schedulers.

`EngineCore` is the host-side state machine, driven by `step()`; it drives a runner (the `Runner` protocol of
serve/runner_api.py: dspark_jax/runner.py, or the numpy mock in tests) and asks a scheduler (serve/scheduler.py)
for each round's `Plan`. `Engine` wraps it in a background thread and implements the server contract
(serve/types.py). Building one (loading models, compiling, profiling: `create_engine`) is serve/startup.py's.
One `step()`:
  1. aborts      — cancelled requests leave at once; their pages return to the free list.
  2. admission   — waiting requests take free slots (FIFO) when the pool holds their prompt.
  3. prefill     — one pass of ≤ the largest chunk bucket of prompt tokens, filled oldest prefilling request
                   first, each with as much of its remaining prompt as fits (so a burst of short prompts
                   prefills many to a pass, a long one in chunks); interleaved with decoding so running
                   requests keep streaming while a long prompt loads.
  4. decode      — every running request gets pages for its next block (n + L + 1 positions); when the pool is
                   short the most recently admitted running request is preempted (pages freed; it re-queues
                   first in line and, readmitted, recomputes its prompt + generated tokens). Then the scheduler
                   plans the round (plain, probe, or speculative with ℓ per request or a capacity K), the pass
                   runs in that bucket, and emitted tokens are streamed, checked against stops and committed
                   (n ← n + m + 1).
Sampling keys: request r's stream is key(seed_r) folded with its round number, so a seeded request gives the
same tokens whatever else is in the batch.
"""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import itertools
import logging
import os
import threading
import time

import numpy as np

from dspark_jax.keys import request_key_data
from dspark_jax.penalties import Penalties, check_frequency_penalty, check_presence_penalty, check_repetition_penalty
from dspark_jax.runner import PrefillItem, bias_rows, penalty_rows
from dspark_jax.sampling import TokenBias, check_logit_bias, check_min_p, check_min_tokens, check_params
from dspark_jax.verification import acceptance_counts
from serve.pages import PageAllocator
from serve.runner_api import Runner
from serve.scheduler import Plan, RoundInfo, Scheduler, StepKind, make_scheduler
from serve.sps_table import SpsTable
from serve.types import (
    MAX_LOGPROBS,
    EngineRequest,
    InvalidRequest,
    QueueFull,
    RequestOutput,
    SamplingParams,
    TokenLogprob,
)

log = logging.getLogger("dspark_jax.serve")


@contextlib.contextmanager
def _field(param: str):
    """A shared check's ValueError, re-raised as InvalidRequest naming the request field `param`."""
    try:
        yield
    except ValueError as e:
        raise InvalidRequest(str(e), param) from None


@dataclasses.dataclass
class _Round:
    """A dispatched round: the runner's device outputs, its requests in row order, the device batch it ran
    with, its pass index, R rows in a batch bucket of Bb, the plan, whether logprobs are read back."""

    out: object
    running: list
    dev: dict | None
    index: int
    R: int
    Bb: int
    plan: Plan
    want_logprobs: bool = False


@dataclasses.dataclass(eq=False)
class _Req:
    req: EngineRequest
    key: np.ndarray  # uint32 [2] (dspark_jax/keys.py)
    prompt: list[int]  # tokens to (re)compute into the cache
    anchor: int | None = None  # set when resuming after preemption
    generated: list[int] = dataclasses.field(default_factory=list)
    prefilled: int = 0
    committed: int = 0  # n: tokens in the cache
    rounds: int = 0
    admitted_at: int = 0
    done: bool = False
    prompt_logprobs: list | None = None  # TokenLogprob per prompt position prefilled so far (when asked)
    stops: frozenset = frozenset()  # token ids that end it (its stop ids, and EOS unless ignored; `_take`)
    bias: TokenBias | None = None  # its logit bias and min_tokens bans
    penalties: Penalties | None = None  # its repetition, frequency and presence penalties (None: off)
    stop_token: TokenLogprob | None = None  # the one that ended it (`_take`)

    @property
    def rid(self) -> str:
        return self.req.request_id


def _token_logprob(token: int, lp, idx: tuple, k: int) -> TokenLogprob:
    """TokenLogprob of `token` from a program's logprob arrays (chosen [...], top ids / logprobs [..., NTOP]) at
    index `idx` (() for prefill's one token, (row, position) for a verify pass, (j,) for prompt row j), keeping
    the top k."""
    chosen, ids, vals = lp
    top = tuple((int(i), float(v)) for i, v in zip(ids[idx][:k], vals[idx][:k], strict=True))
    return TokenLogprob(token_id=int(token), logprob=float(chosen[idx]), top=top)


class EngineCore:
    """The engine's host state machine over a runner (sizes, pools and programs come from it).

    scheduler: a policy string (`--scheduler`) or a Scheduler. sps: the scheduler's cost model (`set_sps`).
    pipelined: chain rounds on device (the next dispatched before this one is read back); False reads every
    round back first (diagnosis: scripts/bench_pipelining.py, scripts/bench_host.py)."""

    def __init__(self, runner: Runner, *, scheduler: str | Scheduler, max_model_len: int, eos_token_ids=(),
                 sps: SpsTable | dict | None = None, max_waiting: int | None = None, pipelined: bool = True):
        self.runner = runner
        self.L = runner.L
        if isinstance(scheduler, str):
            scheduler = make_scheduler(scheduler, block_size=self.L, capacities=runner.capacities,
                                       batch_buckets=runner.batch_buckets)
        self.scheduler = scheduler
        policy = scheduler.policy
        if policy.needs_drafter and self.L == 0:
            raise ValueError(f"scheduler {str(policy)!r} needs a drafter")
        if policy.needs_confidence and runner.drafter is not None and not runner.drafter.config.confidence:
            raise ValueError(f"scheduler {str(policy)!r} needs a confidence head; this "
                             f"{runner.drafter.config.kind} drafter has none")
        self.B, self.max_model_len, self.max_waiting = runner.B, max_model_len, max_waiting
        self.vocab_size = runner.target.config.vocab_size
        num_pages = runner.num_pages
        self.pages = PageAllocator(num_pages, runner.page_size, runner.max_pages)
        if self.pages.pages_for(max_model_len + self.L + 1) > min(num_pages, runner.max_pages):
            raise ValueError(f"{num_pages} pages of {runner.page_size} (max {runner.max_pages} per request) cannot "
                             f"hold one request of max_model_len={max_model_len} plus a block of {self.L + 1}")
        self.eos = {int(e) for e in eos_token_ids}
        self.capacities = runner.capacities
        if sps is not None:
            self.set_sps(sps)
        self.waiting: collections.deque[_Req] = collections.deque()
        self.prefilling: list[_Req] = []
        self.running: list[_Req] = []
        self.by_id: dict[str, _Req] = {}
        self._aborts: set[str] = set()
        self._lock = threading.Lock()
        self._admit_counter = itertools.count()
        self.pipelined = pipelined
        self._inflight: _Round | None = None  # a dispatched round not yet read back
        self._stepping = False
        self.stats = collections.Counter()
        self.attempts, self.accepts = np.zeros(max(self.L, 1), np.int64), np.zeros(max(self.L, 1), np.int64)

    # ---- configuration ---------------------------------------------------------------------------------------
    def set_sps(self, sps: SpsTable | dict | None) -> None:
        """The scheduler's cost model: an SpsTable, a {capacity: steps/s} dict (the same for every batch bucket
        and context: tests, hand-made tables), or None (flat until profiled or loaded)."""
        self.scheduler.set_sps(sps)

    # ---- thread-safe API -------------------------------------------------------------------------------------
    def validate(self, request: EngineRequest) -> EngineRequest:
        """Checks a request against this engine (token ids, lengths, sampling values) and normalises its
        sampling parameters: temperature < 1e-5 is greedy, top_k beyond the vocabulary (or −1) is off.
        Raises InvalidRequest (a ValueError) with a message meant for the client, naming the field at fault."""
        return self._checked(request)[0]

    def _checked(self, request: EngineRequest) -> tuple[EngineRequest, TokenBias | None]:
        """`validate`, and the request's logit bias with its min_tokens bans (`TokenBias.of`)."""
        p, V = request.params, self.vocab_size
        ids = request.prompt_ids
        n = len(ids)
        if n == 0:
            raise InvalidRequest("the prompt is empty")
        bad = next((t for t in ids if not (isinstance(t, (int, np.integer)) and 0 <= t < V)), None)
        if bad is not None:
            raise InvalidRequest(f"prompt token id {bad!r} is outside the vocabulary [0, {V})")
        bad = next((t for t in p.stop_token_ids if not (isinstance(t, (int, np.integer)) and 0 <= t < V)), None)
        if bad is not None:
            raise InvalidRequest(f"stop token id {bad!r} is outside the vocabulary [0, {V})", "stop_token_ids")
        if not isinstance(p.max_tokens, (int, np.integer)) or p.max_tokens < 0:
            raise InvalidRequest(f"max_tokens must be an integer >= 0, got {p.max_tokens!r}", "max_tokens")
        if n + p.max_tokens > self.max_model_len:
            raise InvalidRequest(f"prompt ({n} tokens) + max_tokens ({p.max_tokens}) exceeds the model's context "
                                 f"of {self.max_model_len} tokens", "max_tokens")
        with _field("temperature/top_k/top_p"):
            temperature, top_k, _ = check_params(p.temperature, p.top_k, p.top_p, vocab=V)
        with _field("min_p"):
            min_p = check_min_p(p.min_p)
        with _field("logit_bias"):
            logit_bias = check_logit_bias(p.logit_bias, V) or None
        with _field("min_tokens"):  # min_tokens out of range, or its bans and logit_bias overflow the bias table
            min_tokens = check_min_tokens(p.min_tokens, p.max_tokens)
            bias = TokenBias.of(logit_bias, stop_ids=self._stops(p), prompt_len=n, min_tokens=min_tokens)
        with _field("presence_penalty"):
            presence = check_presence_penalty(p.presence_penalty)
        with _field("frequency_penalty"):
            frequency = check_frequency_penalty(p.frequency_penalty)
        with _field("repetition_penalty"):
            repetition = check_repetition_penalty(p.repetition_penalty)
        if (presence, frequency, repetition) != (0.0, 0.0, 1.0) and not getattr(
                getattr(self.runner, "config", None), "penalties", True):
            raise InvalidRequest("this engine's runner was built without penalties (RunnerConfig.penalties=False)",
                                 "presence_penalty" if presence else "frequency_penalty" if frequency
                                 else "repetition_penalty")
        if p.seed is not None:
            with _field("seed"):
                request_key_data(p.seed)  # raises for seeds outside 64 bits
        for name in ("logprobs", "prompt_logprobs"):
            k = getattr(p, name)
            if k is not None and not (isinstance(k, (int, np.integer)) and 0 <= k <= MAX_LOGPROBS):
                raise InvalidRequest(f"{name} must be in [0, {MAX_LOGPROBS}], got {k!r}", name)
        params = dataclasses.replace(p, temperature=temperature, top_k=top_k, min_p=min_p, logit_bias=logit_bias,
                                     presence_penalty=presence, frequency_penalty=frequency,
                                     repetition_penalty=repetition)
        return dataclasses.replace(request, prompt_ids=[int(x) for x in ids], params=params), bias

    def add_request(self, request: EngineRequest) -> None:
        request, bias = self._checked(request)
        p = request.params
        seed = p.seed if p.seed is not None else int.from_bytes(os.urandom(8), "little")
        penalties = Penalties(p.presence_penalty, p.frequency_penalty, p.repetition_penalty)
        r = _Req(req=request, key=request_key_data(seed), prompt=list(request.prompt_ids), stops=self._stops(p),
                 bias=bias, penalties=penalties if penalties.active else None)
        with self._lock:
            if request.request_id in self.by_id:
                raise ValueError(f"duplicate request id {request.request_id!r}")
            if self.max_waiting is not None and len(self.waiting) >= self.max_waiting:
                raise QueueFull(f"{len(self.waiting)} requests are already waiting")
            self.by_id[request.request_id] = r
            self.waiting.append(r)
            self.stats["requests_total"] += 1
            self.stats["prompt_tokens_total"] += len(request.prompt_ids)

    def abort(self, request_id: str) -> None:
        with self._lock:
            self._aborts.add(request_id)

    def has_work(self) -> bool:
        with self._lock:
            return bool(self.waiting or self.prefilling or self.running or self._aborts or self._inflight
                        or self._stepping)

    # ---- bookkeeping -------------------------------------------------------------------------------------------
    def _emit(self, r: _Req, tokens: list[int], finish: str | None = None, error: str | None = None,
              logprobs=None, status: int | None = None, prompt_logprobs=None, stop_token=None) -> None:
        try:
            r.req.on_output(RequestOutput(request_id=r.rid, token_ids=tuple(tokens), finish_reason=finish,
                                          error=error, status=status,
                                          logprobs=tuple(logprobs) if logprobs is not None else None,
                                          prompt_logprobs=tuple(prompt_logprobs) if prompt_logprobs else None,
                                          stop_token=stop_token))
        except Exception:  # a broken consumer must not take the engine down
            log.exception("on_output callback of %s failed", r.rid)

    def _release(self, r: _Req) -> None:
        self.pages.free(r.rid)
        for lst in (self.prefilling, self.running):
            if r in lst:
                lst.remove(r)
        with self._lock:
            if r in self.waiting:
                self.waiting.remove(r)

    def _finish(self, r: _Req, tokens: list[int], reason: str, error: str | None = None, logprobs=None,
                status: int | None = None, prompt_logprobs=None) -> None:
        r.done = True
        self._release(r)
        with self._lock:
            self.by_id.pop(r.rid, None)
        self._emit(r, tokens, reason, error, logprobs, status, prompt_logprobs, r.stop_token)

    def _stops(self, p: SamplingParams) -> frozenset:
        """The token ids that end a request: its stop ids, and EOS unless it ignores EOS."""
        return frozenset(p.stop_token_ids) | (frozenset() if p.ignore_eos else frozenset(self.eos))

    def _take(self, r: _Req, tokens: list[int], logprobs=None) -> tuple[list[int], list | None, str | None]:
        """Appends emitted tokens up to a stop; returns (tokens to stream, their logprobs, finish reason). A stop
        token ends them and is kept in `r.stop_token` (RequestOutput.stop_token), not among the tokens."""
        p = r.req.params
        stops = r.stops
        room = min(p.max_tokens, self.max_model_len - len(r.req.prompt_ids)) - len(r.generated)
        if len(tokens) < room and stops.isdisjoint(tokens):  # the common case: no stop, no limit reached
            r.generated += tokens
            return tokens, (list(logprobs) if logprobs is not None else None), None
        out, lps = [], ([] if p.logprobs is not None else None)
        for i, t in enumerate(tokens):
            t = int(t)
            if t in stops:
                r.stop_token = logprobs[i] if logprobs is not None else TokenLogprob(token_id=t, logprob=None)
                return out, lps, "stop"
            r.generated.append(t)
            out.append(t)
            if lps is not None:
                lps.append(logprobs[i])
            if len(r.generated) >= p.max_tokens:
                return out, lps, "length"
            if len(r.req.prompt_ids) + len(r.generated) >= self.max_model_len:
                return out, lps, "length"
        return out, lps, None

    def _process_aborts(self) -> None:
        with self._lock:
            ids, self._aborts = self._aborts, set()
        for rid in ids:
            r = self.by_id.get(rid)
            if r is not None and not r.done:
                self.stats["aborted_total"] += 1
                self._finish(r, [], "abort")

    def _admit(self) -> None:
        while self.waiting and len(self.prefilling) + len(self.running) < self.B:
            r = self.waiting[0]
            if not self.pages.ensure(r.rid, len(r.prompt) + self.L + 1):
                break
            self.waiting.popleft()
            r.admitted_at = next(self._admit_counter)
            r.prefilled = 0
            self.prefilling.append(r)

    def _prefill_batch(self) -> list[tuple[_Req, int]]:
        """The prefilling requests the next pass packs, with how many of their prompt tokens: oldest first, each
        as much of its remaining prompt as the pass has room for (≤ the largest chunk bucket in all; vLLM's
        token budget), up to the runner's requests per pass and while the runner says they pack well
        (`prefill_fits`)."""
        budget, most = self.runner.chunk_sizes[-1], self.runner.prefill_rows[-1]
        batch, used = [], 0
        for r in self.prefilling:
            n = min(len(r.prompt) - r.prefilled, budget - used)
            if batch and not self.runner.prefill_fits([m for _, m in batch] + [n]):
                break
            batch.append((r, n))
            used += n
            if len(batch) == most or used == budget:
                break
        return batch

    def _prefill_item(self, r: _Req, n: int) -> PrefillItem:
        """`r`'s next n prompt tokens as a runner item, with its sampling values and what it asked to score."""
        start = r.prefilled
        chunk = r.prompt[start : start + n]
        p = r.req.params
        fresh = r.anchor is None  # not resumed after preemption: nothing of it has been reported yet
        # Prompt logprobs: each chunk position scores the prompt token after it (the last position's token is
        # the first generated one, scored with `logprobs`), so a prompt of n tokens is scored in n - 1 rows
        # (targets [] for a one-token prompt: its logprobs are its first token's entry alone).
        targets = r.prompt[start + 1 : start + len(chunk) + 1] if p.prompt_logprobs is not None and fresh else None
        return PrefillItem(chunk, start, self.pages.table_row(r.rid, self.pages.num_pages), r.key, p.temperature,
                           p.top_k, p.top_p, logprobs=p.logprobs is not None and fresh, prompt_targets=targets,
                           min_p=p.min_p, bias=r.bias, penalties=r.penalties)

    def _prefill(self) -> None:
        """One prefill pass over `_prefill_batch`. A request's own values can fail the host side of a pass
        (before anything runs): then each runs alone, so the one that fails fails alone."""
        batch = self._prefill_batch()
        try:
            self._prefill_pass(batch)
        except Exception as e:  # noqa: BLE001
            if not _is_request_error(e) or len(batch) == 1:
                self._prefill_error(batch[0][0], e)
                return
            log.warning("a prefill pass of %d requests failed (%s); prefilling them one at a time", len(batch), e)
            for one in batch:
                try:
                    self._prefill_pass([one])
                except Exception as e:  # noqa: BLE001
                    self._prefill_error(one[0], e)

    def _prefill_pass(self, batch: list[tuple[_Req, int]]) -> None:
        """Runs one pass over `batch` and books each request; an error in one's booking (after the pass ran)
        fails that request alone and is not raised."""
        items = [self._prefill_item(r, n) for r, n in batch]
        results = self.runner.prefill_chunks(items)
        self.stats["prefill_passes_total"] += 1
        for (r, _), item, result in zip(batch, items, results, strict=True):
            try:
                self._prefilled(r, item, *result)
            except Exception as e:  # noqa: BLE001
                self._prefill_error(r, e)

    def _prefill_error(self, r: _Req, e: Exception) -> None:
        """A request error (`_is_request_error`) fails `r` alone with a 400; anything else is re-raised."""
        if not _is_request_error(e):
            raise e
        log.warning("request %s failed in prefill: %s", r.rid, e)
        self._finish(r, [], "abort", error=f"prefill failed: {e}", status=400)

    def _prefilled(self, r: _Req, item: PrefillItem, tok: int, lp, prompt_lp) -> None:
        """Books one request's prefilled chunk; when its prompt is in, the prefill's token is its first output
        (a fresh request) and it starts running."""
        p = r.req.params
        if item.prompt_targets is not None:
            if item.start == 0:  # (again after a preemption in prefill)
                r.prompt_logprobs = [TokenLogprob(token_id=r.prompt[0], logprob=None)]
            r.prompt_logprobs += [_token_logprob(t, prompt_lp, (j,), p.prompt_logprobs)
                                  for j, t in enumerate(item.prompt_targets)]
        r.prefilled += len(item.tokens)
        self.stats["prefill_chunks_total"] += 1
        if r.prefilled < len(r.prompt):
            return
        self.prefilling.remove(r)
        r.committed = len(r.prompt)
        if r.anchor is None:  # a fresh request: the prefill's token is its first output
            plps, r.prompt_logprobs = r.prompt_logprobs, None  # reported once, with the first output
            if p.max_tokens == 0:  # scoring only (echo): no token
                self._finish(r, [], "length", prompt_logprobs=plps)
                return
            lps = [_token_logprob(tok, lp, (), p.logprobs)] if item.logprobs else None
            out, lps, reason = self._take(r, [tok], lps)
            self.stats["generation_tokens_total"] += len(out)
            if reason is not None:
                self._finish(r, out, reason, logprobs=lps, prompt_logprobs=plps)
                return
            self._emit(r, out, logprobs=lps, prompt_logprobs=plps)
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

    def _step_batch(self, running):
        """The running requests compacted into rows 0..R−1 of the smallest batch bucket that holds them (one
        array assignment per field: a per-row loop of scalar stores cost the host ~10 µs a row)."""
        b = self.runner.empty_batch(len(running))
        R = len(running)
        b.block_tables[:] = self._block_tables(running, b.lengths.shape[0])
        params = [r.req.params for r in running]
        b.lengths[:R] = [r.committed for r in running]
        b.anchors[:R] = [r.anchor for r in running]
        b.temperature[:R] = [p.temperature for p in params]
        b.top_k[:R] = [p.top_k for p in params]
        b.top_p[:R] = [p.top_p for p in params]
        b.min_p[:R] = [p.min_p for p in params]
        if any(r.bias for r in running):
            b.bias_ids[:], b.bias[:], b.ban_until[:] = bias_rows(len(b.bias), [r.bias for r in running])
        if any(r.penalties for r in running):
            b.penalties = penalty_rows(len(b.lengths), [(r.penalties, len(r.req.prompt_ids)) for r in running])
        b.keys[:R] = np.stack([r.key for r in running])
        b.rounds[:R] = [r.rounds + 1 for r in running]
        b.logprobs[:R] = [p.logprobs is not None for p in params]
        return b

    def _block_tables(self, running, Bb: int) -> np.ndarray:
        """int32 [Bb, max_pages]: the running requests' page tables in rows 0..R−1, padding rows on no page."""
        tables = np.full((Bb, self.runner.max_pages), self.pages.num_pages, np.int32)
        owned = self.pages.owned
        for i, r in enumerate(running):
            pages = owned.get(r.rid, ())
            tables[i, : len(pages)] = pages
        return tables

    def _dispatch(self, dev, plan: Plan):
        return self.runner.dispatch(dev, plan.kind, capacity=plan.capacity, lengths=plan.lengths, budget=plan.budget)

    def _round_info(self, running, Bb: int, context: int, confidence=None) -> RoundInfo:
        return RoundInfo(tuple(r.rid for r in running), Bb, context, self.stats["steps_total"], confidence)

    def _decode(self) -> None:
        """Runs the next round. With pipelining the host never waits for a round before starting the next:
        while the running set is unchanged, round n+1 is dispatched from round n's device outputs and round n
        is read back while n+1 runs (§5.2). Any change (a finish, an abort, a new request, a short pool, a
        scheduler that reads the current drafts) reads the round in flight first and starts afresh."""
        inflight, self._inflight = self._inflight, None
        if inflight is not None:
            chained = self._chain(inflight)
            self._process(inflight)
            if chained is not None:
                self._inflight = chained
                return
        need = {r.rid: r.committed + self.L + 1 for r in self.running}
        running = list(self._preempt_for(need))
        if not running:
            return
        b = self._step_batch(running)
        R, Bb = len(running), b.lengths.shape[0]
        dev = drafts = conf = None
        syncs = self.scheduler.syncs_on_drafts
        if syncs:  # ℓ from the current drafts' confidences, read back on the host
            dev = self.runner.device_batch(b)
            drafts = self.runner.draft(b, dev)
            conf = np.asarray(drafts[2])
        plan = self.scheduler.plan(self._round_info(running, Bb, int(b.lengths[:R].max()), conf))
        if not self.pipelined or syncs:
            res = self.runner.step(b, plan.kind, capacity=plan.capacity, lengths=plan.lengths, budget=plan.budget,
                                   drafts=None if plan.kind is StepKind.PLAIN else drafts, dev=dev,
                                   want_confidence=plan.read_confidence)
            self._process(_Round(None, running, None, self._count_pass(plan), R, Bb, plan), res)
            return
        dev = self.runner.device_batch(b)
        self._inflight = _Round(self._dispatch(dev, plan), running, dev, self._count_pass(plan), R, Bb, plan,
                                bool(b.logprobs[:R].any()))

    def _count_pass(self, plan: Plan) -> int:
        """Numbers a dispatched pass (the clock of stale confidences) and counts its plain steps."""
        index = self.stats["steps_total"]
        self.stats["steps_total"] += 1
        if plan.kind is StepKind.PLAIN:
            self.stats["plain_steps_total"] += 1
        return index

    def _chain(self, prev: _Round) -> _Round | None:
        """Dispatches the round after `prev` from its device outputs when nothing changed since `prev`
        (same running requests, pages for two more blocks, a scheduler that needs no current drafts)."""
        if self.scheduler.syncs_on_drafts or prev.running != self.running or any(r.done for r in prev.running):
            return None
        # The host's n lags by prev's commit (≤ L + 1), and this round writes L + 1 more.
        if not all(self.pages.ensure(r.rid, r.committed + 2 * (self.L + 1)) for r in prev.running):
            return None
        Bb = prev.Bb
        dev = self.runner.advance(prev.dev, prev.out, self._block_tables(prev.running, Bb))
        context = max(r.committed for r in prev.running) + self.L + 1
        plan = self.scheduler.plan(self._round_info(prev.running, Bb, context))
        out = self._dispatch(dev, plan)
        self.stats["chained_steps_total"] += 1
        return _Round(out, prev.running, dev, self._count_pass(plan), prev.R, Bb, plan, prev.want_logprobs)

    def _process(self, rnd: _Round, res=None) -> None:
        """Reads a round's results (waiting for it if in flight) and commits them on the host: streamed
        tokens, stops, n ← n + m + 1. Requests finished or aborted since it was dispatched are skipped."""
        if res is None:
            res = self.runner.fetch(rnd.out, rnd.R, want_confidence=rnd.plan.read_confidence,
                                    want_logprobs=rnd.want_logprobs)
        running, R = rnd.running, rnd.R
        live = np.array([not r.done for r in running])
        self.scheduler.observe(rnd.index, tuple(r.rid for r in running), rnd.plan, res)
        self.stats["verify_tokens_total"] += int(R + res.lengths[:R].sum())
        self.stats["capacity_tokens_total"] += res.capacity
        self.stats["row_steps_total"] += int(live.sum())
        self.stats["emitted_total"] += int(res.num_emitted[:R][live].sum())
        if self.L:
            tried, took = acceptance_counts(res.lengths[:R], res.num_accepted[:R], live, self.L)
            self.attempts += tried
            self.accepts += took
        # Python ints once for the whole round (numpy scalars row by row cost the host more than the commit).
        emitted_rows, num_emitted, num_accepted = (res.emitted[:R].tolist(), res.num_emitted[:R].tolist(),
                                                   res.num_accepted[:R].tolist())
        for i, r in enumerate(running):
            if r.done:
                continue
            m, ne = num_accepted[i], num_emitted[i]
            emitted = emitted_rows[i][:ne]
            k = r.req.params.logprobs
            lps = None
            if k is not None and res.logprobs is not None:
                lps = [_token_logprob(emitted[j], res.logprobs, (i, j), k) for j in range(ne)]
            r.rounds += 1
            r.committed += m + 1
            r.anchor = emitted[-1]
            out, lps, reason = self._take(r, emitted, lps)
            self.stats["generation_tokens_total"] += len(out)
            if reason is not None:
                self._finish(r, out, reason, logprobs=lps)
            elif out:
                self._emit(r, out, logprobs=lps)

    def step(self) -> bool:
        """One engine iteration; returns whether anything ran. `has_work` holds for its whole duration, so a
        waiter never sees the engine idle between a request leaving the lists and its last output."""
        self._stepping = True
        try:
            return self._step()
        finally:
            self._stepping = False

    def _step(self) -> bool:
        self._process_aborts()
        with self._lock:
            self._admit()
        worked = False
        if self.prefilling:
            self._prefill()
            worked = True
        if self.running or self._inflight is not None:
            self._decode()
            worked = True
        return worked

    def fail_all(self, message: str) -> None:
        self._inflight = None
        for r in list(self.by_id.values()):
            if not r.done:
                self._finish(r, [], "abort", error=message, status=500)

    def metrics(self) -> dict:
        s = self.stats
        rows = max(s["row_steps_total"], 1)
        return {
            "requests_total": s["requests_total"], "requests_running": len(self.running) + len(self.prefilling),
            "requests_waiting": len(self.waiting), "prompt_tokens_total": s["prompt_tokens_total"],
            "generation_tokens_total": s["generation_tokens_total"], "steps_total": s["steps_total"],
            "plain_steps_total": s["plain_steps_total"], "emitted_total": s["emitted_total"],
            "prefill_passes_total": s["prefill_passes_total"],
            "row_steps_total": s["row_steps_total"], "verify_tokens_total": s["verify_tokens_total"],
            "tokens_per_step": s["emitted_total"] / rows,
            "acceptance_per_position": (self.accepts / np.maximum(self.attempts, 1)).tolist() if self.L else [],
            "verify_tokens_per_pass": s["verify_tokens_total"] / max(s["steps_total"], 1),
            "draft_gain_ratio": self.scheduler.metrics().get("draft_gain_ratio"),
            "sps_table": {f"{b}x{c}@{x}": v for (b, c, x), v in sorted(self.scheduler.sps.entries.items())},
            "free_pages": self.pages.num_free, "total_pages": self.pages.num_pages,
            "preemptions_total": s["preemptions_total"], "aborted_total": s["aborted_total"],
        }


def _is_request_error(e: Exception) -> bool:
    """Errors a request's own values can cause on the host side (the device programs never raise for values)."""
    return isinstance(e, (ValueError, OverflowError, TypeError, IndexError))


class Engine:
    """EngineCore in a background thread: the object the HTTP server talks to (serve/types.EngineLike).

    If the loop itself dies (a device error), every request is failed with a 500 and, when `exit_on_fatal` is
    set (the real server sets it), the process exits with status 70 so a supervisor restarts it: never a live
    process that answers 503 forever."""

    def __init__(self, core: EngineCore, *, model_name: str, tokenizer=None, chat_template=None, background=None):
        """background: an iterator of start-up work (serve/startup.py) advanced one item at a time while the
        engine has no request to step, in the engine's own thread (it shares the runner's pools)."""
        self.core, self.model_name, self.tokenizer, self.chat_template = core, model_name, tokenizer, chat_template
        self._background = background
        self.max_model_len = core.max_model_len
        self.vocab_size = core.vocab_size
        self.exit_on_fatal = False
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
                if self.core.step():
                    continue
                if self._background is not None:
                    self._advance_background()
                    continue
                self._wake.wait(0.05)
                self._wake.clear()
        except BaseException as e:  # a device error: fail every request loudly rather than hang them
            log.exception("engine loop died")
            self._alive = False
            self.core.fail_all(f"engine error: {type(e).__name__}: {e}")
            if self.exit_on_fatal:
                logging.shutdown()
                os._exit(70)
        finally:
            self._alive = False

    def _advance_background(self) -> None:
        """One item of start-up work. If it fails, serving goes on as it is (the safe policy), loudly."""
        try:
            next(self._background)
        except StopIteration:
            self._background = None
        except Exception:
            log.exception("background start-up work failed; serving on without it")
            self._background = None

    @property
    def startup_complete(self) -> bool:
        """Every program compiled and the SPS table in place (always, when start-up blocked for them)."""
        return self._background is None

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
