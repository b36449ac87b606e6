"""The serving schedulers: per-round verification decisions of the engine (paper §3.2.2, §5.2; explainer 7–9).

A scheduler (the `Scheduler` protocol, as vLLM's draft-length policies) owns its state and answers each round
with a typed `Plan`: a plain step (no draft pass), a probe (a draft pass for fresh confidences, no draft token
verified) or a speculative step with ℓ per row (`lengths`) or a top-K `budget`, in a capacity bucket. The
engine (serve/engine.py) owns everything else: queues, pages, preemption, pipelining and commit.

Policies (flag `--scheduler`, parsed by dspark_jax/policy.py):
  none          `TargetOnly`: every step plain (ℓ = 0), no drafter runs.
  fixed:N       `HostLengths`: ℓ = min(N, L) for every request.
  threshold:X   `HostLengths`: ℓ = the leading draft tokens with survival a_k ≥ X (current step; a host sync).
  dspark-sync   `HostLengths`: Algorithm 1 with the early-stop break on the current survival (a host sync).
  dspark        `DsparkScheduler`, §5.2: the pass capacity K from survival at least two passes old by a global
                search over the SPS table (no break); the current step's top-K draft tokens by survival fill it
                on device, so the host never waits for the current drafts; plain steps when drafts do not pay.
A pass over R running requests with Σℓ draft tokens holds R + Σℓ tokens and runs in the smallest capacity
bucket that fits; the SPS table (serve/sps_table.py) is expanded to a per-token step table.
"""

from __future__ import annotations

import collections
import dataclasses
import typing

import jax
import numpy as np

from dspark_jax.buckets import pick
from dspark_jax.policy import Policy
from dspark_jax.runner import StepKind
from dspark_jax.scheduling import (
    capacity_search_host,
    prefix_schedule,
    survival,
    survival_host,
    threshold_lengths,
)
from serve.sps_table import SpsTable

PROBE_EVERY = 8  # dspark: after this many plain steps in a row, one probe refreshes the confidences
PROBE_MAX = 64  # dspark: the longest run of plain steps between probes (the run doubles while drafts do not pay)


# Jitted once per shape: eager jnp here would cost dozens of small dispatches on every engine step.
_threshold = jax.jit(lambda conf, x, active: threshold_lengths(survival(conf), x, active))
_prefix = jax.jit(lambda conf, sps, active: prefix_schedule(survival(conf), sps, active))


def host_lengths(spec: Policy, conf: np.ndarray | None, active: np.ndarray, block_size: int,
                 sps_table: np.ndarray) -> np.ndarray:
    """ℓ per slot for the synchronous schedulers (none, fixed, threshold, dspark-sync); int32 [B]."""
    B = active.shape[0]
    if spec.kind == "none":
        return np.zeros(B, np.int32)
    if spec.kind == "fixed":
        return np.where(active, spec.max_draft(block_size), 0).astype(np.int32)
    if spec.kind == "threshold":
        return np.asarray(_threshold(conf, np.float32(spec.threshold), active))
    return np.asarray(_prefix(conf, sps_table, active))


def dspark_capacity(stale_conf: np.ndarray | None, active: np.ndarray, block_size: int,
                    sps_table: np.ndarray) -> int:
    """K (total draft tokens of the next pass) from stale confidences [B, L] by the global search over SPS.
    Without history yet (the first steps) the survival is taken as 1 for every draft token; slots whose
    stale row belonged to another request are treated the same way. Computed on the host (numpy), so it
    never waits behind the pass in flight on the device."""
    conf = np.ones((active.shape[0], block_size), np.float32) if stale_conf is None else stale_conf
    return capacity_search_host(survival_host(conf), sps_table, active)


class GainCalibration:
    """The realized yield of the dspark scheduler's speculative steps, fed back into its cost model.

    The capacity search and the plain-or-speculate choice price a step by its expected accepted tokens, the
    top-K stale survival Σ a_k. That figure is only as good as the confidence head's calibration on the live
    traffic: on prompts unlike its calibration data (or with confidences two steps old) it can promise
    drafts that the target then rejects, and each such step costs a full step's price for a plain step's
    tokens. This keeps two decaying sums over the speculative steps that verify drafts (probes verify none
    and are left out), predicted gain P (Σ top-K *stale* survival: what the choice was made on, so ρ covers
    staleness as well as miscalibration) and accepted tokens A, and scales survival by
    ρ = (A + prior) / (P + prior), clipped to [0, `max_ratio`] (exactly while c_1 · ρ ≤ 1; `apply`):
    calibrated traffic leaves ρ ≈ 1, a drafter that over-promises is priced by what it delivers. Both sums
    decay on every dspark pass (half-life `half_life` passes), so the prior returns when evidence gets old and
    the scheduler re-tests a drafter it had stopped trusting. The prior is in tokens: a drafter that never
    delivers is re-tested about once per `half_life` passes. One ratio for all positions and requests: it
    keeps the survival order, so it corrects how much the drafts are worth, not which ones are drafted.
    Scheduling only: ℓ never changes what is emitted."""

    def __init__(self, prior: float = 2.0, half_life: float = 128.0, max_ratio: float = 1.5):
        if not (prior > 0 and half_life > 0 and max_ratio > 0):
            raise ValueError(f"GainCalibration needs prior, half_life and max_ratio > 0, got {prior=}, "
                             f"{half_life=}, {max_ratio=}")
        self.prior, self.max_ratio = float(prior), float(max_ratio)
        self.decay = 0.5 ** (1.0 / half_life)
        self.predicted = self.accepted = 0.0

    @property
    def ratio(self) -> float:
        return float(np.clip((self.accepted + self.prior) / (self.predicted + self.prior), 0.0, self.max_ratio))

    def tick(self) -> None:
        """One dspark pass: old evidence fades."""
        self.predicted *= self.decay
        self.accepted *= self.decay

    def observe(self, predicted: float, accepted: int) -> None:
        """A speculative step's predicted gain (Σ top-K stale survival, unscaled) and its accepted tokens."""
        self.predicted += float(predicted)
        self.accepted += float(accepted)

    def apply(self, conf: np.ndarray) -> np.ndarray:
        """Confidences [B, L] whose survival is ρ × the given survival: c_1 scaled, clipped to 1 (so for ρ > 1
        a row already near certain is scaled less)."""
        out = np.array(conf, np.float32, copy=True)
        out[:, 0] = np.minimum(out[:, 0] * self.ratio, 1.0)
        return out


def warm_scheduler(spec: Policy, batch_buckets, block_size: int, max_tokens: int) -> None:
    """Compiles the scheduler's jitted search for every batch bucket (start-up; a step never compiles)."""
    table = np.zeros(max_tokens + 1, np.float32)
    for bb in batch_buckets:
        conf, active = np.ones((bb, max(block_size, 1)), np.float32), np.ones(bb, bool)
        if spec.kind == "dspark":
            dspark_capacity(conf, active, block_size, table)
        elif spec.kind in ("threshold", "dspark-sync"):
            host_lengths(spec, conf, active, block_size, table)


# ---- the schedulers --------------------------------------------------------------------------------------------
@dataclasses.dataclass(frozen=True, eq=False)
class Plan:
    """A scheduler's decision for one round of R rows in a batch bucket of Bb.

    capacity: the pass's token bucket (≥ R + the draft tokens it verifies). A speculative plan sets exactly
    one of `lengths` (int32 [Bb], ℓ per row chosen on the host) and `budget` (K ≥ 1 draft tokens, filled on
    device with the current step's top-K by survival); plain steps and probes set neither.
    read_confidence: read the round's confidences back (the dspark scheduler's history).
    predicted: dspark, a speculative step: Σ top-K stale survival (unscaled), what the gain calibration compares
    the accepted tokens with."""

    kind: StepKind
    capacity: int
    lengths: np.ndarray | None = None
    budget: int | None = None
    read_confidence: bool = False
    predicted: float | None = None

    def __post_init__(self):
        if self.kind is StepKind.SPECULATE:
            if (self.lengths is None) == (self.budget is None):
                raise ValueError("a speculative plan sets exactly one of lengths and budget")
            if self.budget is not None and self.budget < 1:
                raise ValueError(f"a speculative plan's budget is >= 1, got {self.budget}")
        elif self.lengths is not None or self.budget is not None:
            raise ValueError(f"a {self.kind.value} plan verifies no draft token")


@dataclasses.dataclass(frozen=True, eq=False)
class RoundInfo:
    """What a scheduler sees of the round it plans: the running requests in row order (rows 0..R−1 of a batch
    bucket of `batch_rows`), the longest context, the number the pass will get (the clock of stale
    confidences), and the current drafts' confidences f32 [batch_rows, L] (schedulers that sync on them)."""

    request_ids: tuple[str, ...]
    batch_rows: int
    context: int
    index: int
    confidence: np.ndarray | None = None

    @property
    def rows(self) -> int:
        return len(self.request_ids)

    @property
    def active(self) -> np.ndarray:
        return np.arange(self.batch_rows) < self.rows


@typing.runtime_checkable
class Scheduler(typing.Protocol):
    """A verification-length policy (as vLLM's draft-length policies): it owns its state and answers each
    round with a Plan. `EngineCore` owns everything else (queues, pages, preemption, pipelining, commit)."""

    policy: Policy
    syncs_on_drafts: bool  # plan() needs the current drafts' confidences (no pipelining; a host sync per step)
    ready: bool  # its cost model is in place (False while the SPS table is being profiled)
    sps: SpsTable

    def set_sps(self, sps: SpsTable | dict | None) -> None: ...

    def plan(self, info: RoundInfo) -> Plan: ...

    def observe(self, index: int, request_ids: tuple[str, ...], plan: Plan, result) -> None: ...

    def metrics(self) -> dict: ...


class _Priced:
    """The SPS cost model a scheduler reads: the table, its per-token expansion by (batch bucket, context / 64),
    and whether it is ready."""

    def __init__(self, policy: Policy, *, block_size: int, capacities, batch_buckets, sps=None):
        self.policy, self.L = policy, block_size
        self.capacities, self.batch_buckets = tuple(capacities), tuple(batch_buckets)
        self.syncs_on_drafts = policy.syncs_on_drafts
        self.set_sps(sps)

    def set_sps(self, sps: SpsTable | dict | None) -> None:
        """An SpsTable, a {capacity: steps/s} dict (the same for every batch bucket and context: tests, hand-made
        tables), or None (flat until profiled or loaded)."""
        self.ready = True
        if sps is None:
            sps = {c: 1.0 for c in self.capacities}
        if isinstance(sps, dict):
            sps = SpsTable({(bb, int(c), 0): float(v) for bb in self.batch_buckets for c, v in sps.items()})
        self.sps = sps
        self._token_tables: dict = {}

    def token_sps(self, batch_rows: int, context: int) -> tuple[np.ndarray, float | None]:
        """(per-token SPS table, plain steps/s or None) for this batch bucket at the batch's longest context,
        both read at the same context (the start of its 64-position window, cached): priced at two contexts, a
        plain step and the full step it is a part of could trade places on a tie."""
        key = (batch_rows, context // 64)
        if key not in self._token_tables:
            at = key[1] * 64
            self._token_tables[key] = (self.sps.token_table(batch_rows, at, self.capacities),
                                       self.sps.plain_at(batch_rows, at))
        return self._token_tables[key]

    def plain(self, info: RoundInfo) -> Plan:
        return Plan(StepKind.PLAIN, pick(info.rows, self.capacities))

    def observe(self, index: int, request_ids, plan: Plan, result) -> None:
        pass

    def metrics(self) -> dict:
        return {}


class TargetOnly(_Priced):
    """`none` (and `fixed:0`): every step plain."""

    def plan(self, info: RoundInfo) -> Plan:
        return self.plain(info)


class HostLengths(_Priced):
    """`fixed:N`, `threshold:X`, `dspark-sync`: ℓ per row chosen on the host (the last two from the current
    drafts' confidences, read back before the pass: `syncs_on_drafts`)."""

    def plan(self, info: RoundInfo) -> Plan:
        lengths = host_lengths(self.policy, info.confidence, info.active, self.L,
                               self.token_sps(info.batch_rows, info.context)[0])
        return Plan(StepKind.SPECULATE, pick(int(info.rows + lengths.sum()), self.capacities),
                    lengths=lengths)


class DsparkScheduler(_Priced):
    """`dspark` (§5.2): the pass capacity K from confidences at least two passes old by the global search over
    the SPS table, filled on device with the current step's top-K draft tokens, so the host never waits for the
    current drafts; a plain step when the cost model says drafts do not pay, and a probe now and then to keep
    the confidences fresh. Its state: the confidence history, the gain calibration, the probe clock and
    whether the SPS table is ready (plain steps until it is)."""

    def __init__(self, policy: Policy, **kw):
        super().__init__(policy, **kw)
        self.history: collections.deque = collections.deque(maxlen=2)  # (pass, {request id: confidence [L]})
        self.calibration = GainCalibration()  # realized / predicted gain of its speculative steps
        self.plain_run = 0  # consecutive plain steps
        self.probe_gap = PROBE_EVERY  # plain steps before the next probe (doubles while drafts do not pay)
        self.probed = False  # the last step was a probe
        self._stale_key, self._stale = None, None  # stale_confidence's last answer

    def plan(self, info: RoundInfo) -> Plan:
        if not self.ready:  # the safe policy until the table is profiled
            return self.plain(info)
        R, Bb = info.rows, info.batch_rows
        sps, plain_sps = self.token_sps(Bb, info.context)
        self.calibration.tick()
        raw = self.stale_confidence(info)
        stale = None if raw is None else self.calibration.apply(raw)  # priced by what drafts deliver
        budget = min(dspark_capacity(stale, info.active, self.L, sps), self.capacities[-1] - R)
        if self._plain_pays(stale, R, budget, sps, plain_sps):
            return self.plain(info)
        if budget == 0 and not self.probed:  # no draft token pays: a draft pass would verify none of them
            return self.plain(info)
        if self.probed:  # a probe is for its draft pass (fresh confidences): it verifies no draft token, as the
            return Plan(StepKind.PROBE, pick(R, self.capacities), read_confidence=True)  # cost model
            # has just priced verifying them below a plain step
        predicted = None if raw is None else _top_gain(raw[:R], budget)
        return Plan(StepKind.SPECULATE, pick(R + budget, self.capacities), budget=budget,
                    read_confidence=True, predicted=predicted)

    def observe(self, index: int, request_ids, plan: Plan, result) -> None:
        if plan.predicted is not None:
            self.calibration.observe(plan.predicted, int(result.num_accepted[: len(request_ids)].sum()))
        if result.confidence is not None:
            self.history.append((index, dict(zip(request_ids, result.confidence, strict=False))))

    def metrics(self) -> dict:
        return {"draft_gain_ratio": self.calibration.ratio}

    def _plain_pays(self, stale, R: int, K: int, sps: np.ndarray, plain_sps: float | None) -> bool:
        """Whether a plain step (no draft pass) beats the best speculative one by the cost model:
        Θ_plain = R · SPS_plain against Θ_K = (R + Σ top-K survival) · SPS(R + K). Survival is the stale one,
        scaled by the gain calibration ρ (as for K), so the choice never looks at the current drafts. After a
        run of plain steps one step drafts anyway (a probe, `probed`), so the confidences the choice rests on
        stay fresh: the run is `PROBE_EVERY` steps at first and doubles (up to `PROBE_MAX`) each time a probe
        leaves plain steps still ahead, so a drafter that does not pay costs ever fewer draft passes; a
        speculative step chosen on its merits resets it."""
        if plain_sps is None or stale is None:
            self.probed = False  # drafting for want of a cost model, not a probe
            return False
        if self.plain_run >= self.probe_gap:
            self.plain_run, self.probed = 0, True
            return False
        gain = _top_gain(stale[:R], K)
        theta_spec = (R + gain) * float(sps[min(R + K, len(sps) - 1)])
        plain = R * plain_sps >= theta_spec  # a tie (e.g. K = 0: a draft pass for nothing) takes the plain step
        if not plain:
            self.plain_run, self.probe_gap = 0, PROBE_EVERY
        else:
            if self.probed:
                self.probe_gap = min(2 * self.probe_gap, PROBE_MAX)
            self.plain_run += 1
        self.probed = False
        return plain

    def stale_confidence(self, info: RoundInfo) -> np.ndarray | None:
        """Confidences at least two passes old for the rows [Bb, L] (the newest such pass: after plain steps the
        last speculative pass may be old enough). A request without one yet (it joined since) gets the mean of
        that pass's rows: a newcomer is priced like the requests the drafter was last seen on, not as a sure
        accept (1), which under steady arrivals would draft every step on the newcomers' account."""
        usable = [(t, c) for t, c in self.history if t <= info.index - 2]
        if not usable:
            return None
        t, old = usable[-1]
        key = (t, info.request_ids, info.batch_rows)  # unchanged through a run of plain steps: built once
        if self._stale_key != key:
            prior = np.mean(np.stack(list(old.values())), axis=0) if old else np.ones(self.L, np.float32)
            conf = np.ones((info.batch_rows, self.L), np.float32)
            for i, rid in enumerate(info.request_ids):
                conf[i] = old.get(rid, prior)
            self._stale_key, self._stale = key, conf
        return self._stale


def make_scheduler(policy: Policy | str, *, block_size: int, capacities, batch_buckets, sps=None) -> Scheduler:
    """The scheduler object for a policy string (`--scheduler`) on a runner of draft block `block_size`."""
    policy = Policy.parse(policy) if isinstance(policy, str) else policy
    kw = dict(block_size=block_size, capacities=capacities, batch_buckets=batch_buckets, sps=sps)
    if policy.kind == "dspark":
        return DsparkScheduler(policy, **kw)
    if policy.kind == "none" or block_size == 0 or (policy.kind == "fixed" and policy.max_draft(block_size) == 0):
        return TargetOnly(policy, **kw)
    return HostLengths(policy, **kw)


def _top_gain(conf: np.ndarray, k: int) -> float:
    """Expected accepted tokens of the k draft tokens with the highest survival in conf [R, L]."""
    if k <= 0:
        return 0.0
    a = survival_host(conf, np.float64).ravel()
    return float(np.sort(a)[::-1][:k].sum())
