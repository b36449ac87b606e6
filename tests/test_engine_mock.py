"""EngineCore and Engine (serve/engine.py) against a mock runner whose outputs can be computed by hand: continuous
batching, chunked prefill, stops, aborts, preemption, the five schedulers and the metrics. No model, no jit.

The mock world (vocabulary V):
  target   the token after x is (x + 1) % V, so a prompt ending in x continues x+1, x+2, … whatever the
           scheduler; every expected output below is `continuation(prompt, …)`.
  drafter  request r's draft token k (k = 1..L) in round t is correct iff k ≤ accept(seed_r, t); a wrong draft
           token is the correct one + WRONG. Confidences come from a table conf(pass, slot, seed, round).
  verify   ℓ from the host (`lengths`) or by top-K fill of the current survival (`budget` K); accepted m = the
           leading draft tokens among the ℓ verified that equal the target's token; emitted = the m accepted
           + 1 (bonus or recovered) = anchor+1 … anchor+m+1.
  prompt   (prompt logprobs) prompt token t after x has logprob `prompt_logprob(x, t)` and the top alternatives
           x+1, x+2, … with logprobs 0, −1/8, −2/8, …
  cache    one token per (page, offset): prefill and verify write through the block tables, and every pass
           reads each slot's context 0..n−1 back, so a wrong table, a shared page or a bad recompute shows up
           as a context that differs from prompt + generated (`check_contexts`).
Requests are told apart by their seed (the runner sees it in `keys[:, 1]`). Every call is recorded
(`prefills`, `passes`, `events`) for the tests to assert on.
"""

from __future__ import annotations

import collections
import dataclasses
import threading
import types

import numpy as np
import pytest

from dspark_jax.buckets import capacity_buckets, pick, pow2_buckets
from dspark_jax.runner import StepBatch, StepKind, StepResult
from dspark_jax.sampling import LOGIT_BIAS_MAX
from serve.engine import Engine, EngineCore
from serve.runner_api import Runner
from serve.scheduler import Scheduler
from serve.types import EngineRequest, InvalidRequest, SamplingParams

V = 1000
WRONG = 500  # a wrong draft token is the correct one shifted by this much


# ---- the mock runner ------------------------------------------------------------------------------------------------
def prompt_logprob(prev: int, t: int) -> float:
    """The mock target's logprob of prompt token t after prev (a row misaligned by one position shows)."""
    return -((t - prev) % V) / V


def survival_np(conf: np.ndarray) -> np.ndarray:
    """a_k = c_1⋯c_k, f32 [B, L] (numpy twin of dspark_jax.scheduling.survival)."""
    return np.minimum.accumulate(np.cumprod(conf.astype(np.float32), axis=-1), axis=-1)


def topk_fill_np(a: np.ndarray, k: int, active: np.ndarray) -> np.ndarray:
    """ℓ [B]: the K highest-survival candidates (active, a > 0); ties by slot, then position (prefix-consistent)."""
    B, L = a.shape
    cands = [(r, j) for r in range(B) for j in range(L) if active[r] and a[r, j] > 0]
    cands.sort(key=lambda rj: -a[rj])  # stable: equal survival keeps the r-major order
    take, ell = set(cands[:k]), np.zeros(B, np.int32)
    for r in range(B):
        while ell[r] < L and (r, int(ell[r])) in take:
            ell[r] += 1
    return ell


@dataclasses.dataclass
class Prefill:
    seed: int
    start: int
    tokens: list[int]
    pages: list[int]


@dataclasses.dataclass
class Pass:
    """One verification pass; per-request fields are keyed by seed."""

    capacity: int
    budget: int | None
    lengths_arg: list[int] | None
    host_drafted: bool  # the engine drafted (a host sync) before calling step
    want_confidence: bool
    plain: bool = False  # a plain step (no draft pass)
    slots: dict[int, int] = dataclasses.field(default_factory=dict)
    n: dict[int, int] = dataclasses.field(default_factory=dict)
    anchor: dict[int, int] = dataclasses.field(default_factory=dict)
    ell: dict[int, int] = dataclasses.field(default_factory=dict)
    m: dict[int, int] = dataclasses.field(default_factory=dict)
    context: dict[int, list[int]] = dataclasses.field(default_factory=dict)

    @property
    def R(self) -> int:
        return len(self.slots)


class MockRunner:
    """The runner interface EngineCore drives (serve/runner_api.py `Runner`, which dspark_jax/runner.py's
    ModelRunner satisfies), in numpy. Rows of a step are the running requests compacted into a batch bucket
    (powers of two up to B). A round runs when dispatched (so a round chained before the host read the previous
    one writes the cache first); `advance` builds the next round's batch from the previous round's outputs
    alone, as the device does."""

    def __init__(self, *, B, L, num_pages, page_size, max_pages, capacities, chunk_sizes, accept=None, conf=None,
                 confidence_head=True, fail_at_pass=None, fail_prefill=None):
        self.B, self.L, self.page_size, self.max_pages = B, L, page_size, max_pages
        self.capacities, self.chunk_sizes = tuple(capacities), tuple(chunk_sizes)
        self.batch_buckets = pow2_buckets(B)
        self.prefill_rows = pow2_buckets(min(B, self.chunk_sizes[-1]))
        cfg = types.SimpleNamespace(confidence=confidence_head, kind="mock")
        self.drafter = types.SimpleNamespace(config=cfg) if L else None
        self.target = types.SimpleNamespace(config=types.SimpleNamespace(vocab_size=V))
        self.tkv = types.SimpleNamespace(num_pages=num_pages)
        self.num_pages = num_pages
        self.cache = np.full((num_pages, page_size), -1, np.int64)
        self.accept = accept or (lambda seed, rnd: L)
        self.conf = conf or (lambda t, slot, seed, rnd: np.full(L, 0.5, np.float32))
        self.fail_at_pass = fail_at_pass
        self.fail_prefill = fail_prefill or {}  # seed → the exception a prefill pass holding it raises
        self.prefills: list[Prefill] = []
        self.prefill_passes: list[tuple[int, ...]] = []
        self.passes: list[Pass] = []
        self.events: list[tuple] = []

    def _at(self, row, pos: int) -> tuple[int, int]:
        page = int(row[pos // self.page_size])
        assert page != self.tkv.num_pages, f"position {pos} lies beyond the request's pages {list(row)}"
        return page, pos % self.page_size

    def _context(self, row, n: int) -> list[int]:
        ctx = [int(self.cache[self._at(row, i)]) for i in range(n)]
        assert -1 not in ctx, f"unwritten cache positions in the context {ctx}"
        return ctx

    def verify_shapes(self, max_draft=None):
        ld = self.L if max_draft is None else min(max_draft, self.L)
        return sorted({(pick(r, self.batch_buckets), pick(t, self.capacities)) for r in range(1, self.B + 1)
                       for t in range(r, r * (ld + 1) + 1) if t <= self.capacities[-1]})

    def prefill_chunks(self, items):
        """One packed pass: ≤ prefill_rows[-1] requests, ≤ the largest chunk bucket of tokens together."""
        assert 0 < len(items) <= self.prefill_rows[-1], f"{len(items)} requests in one prefill pass"
        assert sum(len(it.tokens) for it in items) <= self.chunk_sizes[-1], [len(it.tokens) for it in items]
        for it in items:  # (before anything is written, as the real runner's host-side errors)
            if int(it.key[1]) in self.fail_prefill:
                raise self.fail_prefill[int(it.key[1])]
        self.prefill_passes.append(tuple(int(it.key[1]) for it in items))  # seeds
        return [self.prefill(it.tokens, it.start, it.table_row, it.key, it.temperature, it.top_k, it.top_p,
                             it.logprobs, prompt_targets=it.prompt_targets or None) for it in items]

    def prefill_fits(self, counts) -> bool:
        return True

    def prefill(self, tokens, start, table_row, key, temperature, top_k, top_p, logprobs=False, prompt_targets=None):
        assert 0 < len(tokens) <= self.chunk_sizes[-1], f"chunk of {len(tokens)} tokens"
        assert len(table_row) == self.max_pages
        self._context(table_row, start)  # the earlier chunks landed
        for i, t in enumerate(tokens):
            self.cache[self._at(table_row, start + i)] = t
        seed = int(key[1])
        pages = [int(p) for p in table_row if p != self.tkv.num_pages]
        self.prefills.append(Prefill(seed, start, [int(t) for t in tokens], pages))
        self.events.append(("prefill", seed, start, len(tokens)))
        prompt_lp = None
        if prompt_targets is not None:  # row j scores prompt_targets[j], the prompt token after tokens[j]
            assert 0 < len(prompt_targets) <= len(tokens)
            self.events.append(("prompt_logprobs", seed, start, len(prompt_targets)))
            x = np.asarray(tokens[: len(prompt_targets)], np.int64)
            chosen = np.asarray([prompt_logprob(a, b) for a, b in zip(x, prompt_targets, strict=True)])
            prompt_lp = (chosen, ((x[:, None] + 1 + np.arange(20)) % V).astype(np.int32),
                         np.tile(-np.arange(20) / 8, (len(x), 1)))
        return (int(tokens[-1]) + 1) % V, None, prompt_lp

    def empty_batch(self, rows: int) -> StepBatch:
        Bb, M = pick(max(rows, 1), self.batch_buckets), self.max_pages
        return StepBatch(lengths=np.zeros(Bb, np.int32), anchors=np.zeros(Bb, np.int32),
                         block_tables=np.full((Bb, M), self.tkv.num_pages, np.int32),
                         temperature=np.zeros(Bb, np.float32), top_k=np.zeros(Bb, np.int32),
                         top_p=np.ones(Bb, np.float32), min_p=np.zeros(Bb, np.float32),
                         bias_ids=np.zeros((Bb, LOGIT_BIAS_MAX), np.int32),
                         bias=np.zeros((Bb, LOGIT_BIAS_MAX), np.float32), ban_until=np.zeros(Bb, np.int32),
                         keys=np.zeros((Bb, 2), np.uint32),
                         rounds=np.zeros(Bb, np.int32), logprobs=np.zeros(Bb, bool), rows=rows)

    def device_batch(self, b: StepBatch) -> dict:
        return {"host": dataclasses.replace(b, lengths=b.lengths.copy(), anchors=b.anchors.copy(),
                                            block_tables=b.block_tables.copy(), rounds=b.rounds.copy())}

    def draft(self, b: StepBatch, dev):
        """(draft [Bb, L], q (unused), confidence [Bb, L]) for the pass about to run."""
        t = len(self.passes)
        Bb = b.lengths.shape[0]
        draft = np.zeros((Bb, self.L), np.int32)
        conf = np.zeros((Bb, self.L), np.float32)  # idle rows: no candidates; a correct engine never reads them
        k = np.arange(1, self.L + 1)
        for s in np.flatnonzero(b.active):
            seed, rnd, a = int(b.keys[s, 1]), int(b.rounds[s]), int(b.anchors[s])
            draft[s] = (a + k + np.where(k <= self.accept(seed, rnd), 0, WRONG)) % V
            conf[s] = self.conf(t, int(s), seed, rnd)
        return draft, None, conf

    def step(self, b: StepBatch, kind: StepKind, *, capacity, lengths=None, budget=None, drafts=None, dev=None,
             want_confidence=False):
        if len(self.passes) == self.fail_at_pass:
            raise RuntimeError("mock device error")
        plain = kind is StepKind.PLAIN
        if kind is StepKind.SPECULATE:
            assert self.L and (lengths is None) != (budget is None), "exactly one of lengths and budget"
            assert budget is None or budget >= 1, f"a speculative {budget=}"
        else:
            assert lengths is None and budget is None, f"a {kind} step verifies no draft token"
            assert self.L or plain, "a probe without a drafter"
        if plain:  # a plain step: no draft pass, every ℓ = 0
            lengths, want_confidence = np.zeros(b.lengths.shape[0], np.int32), False
            drafts = (np.zeros((b.lengths.shape[0], self.L), np.int32), None,
                      np.zeros((b.lengths.shape[0], self.L), np.float32))
        elif kind is StepKind.PROBE:  # a draft pass, a top-K fill of no draft token
            budget = 0
        assert capacity in self.capacities, f"{capacity=} is not a bucket"
        rec = Pass(capacity, None if budget is None else int(budget),
                   None if lengths is None else [int(x) for x in lengths], drafts is not None and not plain,
                   want_confidence, plain=plain)
        draft, _, conf = drafts if drafts is not None else self.draft(b, None)
        active = b.active.copy()
        if budget is not None:
            ell = topk_fill_np(survival_np(conf), int(budget), active)
        else:
            ell = np.where(active, lengths, 0).astype(np.int32)
        assert ell.min() >= 0 and ell.max() <= self.L, ell
        assert active.sum() + ell.sum() <= capacity, f"{active.sum()} + {ell.sum()} tokens overflow {capacity=}"
        pages = [int(p) for s in np.flatnonzero(active) for p in b.block_tables[s] if p != self.tkv.num_pages]
        assert len(pages) == len(set(pages)), f"two slots share a page: {b.block_tables[active]}"
        Bb = b.lengths.shape[0]
        assert Bb == pick(max(b.rows, 1), self.batch_buckets), f"{Bb=} is not the bucket of {b.rows} rows"
        assert (b.block_tables[b.rows :] == self.tkv.num_pages).all(), "padding rows must own no pages"
        emitted = np.full((Bb, self.L + 1), -1, np.int32)
        num_emitted, num_accepted = np.zeros(Bb, np.int32), np.zeros(Bb, np.int32)
        for s in np.flatnonzero(active):
            seed, n, a, row = int(b.keys[s, 1]), int(b.lengths[s]), int(b.anchors[s]), b.block_tables[s]
            ctx = self._context(row, n)
            # The target predicts from its cache: the token before the anchor must be anchor − 1 here.
            assert ctx[-1] == (a - 1) % V, f"cache position {n - 1} holds {ctx[-1]}, anchor is {a}"
            block = [a] + [int(x) for x in draft[s, : ell[s]]]
            for i, tok in enumerate(block):  # K/V of every verified position is written, accepted or not
                self.cache[self._at(row, n + i)] = tok
            m = 0
            while m < ell[s] and block[m + 1] == (block[m] + 1) % V:
                m += 1
            emitted[s, : m + 1] = block[1 : m + 1] + [(block[m] + 1) % V]
            num_emitted[s], num_accepted[s] = m + 1, m
            rec.slots[seed], rec.n[seed], rec.anchor[seed] = int(s), n, a
            rec.ell[seed], rec.m[seed], rec.context[seed] = int(ell[s]), m, ctx
        self.passes.append(rec)
        self.events.append(("pass", tuple(int(b.keys[s, 1]) for s in np.flatnonzero(active))))
        confidence = conf.copy() if (want_confidence and self.L) else None
        R = b.rows
        return StepResult(emitted[:R], num_emitted[:R], num_accepted[:R], ell[:R],
                          None if confidence is None else confidence[:R], capacity)


    def dispatch(self, dev, kind: StepKind, *, capacity, lengths=None, budget=None, policy=None, drafts=None):
        assert policy is None
        b = dev["host"]
        res = self.step(b, kind, capacity=capacity, lengths=lengths, budget=budget, drafts=drafts,
                        want_confidence=kind is not StepKind.PLAIN)
        self.events.append(("dispatch", len(self.passes) - 1))
        return len(self.passes) - 1, res

    def fetch(self, out, rows: int, *, want_confidence=False, want_logprobs=False) -> StepResult:
        index, out = out
        assert out.emitted.shape[0] == rows
        self.events.append(("fetch", index))
        return dataclasses.replace(out, confidence=out.confidence if want_confidence else None)

    def advance(self, dev, out, block_tables=None) -> dict:
        out = out[1]
        b = self.device_batch(dev["host"])["host"]
        R = out.emitted.shape[0]
        for i in range(R):
            m = int(out.num_accepted[i])
            b.lengths[i] += m + 1
            b.anchors[i] = out.emitted[i, m]
        b.rounds[:R] += 1
        if block_tables is not None:
            b.block_tables[:] = block_tables
        return {"host": b}


# ---- helpers --------------------------------------------------------------------------------------------------------
class Outputs:
    """Thread-safe on_output sink; each output is stored with the engine step it arrived in."""

    def __init__(self):
        self.by_id: dict[str, list] = collections.defaultdict(list)
        self.lock = threading.Lock()
        self.step = 0

    def __call__(self, out) -> None:
        with self.lock:
            self.by_id[out.request_id].append((self.step, out))

    def chunks(self, rid: str) -> list[tuple[tuple[int, ...], str | None]]:
        return [(o.token_ids, o.finish_reason) for _, o in self.by_id[rid]]

    def tokens(self, rid: str) -> list[int]:
        return [t for _, o in self.by_id[rid] for t in o.token_ids]

    def finish(self, rid: str) -> str:
        reasons = [o.finish_reason for _, o in self.by_id[rid]]
        assert reasons and reasons[-1] is not None and all(r is None for r in reasons[:-1]), reasons
        return reasons[-1]

    def finish_step(self, rid: str) -> int:
        return self.by_id[rid][-1][0]


def continuation(prompt, max_tokens: int, stops=()) -> tuple[list[int], str]:
    out, x = [], prompt[-1]
    while len(out) < max_tokens:
        x = (x + 1) % V
        if x in stops:
            return out, "stop"
        out.append(x)
    return out, "length"


def make_core(scheduler, *, B=2, L=4, page_size=4, max_model_len=40, num_pages=None, chunk_sizes=(4, 8),
              capacities=None, eos=(), sps=None, pipelined=False, **runner_kw):
    max_pages = -(-(max_model_len + L + 1) // page_size)
    num_pages = num_pages or B * max_pages
    runner = MockRunner(B=B, L=L, num_pages=num_pages, page_size=page_size, max_pages=max_pages,
                  capacities=capacities or capacity_buckets(B, L), chunk_sizes=chunk_sizes, **runner_kw)
    assert isinstance(runner, Runner)  # the interface the real runner has
    core = EngineCore(runner, scheduler=scheduler, max_model_len=max_model_len, eos_token_ids=eos, sps=sps,
                      pipelined=pipelined)
    assert isinstance(core.scheduler, Scheduler)
    return core, runner


def submit(core, outputs, rid, prompt, max_tokens, seed, **params) -> None:
    p = SamplingParams(max_tokens=max_tokens, temperature=0.0, seed=seed, **params)
    core.add_request(EngineRequest(request_id=rid, prompt_ids=list(prompt), params=p, on_output=outputs))


def steps(core, outputs, n: int) -> None:
    for _ in range(n):
        core.step()
        outputs.step += 1


def drain(core, outputs, max_steps=400) -> None:
    while core.has_work():
        assert outputs.step < max_steps, "the engine did not finish"
        steps(core, outputs, 1)


def check_contexts(runner: MockRunner, full: dict[int, list[int]]) -> None:
    """Every prefill chunk and every pass's cache context match the request's prompt + generated tokens."""
    for p in runner.prefills:
        assert p.tokens == full[p.seed][p.start : p.start + len(p.tokens)], p
    for rec in runner.passes:
        for seed, n in rec.n.items():
            assert rec.context[seed] == full[seed][:n], (seed, n)
            assert rec.anchor[seed] == full[seed][n], (seed, n)


def all_pages_free(core) -> bool:
    return core.pages.num_free == core.pages.num_pages and not core.pages.owned


def bucket(tokens: int, caps) -> int:
    return min(c for c in caps if c >= tokens)


# ---- the mock itself ------------------------------------------------------------------------------------------------
def test_mock_topk_fill_matches_the_device_policy():
    from dspark_jax.scheduling import survival, topk_fill

    rng = np.random.default_rng(0)
    conf = rng.choice([0.0, 0.25, 0.5, 0.75, 1.0], size=(5, 4)).astype(np.float32)
    active = np.array([True, False, True, True, True])
    a = survival_np(conf)
    np.testing.assert_array_equal(a, np.asarray(survival(conf)))
    for k in range(0, 22):
        np.testing.assert_array_equal(topk_fill_np(a, k, active), np.asarray(topk_fill(a, k, active)), str(k))


# ---- outputs and continuous batching --------------------------------------------------------------------------------
SCHEDULERS = ["none", "fixed:1", "fixed:3", "threshold:0.5", "dspark-sync", "dspark"]


def ten_requests() -> tuple[list[int], dict[int, list[int]], dict[int, int]]:
    """Seeds 1..10 (10 requests through 3 slots), their prompts (1..12 tokens) and max_tokens (1..20)."""
    seeds = list(range(1, 11))
    prompts = {s: [s * 50 + i for i in range(1 + (s * 5) % 12)] for s in seeds}
    return seeds, prompts, {s: 1 + (s * 7) % 20 for s in seeds}


@pytest.mark.parametrize("scheduler", SCHEDULERS)
def test_outputs_with_continuous_batching(scheduler):
    L = 0 if scheduler == "none" else 4
    def conf(t, slot, seed, rnd):  # c ∈ {.25, .5, .75, 1}
        return (((seed + rnd + np.arange(L)) % 4 + 1) / 4).astype(np.float32)

    core, runner = make_core(scheduler, B=3, L=L, accept=lambda seed, rnd: (seed + rnd) % (L + 1), conf=conf)
    seeds, prompts, max_tokens = ten_requests()
    out = Outputs()
    for s in seeds:
        submit(core, out, f"r{s}", prompts[s], max_tokens[s], s)
    drain(core, out)
    full = {}
    for s in seeds:
        exp, reason = continuation(prompts[s], max_tokens[s])
        assert out.tokens(f"r{s}") == exp, s
        assert out.finish(f"r{s}") == reason == "length"
        full[s] = prompts[s] + exp
    check_contexts(runner, full)
    admitted = list(dict.fromkeys(p.seed for p in runner.prefills))
    assert admitted == seeds  # FIFO
    assert max(rec.R for rec in runner.passes) == 3
    # The 4th request is admitted only once one of the first three has finished (its slot is reused).
    assert {slot for rec in runner.passes for slot in rec.slots.values()} == {0, 1, 2}
    assert out.finish_step("r4") > min(out.finish_step(f"r{s}") for s in (1, 2, 3))
    assert all_pages_free(core) and core.stats["preemptions_total"] == 0
    if scheduler == "none":
        assert all(rec.ell == dict.fromkeys(rec.ell, 0) for rec in runner.passes)


@pytest.mark.parametrize("scheduler", SCHEDULERS)
def test_pipelined_rounds_give_the_same_outputs(scheduler):
    """With a pipelining runner, a round is dispatched before the previous one is read back whenever the running
    set is unchanged (never for the schedulers that read the current drafts). Outputs, stop reasons and
    contexts are those of the synchronous engine; rounds dispatched for a request that had already finished
    are discarded; every page comes back."""
    L = 0 if scheduler == "none" else 4
    def conf(t, slot, seed, rnd):
        return (((seed + rnd + np.arange(L)) % 4 + 1) / 4).astype(np.float32)

    results = {}
    for pipelined in (False, True):
        core, runner = make_core(scheduler, B=3, L=L, accept=lambda seed, rnd: (seed + rnd) % (L + 1), conf=conf,
                                 pipelined=pipelined, eos=(77,))
        seeds, prompts, max_tokens = ten_requests()
        prompts[3], max_tokens[3] = [70], 20  # continues 71..77: stops at the EOS 77 after 6 tokens
        out = Outputs()
        for s in seeds:
            submit(core, out, f"r{s}", prompts[s], max_tokens[s], s)
        drain(core, out)
        full = {}
        for s in seeds:
            exp, reason = continuation(prompts[s], max_tokens[s], stops=(77,))
            assert out.tokens(f"r{s}") == exp, (pipelined, s)
            assert out.finish(f"r{s}") == reason, (pipelined, s)
            full[s] = prompts[s] + continuation(prompts[s], max_tokens[s] + 2 * (L + 1))[0]
        check_contexts(runner, full)
        assert all_pages_free(core) and not core.has_work()
        results[pipelined] = (core.stats, runner)
    stats, runner = results[True]
    chained = stats["chained_steps_total"]
    if scheduler in ("threshold:0.5", "dspark-sync"):
        assert chained == 0 and "dispatch" not in {e[0] for e in runner.events}
    else:
        assert chained > 0
        # A chained round is dispatched before the round it follows is read back.
        order = [e for e in runner.events if e[0] in ("dispatch", "fetch")]
        pairs = zip(order, order[1:], strict=False)
        assert any(a[0] == "dispatch" and b == ("fetch", a[1] - 1) for a, b in pairs), order[:12]
        assert sorted(i for e, i in order if e == "fetch") == list(range(len(runner.passes)))  # each read once
    assert results[False][0]["chained_steps_total"] == 0


def test_pipelined_dspark_reads_confidences_two_passes_old():
    """Chained dspark rounds size the pass from confidences of a pass ≥ 2 older, like synchronous ones: the
    budget of pass t follows the confidence table of pass t − 2 (made distinct per pass here)."""
    L = 4
    def conf(t, slot, seed, rnd):  # pass t: every request's confidence is 1 before position t % 4, then 0
        return (np.arange(L) < t % 4).astype(np.float32)

    core, runner = make_core("dspark", B=2, L=L, conf=conf, pipelined=True, max_model_len=60)
    out = Outputs()
    submit(core, out, "a", [1, 2, 3], 40, seed=1)
    submit(core, out, "b", [9, 8], 40, seed=2)
    drain(core, out)
    assert out.tokens("a") == continuation([1, 2, 3], 40)[0] and out.tokens("b") == continuation([9, 8], 40)[0]
    both = [t for t, rec in enumerate(runner.passes) if rec.R == 2 and not rec.plain]
    assert core.stats["chained_steps_total"] > 5
    for t in both:
        if (t >= 2 and runner.passes[t - 2].R == 2 and not runner.passes[t - 2].plain  # (a plain pass drafts
                and runner.passes[t - 1].R == 2 and runner.passes[t].budget):  # nothing: no confidences)
            assert runner.passes[t].budget == 2 * ((t - 2) % 4), (t, runner.passes[t].budget)


def test_abort_while_a_round_is_in_flight():
    core, runner = make_core("fixed:3", B=2, L=3, pipelined=True)
    out = Outputs()
    submit(core, out, "a", [1, 2, 3], 30, seed=1)
    submit(core, out, "b", [5, 6], 30, seed=2)
    while core.stats["chained_steps_total"] < 2:
        steps(core, out, 1)
    assert core._inflight is not None
    core.abort("a")
    drain(core, out)
    assert out.finish("a") == "abort" and out.tokens("b") == continuation([5, 6], 30)[0]
    assert all_pages_free(core)


# ---- chunked prefill ------------------------------------------------------------------------------------------------
def test_chunked_prefill_interleaves_with_decoding():
    core, runner = make_core("fixed:2", B=3, L=2, max_model_len=64, accept=lambda seed, rnd: 0)
    out = Outputs()
    submit(core, out, "a", [10, 11, 12], 30, seed=1)
    steps(core, out, 1)
    submit(core, out, "long", list(range(100, 130)), 2, seed=2)  # 30 tokens: chunks 8, 8, 8, 6
    submit(core, out, "c", [300, 301], 3, seed=3)
    steps(core, out, 5)
    assert runner.events == [
        ("prefill", 1, 0, 3), ("pass", (1,)),
        ("prefill", 2, 0, 8), ("pass", (1,)),  # "a" keeps decoding while the long prompt loads
        ("prefill", 2, 8, 8), ("pass", (1,)),
        ("prefill", 2, 16, 8), ("pass", (1,)),
        # One pass a step: "c" (2 tokens) waits while "long" fills the 8-token passes, then shares its last one.
        ("prefill", 2, 24, 6), ("prefill", 3, 0, 2), ("pass", (1, 2, 3)),
        ("pass", (1, 3)),  # "long" finished (2 tokens)
    ]
    assert runner.prefill_passes == [(1,), (2,), (2,), (2,), (2, 3)]
    # Admission reserved the whole prompt + a block: ⌈(30 + 3) / 4⌉ = 9 pages for every chunk.
    assert [len(p.pages) for p in runner.prefills if p.seed == 2] == [9, 9, 9, 9]
    # "a" streams one token per step throughout (step 0: its prefill token and its first pass).
    assert [(step, o.token_ids) for step, o in out.by_id["a"]][:6] == [
        (0, (13,)), (0, (14,)), (1, (15,)), (2, (16,)), (3, (17,)), (4, (18,))]
    drain(core, out)
    full = {}
    for rid, seed, prompt, n in (("a", 1, [10, 11, 12], 30), ("long", 2, list(range(100, 130)), 2),
                                 ("c", 3, [300, 301], 3)):
        exp, reason = continuation(prompt, n)
        assert (out.tokens(rid), out.finish(rid)) == (exp, reason)
        full[seed] = prompt + exp
    check_contexts(runner, full)
    assert all_pages_free(core)


# ---- stops and validation -------------------------------------------------------------------------------------------
def test_stop_tokens_and_lengths():
    E = 900
    core, runner = make_core("fixed:4", B=2, L=4, eos=(E,))  # every draft accepted: 5 tokens per pass
    out = Outputs()
    cases = {  # rid: (prompt, max_tokens, params, expected chunks)
        "eos": ([5, E - 4], 10, {}, [((E - 3,), None), ((E - 2, E - 1), "stop")]),  # EOS mid-block, rest dropped
        "stop_id": ([50], 10, {"stop_token_ids": (53,)}, [((51,), None), ((52,), "stop")]),
        "eos_first": ([E - 1], 10, {}, [((), "stop")]),  # the prefill's token is EOS
        "ignore_eos": ([E - 2], 4, {"ignore_eos": True}, [((E - 1,), None), ((E, E + 1, E + 2), "length")]),
        "stop_id_ignore_eos": ([200], 9, {"stop_token_ids": (202,), "ignore_eos": True},
                               [((201,), None), ((), "stop")]),
        "length_mid_block": ([100], 3, {}, [((101,), None), ((102, 103), "length")]),
        "one": ([7, 8], 1, {}, [((9,), "length")]),
    }
    for i, (rid, (prompt, n, params, _)) in enumerate(cases.items()):
        submit(core, out, rid, prompt, n, seed=i + 1, **params)
    drain(core, out)
    for rid, (*_, chunks) in cases.items():
        assert out.chunks(rid) == chunks, rid
    # The token that stopped a request travels apart, on its last report (no logprobs asked: none).
    stops = {"eos": E, "stop_id": 53, "eos_first": E, "stop_id_ignore_eos": 202}
    for rid in cases:
        stop = out.by_id[rid][-1][1].stop_token
        assert (None if stop is None else (stop.token_id, stop.logprob)) == (
            (stops[rid], None) if rid in stops else None), rid
        assert all(o.stop_token is None for _, o in out.by_id[rid][:-1]), rid
    assert all_pages_free(core)


def test_add_request_validation():
    core, _ = make_core("fixed:1", max_model_len=40)
    out = Outputs()
    with pytest.raises(ValueError, match="exceeds the model's context"):
        submit(core, out, "long", list(range(30)), 11, seed=1)
    with pytest.raises(ValueError, match="empty"):
        submit(core, out, "empty", [], 4, seed=1)
    submit(core, out, "fits", list(range(30)), 10, seed=1)  # exactly max_model_len
    with pytest.raises(ValueError, match="duplicate"):
        submit(core, out, "fits", [1], 4, seed=2)
    assert core.metrics()["requests_waiting"] == 1
    drain(core, out)
    assert out.tokens("fits") == continuation(list(range(30)), 10)[0]


def test_refusals_name_the_field_at_fault():
    """InvalidRequest (a ValueError) carries the HTTP body's name of the field at fault, which the server
    reports as the error's `param`; min_tokens' bans of 64 stop ids plus EOS overflow the 64-entry bias table."""
    core, _ = make_core("fixed:1", max_model_len=40, eos=(77,))
    cases = {"max_tokens": dict(max_tokens=-1), "stop_token_ids": dict(stop_token_ids=(V,)),
             "logit_bias": dict(logit_bias={V: 1.0}), "min_tokens": dict(min_tokens=5, max_tokens=4),
             "seed": dict(seed=2**64), "logprobs": dict(logprobs=21), "min_p": dict(min_p=2.0),
             "presence_penalty": dict(presence_penalty=2.5), "frequency_penalty": dict(frequency_penalty=float("nan")),
             "repetition_penalty": dict(repetition_penalty=0.0)}
    for param, kw in cases.items():
        p = SamplingParams(**{"max_tokens": 4, "temperature": 0.0, **kw})
        with pytest.raises(InvalidRequest) as e:
            core.add_request(EngineRequest(request_id=param, prompt_ids=[1, 2], params=p, on_output=Outputs()))
        assert e.value.param == param, (param, str(e.value))
    full = SamplingParams(max_tokens=4, min_tokens=2, stop_token_ids=tuple(range(100, 164)))
    with pytest.raises(InvalidRequest, match="more than 64 token ids") as e:
        core.validate(EngineRequest(request_id="full", prompt_ids=[1], params=full, on_output=Outputs()))
    assert e.value.param == "min_tokens"
    core.validate(EngineRequest(request_id="fits", prompt_ids=[1], on_output=Outputs(),
                                params=dataclasses.replace(full, ignore_eos=True)))  # 64 bans without EOS fit
    # A runner built without penalties (RunnerConfig.penalties=False) refuses them, naming the field.
    runner = core.runner
    runner.config = types.SimpleNamespace(penalties=False)
    with pytest.raises(InvalidRequest, match="without penalties") as e:
        core.validate(EngineRequest(request_id="pen", prompt_ids=[1], on_output=Outputs(),
                                    params=SamplingParams(max_tokens=4, repetition_penalty=1.1)))
    assert e.value.param == "repetition_penalty"
    core.validate(EngineRequest(request_id="off", prompt_ids=[1], on_output=Outputs(),
                                params=SamplingParams(max_tokens=4, repetition_penalty=1.0)))


def expected_prompt_logprobs(prompt, k: int) -> list[tuple[int, float | None, tuple]]:
    """(token, logprob, top k) of each prompt token in the mock world; the first has none."""
    return [(prompt[0], None, ())] + [(t, prompt_logprob(x, t), tuple(((x + 1 + i) % V, -i / 8) for i in range(k)))
                                      for x, t in zip(prompt[:-1], prompt[1:], strict=True)]


def got_prompt_logprobs(out: Outputs, rid: str) -> list:
    """The prompt logprobs a request reported (asserting they came once, with its first report)."""
    reports = [o for _, o in out.by_id[rid]]
    assert all(o.prompt_logprobs is None for o in reports[1:]), rid
    return [(lp.token_id, lp.logprob, lp.top) for lp in reports[0].prompt_logprobs]


def test_prefill_passes_fill_a_token_budget_oldest_first():
    """One prefill pass a step of ≤ the largest chunk bucket (8 here) of prompt tokens, filled oldest request
    first, each with as much of its remaining prompt as fits (vLLM's token budget): a long prompt in chunks, a
    burst of short ones many to a pass, a prompt split across two passes where the first runs out of room."""
    core, runner = make_core("fixed:2", B=6, L=2, max_model_len=40)
    out = Outputs()
    prompts = {"long": (1, list(range(100, 120))), "s1": (2, [200, 201, 202]), "s2": (3, list(range(300, 305))),
               "s3": (4, [400, 401]), "s4": (5, [500]), "s5": (6, [600])}
    for rid, (seed, prompt) in prompts.items():
        submit(core, out, rid, prompt, 6, seed)
    drain(core, out)
    # long 0:8 | long 8:16 | long 16:20 + s1 + s2 0:1 | s2 1:5 + s3 + s4 + s5
    assert runner.prefill_passes == [(1,), (1,), (1, 2, 3), (3, 4, 5, 6)]
    assert [(p.start, len(p.tokens)) for p in runner.prefills if p.seed == 1] == [(0, 8), (8, 8), (16, 4)]
    assert [(p.start, len(p.tokens)) for p in runner.prefills if p.seed == 3] == [(0, 1), (1, 4)]
    for rid, (_, prompt) in prompts.items():
        assert (out.tokens(rid), out.finish(rid)) == (continuation(prompt, 6)[0], "length"), rid
    check_contexts(runner, {seed: prompt + continuation(prompt, 6)[0] for seed, prompt in prompts.values()})
    assert core.stats["prefill_passes_total"] == 4 and core.stats["prefill_chunks_total"] == 9
    assert all_pages_free(core)


def test_prefill_packs_at_most_the_runners_requests_per_pass():
    core, runner = make_core("fixed:2", B=6, L=2)
    runner.prefill_rows = (1, 2, 3)
    out = Outputs()
    for seed in range(1, 7):
        submit(core, out, f"r{seed}", [seed * 10], 3, seed)
    drain(core, out)
    assert runner.prefill_passes == [(1, 2, 3), (4, 5, 6)]
    assert all(out.tokens(f"r{seed}") == continuation([seed * 10], 3)[0] for seed in range(1, 7))


def test_prefill_packs_only_what_the_runner_says_fits():
    """`Runner.prefill_fits` (the jnp attention path prices every request row at the longest chunk): a request
    joins the pass only while the runner accepts the lengths so far plus its own; the rest wait."""
    core, runner = make_core("fixed:2", B=6, L=2)
    asked = []
    runner.prefill_fits = lambda counts: asked.append(list(counts)) or len(counts) * max(counts) <= 8
    out = Outputs()
    prompts = {1: [10, 11, 12], 2: [20], 3: [30, 31], 4: [40]}
    for seed, prompt in prompts.items():
        submit(core, out, f"r{seed}", prompt, 3, seed)
    drain(core, out)
    # 3 + 1 (2 rows × 3 = 6 ≤ 8) | + 2 would be 3 × 3 = 9: next pass, 2 + 1 (2 × 2 = 4)
    assert runner.prefill_passes == [(1, 2), (3, 4)]
    assert asked[:3] == [[3, 1], [3, 1, 2], [2, 1]]
    assert all(out.tokens(f"r{s}") == continuation(p, 3)[0] for s, p in prompts.items())


def test_a_request_that_fails_a_packed_prefill_fails_alone():
    """A request error on the host side of a packed pass (nothing ran): each request is prefilled alone, the one
    that fails gets a 400 and the others are served as if it had never come. Any other error is the engine's."""
    core, runner = make_core("fixed:2", B=3, L=2, fail_prefill={2: ValueError("bad value")})
    out = Outputs()
    for seed in (1, 2, 3):
        submit(core, out, f"r{seed}", [seed * 10, seed * 10 + 1], 5, seed)
    drain(core, out)
    (_, bad), = out.by_id["r2"]
    assert (bad.finish_reason, bad.status, bad.token_ids) == ("abort", 400, ())
    assert "prefill failed: bad value" in bad.error
    assert runner.prefill_passes == [(1,), (3,)]  # alone, after the packed pass raised
    assert core.stats["prefill_passes_total"] == 2
    for seed in (1, 3):
        assert out.tokens(f"r{seed}") == continuation([seed * 10, seed * 10 + 1], 5)[0]
    assert all_pages_free(core)
    core, runner = make_core("fixed:2", B=3, L=2, fail_prefill={2: RuntimeError("device lost")})
    for seed in (1, 2):
        submit(core, out, f"x{seed}", [seed], 5, seed)
    with pytest.raises(RuntimeError, match="device lost"):
        core.step()


def test_max_tokens_zero_scores_the_prompt_only():
    """max_tokens 0 (echo scoring): the request ends after its prefill with no token, its prompt logprobs on
    its one report, chunk by chunk (chunks of 8: rows 0..7 score tokens 1..8, rows 8..9 tokens 9..10)."""
    core, runner = make_core("fixed:1", chunk_sizes=(4, 8))
    out = Outputs()
    prompt = [7, 3, 900, 12, 12, 40, 41, 2, 999, 5, 6]
    submit(core, out, "zero", prompt, 0, seed=1, prompt_logprobs=2)
    submit(core, out, "one", [5], 0, seed=2, prompt_logprobs=0)
    drain(core, out)
    assert out.chunks("zero") == [((), "length")] and out.chunks("one") == [((), "length")]
    assert got_prompt_logprobs(out, "zero") == expected_prompt_logprobs(prompt, 2)
    assert got_prompt_logprobs(out, "one") == [(5, None, ())]
    assert [e for e in runner.events if e[0] == "prompt_logprobs"] == [("prompt_logprobs", 1, 0, 8),
                                                                       ("prompt_logprobs", 1, 8, 2)]
    assert not runner.passes and all_pages_free(core)
    with pytest.raises(ValueError, match="max_tokens must be an integer >= 0"):
        submit(core, Outputs(), "negative", [1, 2], -1, seed=1)
    with pytest.raises(ValueError, match="prompt_logprobs must be in"):
        submit(core, Outputs(), "many", [1, 2], 1, seed=1, prompt_logprobs=21)


def test_constructor_validation():
    with pytest.raises(ValueError, match="needs a drafter"):
        make_core("fixed:1", L=0)
    for scheduler in ("threshold:0.5", "dspark-sync", "dspark"):
        with pytest.raises(ValueError, match="confidence head"):
            make_core(scheduler, confidence_head=False)
    with pytest.raises(ValueError, match="cannot hold"):
        make_core("fixed:1", num_pages=5)  # one request needs ⌈(40 + 5) / 4⌉ = 12 pages
    with pytest.raises(ValueError, match="bad policy"):
        make_core("greedy")


# ---- abort ----------------------------------------------------------------------------------------------------------
ABORT_SETUP = {"a": (1, [10, 11, 12], 30), "p": (2, list(range(100, 130)), 5), "w": (3, [300, 301], 4)}


@pytest.mark.parametrize("victim, free_after", [("w", 29), ("p", 36), ("a", 29)])
def test_abort_waiting_prefilling_running(victim, free_after):
    core, runner = make_core("fixed:2", B=2, L=2, max_model_len=64, num_pages=40, accept=lambda seed, rnd: 0)
    out = Outputs()
    for rid, (seed, prompt, n) in ABORT_SETUP.items():
        submit(core, out, rid, prompt, n, seed)
    steps(core, out, 2)
    # "a" running (n = 5: 2 pages), "p" prefilling (13 of its 30 tokens in: 5 beside a's prompt, then 8; its
    # 33 positions hold 9 pages), "w" waiting.
    seen = len(runner.events)
    m = core.metrics()
    assert (m["requests_running"], m["requests_waiting"], m["free_pages"]) == (2, 1, 29)
    streamed = out.tokens(victim)
    core.abort(victim)
    steps(core, out, 1)
    assert out.chunks(victim)[-1] == ((), "abort") and out.tokens(victim) == streamed
    assert victim not in core.pages.owned
    # Hand counts after this step: w → a 2 + p 9; p → a 2 + w 2 (admitted into p's slot); a → p 9 + w 2.
    assert core.pages.num_free == free_after == 40 - sum(len(p) for p in core.pages.owned.values())
    core.abort(victim)  # idempotent: no second final output
    core.abort("never-existed")
    drain(core, out)
    assert out.chunks(victim)[-1] == ((), "abort") and out.finish(victim) == "abort"
    seed_v = ABORT_SETUP[victim][0]  # nothing of it ran after the abort
    later = runner.events[seen:]
    assert not [e for e in later if (e[0] == "prefill" and e[1] == seed_v) or (e[0] == "pass" and seed_v in e[1])]
    full = {}
    for rid, (seed, prompt, n) in ABORT_SETUP.items():
        exp, _ = continuation(prompt, n)
        if rid != victim:
            assert (out.tokens(rid), out.finish(rid)) == (exp, "length")
        full[seed] = prompt + exp
    check_contexts(runner, full)
    assert all_pages_free(core) and core.metrics()["aborted_total"] == 1


# ---- preemption -----------------------------------------------------------------------------------------------------
def test_preemption_recomputes_and_resumes():
    # 8 pages of 4; L = 2 and every draft accepted, so each pass commits 3 tokens and asks for n + 3 positions.
    core, runner = make_core("fixed:2", B=2, L=2, max_model_len=24, num_pages=8)
    out = Outputs()
    submit(core, out, "a", [10, 11, 12, 13], 16, seed=1)
    submit(core, out, "b", [50, 51, 52, 53], 16, seed=2)
    drain(core, out)
    # Both prompts prefill in one pass and decode in step. Step 4: "a" (n = 16) needs 5 pages, the pool is
    # empty → "b" (admitted last, n = 16, generated 54..66) is preempted. Its recompute prompt is the prompt +
    # generated[:-1] = 50..65, re-prefilled in chunks of 8 once "a" has finished, and it resumes from anchor 66.
    assert core.stats["preemptions_total"] == 1
    assert runner.prefill_passes == [(1, 2), (2,), (2,)]
    assert [(p.start, p.tokens) for p in runner.prefills if p.seed == 1] == [(0, [10, 11, 12, 13])]
    assert [(p.start, p.tokens) for p in runner.prefills if p.seed == 2] == [
        (0, [50, 51, 52, 53]), (0, list(range(50, 58))), (8, list(range(58, 66)))]
    resumed = [rec for rec in runner.passes if rec.n == {2: 16}]
    assert len(resumed) == 1 and resumed[0].anchor[2] == 66
    assert out.chunks("a") == [((14,), None), ((15, 16, 17), None), ((18, 19, 20), None), ((21, 22, 23), None),
                               ((24, 25, 26), None), ((27, 28, 29), "length")]
    assert out.chunks("b") == [((54,), None), ((55, 56, 57), None), ((58, 59, 60), None), ((61, 62, 63), None),
                               ((64, 65, 66), None), ((67, 68, 69), "length")]
    check_contexts(runner, {1: list(range(10, 30)), 2: list(range(50, 70))})
    assert all_pages_free(core) and core.metrics()["preemptions_total"] == 1


def test_preemption_of_a_prefilling_request():
    # "a" takes 2 pages, "long" (20 tokens + 3) the other 6. Step 0 prefills a's 4 tokens and long[0:4], step 1
    # long[4:12], then "a" (n = 7) needs a 3rd page: the newest admitted request is "long", still prefilling, so
    # it goes back to the queue (its chunks are lost) and is readmitted only when "a" has finished; it then
    # emits its first token as usual.
    core, runner = make_core("fixed:2", B=2, L=2, max_model_len=24, num_pages=8)
    out = Outputs()
    submit(core, out, "a", [10, 11, 12, 13], 20, seed=1)
    submit(core, out, "long", list(range(100, 120)), 4, seed=2)
    steps(core, out, 2)
    m = core.metrics()
    assert (m["preemptions_total"], m["requests_waiting"], m["requests_running"]) == (1, 1, 1)
    assert m["free_pages"] == 8 - 3  # "a" alone, with n = 10 after two passes
    drain(core, out)
    assert [(p.start, len(p.tokens)) for p in runner.prefills if p.seed == 2] == [(0, 4), (4, 8), (0, 8), (8, 8),
                                                                                  (16, 4)]
    assert [rec.R for rec in runner.passes if 2 in rec.slots] == [1]  # "long" only decodes after "a" is done
    assert out.chunks("long") == [((120,), None), ((121, 122, 123), "length")]
    assert out.tokens("a") == list(range(14, 34)) and out.finish("a") == "length"
    check_contexts(runner, {1: list(range(10, 34)), 2: list(range(100, 124))})
    assert all_pages_free(core) and core.stats["preemptions_total"] == 1


def test_prompt_logprobs_under_preemption():
    """The two preemptions above with prompt logprobs asked: a request preempted in its prefill computes them
    again from its first chunk (those of the lost chunk are dropped, not reported twice); one preempted after
    its first output recomputes its cache without them (they were already reported)."""
    core, runner = make_core("fixed:2", B=2, L=2, max_model_len=24, num_pages=8)
    out = Outputs()
    long = list(range(100, 120))
    submit(core, out, "a", [10, 11, 12, 13], 20, seed=1, prompt_logprobs=1)
    submit(core, out, "long", long, 4, seed=2, prompt_logprobs=3)
    drain(core, out)
    assert core.stats["preemptions_total"] == 1
    assert [e[1:] for e in runner.events if e[0] == "prompt_logprobs" and e[1] == 2] == [
        (2, 0, 4), (2, 4, 8), (2, 0, 8), (2, 8, 8), (2, 16, 3)]
    assert got_prompt_logprobs(out, "long") == expected_prompt_logprobs(long, 3)
    assert got_prompt_logprobs(out, "a") == expected_prompt_logprobs([10, 11, 12, 13], 1)
    assert out.tokens("long") == [120, 121, 122, 123]

    core, runner = make_core("fixed:2", B=2, L=2, max_model_len=24, num_pages=8)
    out = Outputs()
    submit(core, out, "a", [10, 11, 12, 13], 16, seed=1)
    submit(core, out, "b", [50, 51, 52, 53], 16, seed=2, prompt_logprobs=0)
    drain(core, out)
    assert core.stats["preemptions_total"] == 1  # "b", after its first output: recomputed without them
    assert [e[1:] for e in runner.events if e[0] == "prompt_logprobs"] == [(2, 0, 3)]
    assert got_prompt_logprobs(out, "b") == expected_prompt_logprobs([50, 51, 52, 53], 0)
    assert out.tokens("b") == list(range(54, 70))


# ---- schedulers -----------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("n, caps", [
    (0, [1, 2, 4, 4, 4, 2, 1]),  # R tokens
    (1, [2, 4, 8, 8, 8, 4, 2]),  # R(1 + 1) → 2, 4, 6
    (3, [4, 8, 15, 15, 15, 8, 4]),  # R(1 + 3) → 4, 8, 12
    (6, [8, 15, 15, 15, 15, 15, 8]),  # ℓ = min(6, L) = 4: R · 5 → 5, 10, 15
])
def test_fixed_lengths_and_buckets(n, caps):
    core, runner = make_core(f"fixed:{n}", B=3, L=4, accept=lambda seed, rnd: 0)  # buckets (1, 2, 4, 8, 15)
    assert runner.capacities == (1, 2, 4, 8, 15)
    out = Outputs()
    for seed, max_tokens in ((1, 8), (2, 6), (3, 4)):  # a step apart, one token per pass: R = 1, 2, 3, 3, 3, 2, 1
        submit(core, out, f"r{seed}", [seed], max_tokens, seed)
        steps(core, out, 1)
    drain(core, out)
    assert [rec.R for rec in runner.passes] == [1, 2, 3, 3, 3, 2, 1]
    assert [rec.capacity for rec in runner.passes] == caps
    for rec in runner.passes:
        assert not rec.host_drafted and rec.budget is None
        # The running requests are compacted into rows 0..R−1 of the batch bucket (1, 2 or 3 rows here).
        assert rec.lengths_arg == [min(n, 4)] * rec.R


# Survival per request (dyadic, so exact in f32): seed 1 a = [1, .5, .5, .25], seed 2 a = [.5, .25, .125, .0625].
CONF_BY_SEED = {1: [1.0, 0.5, 1.0, 0.5], 2: [0.5, 0.5, 0.5, 0.5]}


def two_request_run(scheduler, sps=None):
    core, runner = make_core(scheduler, B=2, L=4, sps=sps, accept=lambda seed, rnd: 0,
                             conf=lambda t, s, seed, rnd: np.array(CONF_BY_SEED[seed], np.float32))
    assert runner.capacities == (1, 2, 4, 8, 10)
    out = Outputs()
    submit(core, out, "r1", [10], 6, seed=1)
    steps(core, out, 1)
    submit(core, out, "r2", [20], 6, seed=2)
    drain(core, out)
    assert out.tokens("r1") == continuation([10], 6)[0] and out.tokens("r2") == continuation([20], 6)[0]
    # r1 alone for one pass, then both, then r2 alone for one pass.
    assert [sorted(rec.slots) for rec in runner.passes] == [[1]] + [[1, 2]] * 4 + [[2]]
    return runner


@pytest.mark.parametrize("x, ell", [(0.5, {1: 3, 2: 1}), (0.25, {1: 4, 2: 2}), (1.0, {1: 1, 2: 0}),
                                    (0.1, {1: 4, 2: 3}), (0.0, {1: 4, 2: 4})])
def test_threshold_lengths(x, ell):
    runner = two_request_run(f"threshold:{x}")
    for rec in runner.passes:
        assert rec.host_drafted and rec.budget is None
        assert rec.ell == {seed: ell[seed] for seed in rec.slots}
        assert rec.capacity == bucket(rec.R + sum(rec.ell.values()), (1, 2, 4, 8, 10))


def test_dspark_sync_breaks_at_the_first_dip():
    # SPS(N) = 1 for N ≤ 4, 0.8 for N ≤ 8, 0.75 for N ≤ 10. Both running (R = 2), the admission path is
    # (r1,1) 1, (r1,2) .5, (r1,3) .5, (r2,1) .5, (r1,4) .25, … with Θ_m = (2 + Σa) · SPS(2 + m):
    # Θ = 2, 3, 3.5, 3.2 (dip: break) → ℓ = (2, 0). Without the break the global maximum is Θ_6 = 5 · .8 = 4,
    # i.e. ℓ = (4, 2): the engine must not run that (it is the biased retrospective search).
    # Alone (R = 1): r1 Θ = 1, 2, 2.5, 3, 2.6 → 3; r2 Θ = 1, 1.5, 1.75, 1.875, 1.55 → 3.
    runner = two_request_run("dspark-sync", sps={4: 1.0, 8: 0.8, 10: 0.75})
    expected = [{1: 3}] + [{1: 2, 2: 0}] * 4 + [{2: 3}]
    assert [rec.ell for rec in runner.passes] == expected
    assert [rec.capacity for rec in runner.passes] == [4] * 6
    assert all(rec.host_drafted and rec.budget is None for rec in runner.passes)


def zero_at(c: int) -> np.ndarray:
    """A confidence row whose survival is 1 for the first c draft tokens and 0 after: c candidates."""
    return np.array([1.0] * c + [0.0] * (4 - c), np.float32)[:4]


def test_dspark_budget_uses_confidence_from_two_passes_earlier():
    # Pass t's confidences give slot 0 c0 = t % 5 and slot 1 c1 = (t + 2) % 5 candidates. With a flat SPS table
    # Θ grows with every candidate, so K = the number of stale candidates: slot rows from pass t − 2, a request
    # not in that pass priced at that pass's mean row; no history for passes 0 and 1.
    counts = [(t % 5, (t + 2) % 5) for t in range(40)]
    core, runner = make_core("dspark", B=2, L=4, max_model_len=64, sps={4: 1.0, 8: 1.0, 10: 1.0},
                             conf=lambda t, s, seed, rnd: zero_at(counts[t][s]))
    out = Outputs()
    submit(core, out, "r1", [10, 11], 50, seed=1)
    steps(core, out, 1)
    submit(core, out, "r2", [20, 21], 50, seed=2)
    steps(core, out, 7)
    passes = runner.passes[:8]
    assert [rec.R for rec in passes] == [1, 2, 2, 2, 2, 2, 2, 2]
    # t:        0  1  2      3      4      5      6      7
    # K from:   -  -  (0,·0) (1,3)  (1,3)  (3,0)  (4,1)  (0,2)    ← the newest drafting pass ≤ t−2's counts
    #                 ·0: r2 was not in pass 0, whose mean row (r1's alone) has 0 candidates: K = 0, so pass 2
    #                 is a plain step (no draft pass, no confidences) and pass 4 reads pass 1's
    assert [rec.budget for rec in passes] == [4, 8, None, 4, 4, 3, 5, 2]
    assert [rec.plain for rec in passes] == [False, False, True] + [False] * 5
    # ℓ = top-K of the *current* survival, slot 0 first on ties: min(K, c0), then min(K − ℓ0, c1).
    assert [(rec.ell[1], rec.ell.get(2, 0)) for rec in passes] == [
        (0, 0), (1, 3), (0, 0), (3, 0), (4, 0), (0, 2), (1, 3), (2, 0)]
    assert [rec.capacity for rec in passes] == [8, 10, 2, 8, 8, 8, 8, 4]  # smallest bucket ≥ R + K
    assert all(not rec.host_drafted and rec.want_confidence and rec.lengths_arg is None
               for rec in passes if not rec.plain)
    drain(core, out)
    for rid, prompt in (("r1", [10, 11]), ("r2", [20, 21])):
        assert out.tokens(rid) == continuation(prompt, 50)[0]


def test_dspark_budget_capped_by_the_largest_bucket():
    core, runner = make_core("dspark", B=2, L=4, capacities=(4, 8), sps={4: 1.0, 8: 1.0},
                             conf=lambda t, s, seed, rnd: np.ones(4, np.float32))
    out = Outputs()
    submit(core, out, "r1", [10], 20, seed=1)
    steps(core, out, 1)
    submit(core, out, "r2", [20], 20, seed=2)
    steps(core, out, 2)
    # R = 1: K = 4 → bucket 8. R = 2: 8 candidates, K = 8 − R = 6 → bucket 8.
    assert [(rec.R, rec.budget, rec.capacity) for rec in runner.passes] == [(1, 4, 8), (2, 6, 8), (2, 6, 8)]
    assert [sum(rec.ell.values()) for rec in runner.passes] == [4, 6, 6]


def test_dspark_takes_plain_steps_when_the_cost_model_says_drafts_do_not_pay():
    """Survival 0.1 per draft token and a plain step twice as fast as any speculative one: Θ_plain = R · 2
    beats (R + Σa) · 1, so the engine runs plain steps (no draft pass, ℓ = 0) once stale confidences exist,
    drafting again after PROBE_EVERY plain steps to refresh them, then after twice as many while drafts still
    do not pay; outputs stay exact. With the plain step as slow as a speculative one, it always drafts."""
    from serve.scheduler import PROBE_EVERY, SpsTable

    def run(plain_sps):
        core, runner = make_core("dspark", B=2, L=4, max_model_len=96,
                                 conf=lambda t, s, seed, rnd: np.full(4, 0.1, np.float32))
        shapes = runner.verify_shapes()
        core.set_sps(SpsTable({(bb, c, 0): 1.0 for bb, c in shapes}, {(bb, 0): plain_sps for bb in (1, 2)}))
        out = Outputs()
        submit(core, out, "r1", [10, 11], 60, seed=1)
        drain(core, out)
        assert out.tokens("r1") == continuation([10, 11], 60)[0]
        return [rec.plain for rec in runner.passes], runner.passes

    plain, passes = run(2.0)
    assert plain[:2] == [False, False]  # no confidences two passes old yet
    first = 2 + PROBE_EVERY  # the first probe
    assert plain[2:first] == [True] * PROBE_EVERY and plain[first] is False
    second = first + 1 + 2 * PROBE_EVERY  # the run after a probe that changed nothing doubles
    assert len(plain) > second, len(plain)
    assert plain[first + 1 : second] == [True] * (2 * PROBE_EVERY) and plain[second] is False
    assert sum(plain) > 0.8 * len(plain)
    # A probe drafts for fresh confidences but verifies no draft token: the cost model has just priced any
    # verified draft below a plain step (red when probes verified the capacity search's budget).
    probes = [rec for rec in passes[first:] if not rec.plain]
    assert probes and all(rec.budget == 0 and rec.want_confidence and not any(rec.ell.values()) for rec in probes)
    always, passes = run(1.0)
    assert not any(always) and any(rec.budget for rec in passes)


@pytest.mark.parametrize("pipelined", [False, True])
def test_dspark_prices_drafts_by_what_they_deliver(pipelined):
    """A confidence head that promises survival 0.9 per position while the target rejects every draft: by the
    confidences a speculative step pays (Σa = 3.1 > 1 with a plain step priced at twice a full one), by what it
    delivers it never does. The engine's gain calibration (realized / predicted accepted tokens of its
    speculative steps) stops it after two such steps (three when pipelined: round n + 1 is planned before
    round n is read); it re-tests the drafter once that evidence has decayed. Probes are not evidence. A
    drafter whose drafts are accepted keeps speculating on every step. Outputs stay exact."""
    from serve.scheduler import SpsTable

    def run(accept):
        core, runner = make_core("dspark", B=2, L=4, max_model_len=300, accept=accept, pipelined=pipelined,
                                 conf=lambda t, s, seed, rnd: np.full(4, 0.9, np.float32))
        core.set_sps(SpsTable({(bb, c, 0): 1.0 for bb, c in runner.verify_shapes()}, {(bb, 0): 2.0 for bb in (1, 2)}))
        out = Outputs()
        submit(core, out, "r1", [10, 11], 260, seed=1)
        drain(core, out)
        assert out.tokens("r1") == continuation([10, 11], 260)[0]
        return core, [i for i, rec in enumerate(runner.passes) if not rec.plain and rec.budget]

    core, spec = run(lambda seed, rnd: 0)
    assert all(m == 0 for rec in core.runner.passes for m in rec.m.values())  # nothing was ever accepted
    assert len(spec) <= 10, spec  # red without the calibration: ~all 260 steps speculate
    assert max(spec) > 20, spec  # the re-test once the evidence has decayed (red without `tick`)
    # The evidence is exactly the speculative passes after the first two (no stale confidences yet): probes
    # (budget 0) and plain steps add nothing. 4 positions at survival 0.9^k each, nothing accepted.
    cal = core.scheduler.calibration
    assert cal.accepted == 0 and 0 < cal.predicted <= 3.1 * (len(spec) - 2) + 1e-6, (cal.predicted, spec)
    assert core.metrics()["draft_gain_ratio"] < 0.5
    core, spec = run(None)  # every draft accepted: ρ stays ≥ 1 and every step speculates
    assert all(not rec.plain for rec in core.runner.passes) and core.metrics()["draft_gain_ratio"] >= 1.0


def test_gain_calibration_ratio():
    from serve.scheduler import GainCalibration

    cal = GainCalibration(prior=2.0, half_life=10.0)
    assert cal.ratio == 1.0  # no evidence: the confidences are taken at their word
    cal.observe(6.0, 0)
    assert cal.ratio == pytest.approx(2.0 / 8.0)
    conf = np.array([[0.8, 0.5, 0.5], [0.4, 1.0, 1.0]], np.float32)
    scaled = cal.apply(conf)
    assert scaled[:, 0] == pytest.approx([0.2, 0.1]) and (scaled[:, 1:] == conf[:, 1:]).all()
    for _ in range(10):
        cal.tick()  # one half-life: the evidence weighs half
    assert cal.ratio == pytest.approx(2.0 / 5.0)
    cal.observe(2.0, 10)  # a drafter better than its word: ρ > 1, capped, survival clipped at 1
    assert cal.ratio == pytest.approx(1.5) and cal.apply(conf)[0, 0] == 1.0


def test_dspark_never_drafts_for_an_empty_budget():
    """Confidences of 0 give the capacity search K = 0, and a plain step priced like the full step it is a part
    of (the table a noisy profile can give): the tie takes the plain step. Before, Θ_plain had to beat Θ_0
    strictly, so every step drafted a block and verified none of it (session 11: 91% of c = 1 steps)."""
    from serve.scheduler import PROBE_EVERY, SpsTable

    core, runner = make_core("dspark", B=2, L=4, max_model_len=96,
                             conf=lambda t, s, seed, rnd: np.zeros(4, np.float32))
    core.set_sps(SpsTable({(bb, c, 0): 1.0 for bb, c in runner.verify_shapes()}, {(bb, 0): 1.0 for bb in (1, 2)}))
    out = Outputs()
    submit(core, out, "r1", [10, 11], 40, seed=1)
    drain(core, out)
    assert out.tokens("r1") == continuation([10, 11], 40)[0]
    plain = [rec.plain for rec in runner.passes]
    assert plain[2 : 2 + PROBE_EVERY] == [True] * PROBE_EVERY, plain
    assert sum(plain) > 0.8 * len(plain), plain


def test_sps_smoothing_prices_a_plain_step_at_least_as_its_full_step():
    """A plain step is the full step of its batch bucket at the smallest capacity without the draft pass, so
    the smoothed table never prices it slower; then it is monotone in context like the rest."""
    from serve.scheduler import SpsTable

    entries = {(1, 1, 64): 10.0, (1, 2, 64): 8.0, (1, 1, 512): 9.0, (1, 2, 512): 7.0, (2, 2, 64): 6.0}
    table = SpsTable(entries, {(1, 64): 7.0, (1, 512): 12.0, (2, 64): 6.5}).smoothed()
    assert table.plain == {(1, 64): 10.0, (1, 512): 10.0, (2, 64): 6.5}
    assert table.entries == entries  # already monotone: unchanged


def test_dspark_prices_a_newcomer_like_the_running_requests_not_as_a_sure_accept():
    """Under steady arrivals the requests without confidences yet are priced at the last pass's mean, so a
    drafter that does not pay (survival 0.1, plain steps twice as fast) keeps plain steps with newcomers
    joining: a newcomer counted as certain acceptance (1 per position) made every step after an arrival
    speculative and reset the probe backoff (red on that rule). Outputs stay exact."""
    from serve.scheduler import SpsTable

    core, runner = make_core("dspark", B=2, L=4, max_model_len=96, num_pages=64,
                             conf=lambda t, s, seed, rnd: np.full(4, 0.1, np.float32))
    shapes = runner.verify_shapes()
    core.set_sps(SpsTable({(bb, c, 0): 1.0 for bb, c in shapes}, {(bb, 0): 2.0 for bb in (1, 2)}))
    out = Outputs()
    submit(core, out, "long", [10, 11], 80, seed=1)
    prompts = {}
    for i in range(12):  # a short request joins every 6 steps, each finishing before the next joins
        prompts[f"s{i}"] = [20 + i, 21 + i]
        submit(core, out, f"s{i}", prompts[f"s{i}"], 3, seed=2 + i)
        steps(core, out, 6)
    drain(core, out)
    assert out.tokens("long") == continuation([10, 11], 80)[0]
    for rid, p in prompts.items():
        assert out.tokens(rid) == continuation(p, 3)[0]
    plain = [rec.plain for rec in runner.passes]
    assert sum(plain[2:]) > 0.9 * len(plain[2:]), plain  # 58 of 61 here; 34 of 45 with newcomers at 1


# ---- metrics --------------------------------------------------------------------------------------------------------
def test_metrics_by_hand():
    # fixed:2, L = 4. r1 accepts every draft token, r2 none, r3 wants one token.
    #   step 0: admit r1, r2 (r3 waits); prefill both in one pass; pass r1: ℓ 2, m 2 → 3 tokens; r2: ℓ 2, m 0
    #           → 1 token.
    #   step 1: pass r1 (3 tokens: 7 = max) + r2 (1 token: 3 = max); both finish.
    #   step 2: admit r3, its prefill token ends it; no pass.
    core, runner = make_core("fixed:2", B=2, L=4, max_model_len=32, num_pages=16,
                        accept=lambda seed, rnd: {1: 4, 2: 0, 3: 0}[seed])
    out = Outputs()
    for seed, max_tokens in ((1, 7), (2, 3), (3, 1)):
        submit(core, out, f"r{seed}", [seed * 20, seed * 20 + 1], max_tokens, seed)
    m = core.metrics()
    assert (m["requests_waiting"], m["requests_running"], m["free_pages"], m["total_pages"]) == (3, 0, 16, 16)
    assert (m["tokens_per_step"], m["verify_tokens_per_pass"], m["acceptance_per_position"]) == (0, 0, [0] * 4)
    gauges = []
    for _ in range(3):
        steps(core, out, 1)
        m = core.metrics()
        gauges.append((m["requests_running"], m["requests_waiting"], m["free_pages"]))
    # Pages of 4, admission needs prompt + 5 = 7 positions (2 pages). After step 0: r1 2 + r2 2 → 12 free.
    # After step 1 both finished (r1 had grown to 3 pages: n + 5 = 10): all back, r3 still waiting.
    assert gauges == [(2, 1, 12), (0, 1, 16), (0, 0, 16)]
    assert not core.has_work()
    assert runner.prefill_passes == [(1, 2), (3,)]
    assert m["steps_total"] == 2 and m["requests_total"] == 3 and m["prefill_passes_total"] == 2
    assert m["prompt_tokens_total"] == 6 and m["generation_tokens_total"] == 7 + 3 + 1
    assert m["tokens_per_step"] == 8 / 4  # emitted 3 + 1 + 3 + 1 over 4 row-steps
    assert m["verify_tokens_per_pass"] == (6 + 6) / 2
    # Position 1 reached 4 times (2 accepted, r1), position 2 twice (r1, accepted), 3 and 4 never (ℓ = 2).
    assert m["acceptance_per_position"] == [0.5, 1.0, 0.0, 0.0]
    assert m["sps_table"] == {f"{bb}x{c}@0": 1.0 for bb in (1, 2) for c in runner.capacities}
    assert (m["preemptions_total"], m["aborted_total"]) == (0, 0)
    assert out.chunks("r1") == [((22,), None), ((23, 24, 25), None), ((26, 27, 28), "length")]
    assert out.chunks("r2") == [((42,), None), ((43,), None), ((44,), "length")]
    assert out.chunks("r3") == [((62,), "length")]


# ---- the threaded Engine --------------------------------------------------------------------------------------------
def test_engine_thread():
    core, runner = make_core("fixed:2", B=3, L=2, accept=lambda seed, rnd: (seed + rnd) % 3)
    engine = Engine(core, model_name="mock").start()
    out = Outputs()
    calls = collections.Counter()

    def broken(o):
        calls[o.finish_reason] += 1
        raise RuntimeError("consumer bug")

    def client(k: int) -> None:
        for i in range(5):
            seed = 1 + 5 * k + i
            engine.add_request(EngineRequest(request_id=f"r{seed}", prompt_ids=[seed * 30], on_output=out,
                                             params=SamplingParams(max_tokens=1 + seed % 9, seed=seed)))

    try:
        threads = [threading.Thread(target=client, args=(k,)) for k in range(4)]
        for t in threads:
            t.start()
        engine.add_request(EngineRequest(request_id="broken", prompt_ids=[900], on_output=broken,
                                         params=SamplingParams(max_tokens=6, seed=99)))
        for t in threads:
            t.join()
        assert engine.wait_idle(timeout=10)
        assert engine.health() and engine.idle()
        for seed in range(1, 21):
            assert out.tokens(f"r{seed}") == continuation([seed * 30], 1 + seed % 9)[0]
            assert out.finish(f"r{seed}") == "length"
        assert calls["length"] == 1 and calls[None] >= 1  # every callback ran, the last one final
        assert engine.metrics()["requests_total"] == 21 and all_pages_free(core)
    finally:
        engine.stop()
    assert not engine.health()
    with pytest.raises(RuntimeError, match="not running"):
        engine.add_request(EngineRequest(request_id="late", prompt_ids=[1], on_output=out,
                                         params=SamplingParams(seed=1)))


def test_engine_device_error_fails_every_request():
    core, runner = make_core("fixed:1", B=2, L=2, fail_at_pass=2)
    out = Outputs()
    for seed in (1, 2, 3):  # queued before the thread starts, so none can arrive after the loop died
        submit(core, out, f"r{seed}", [seed], 20, seed)
    engine = Engine(core, model_name="mock").start()
    try:
        assert engine.wait_idle(timeout=10)
        assert not engine.health()
        for seed in (1, 2, 3):
            last = out.by_id[f"r{seed}"][-1][1]
            assert last.finish_reason == "abort" and last.error == "engine error: RuntimeError: mock device error"
    finally:
        engine.stop()
