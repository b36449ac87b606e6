"""Per-step verification decisions of the serving engine (paper §3.2.2, §5.2; explainer parts 7–9).

Schedulers (flag `--scheduler`):
  none          target only: every running request verifies just its anchor (ℓ = 0), no drafter runs.
  fixed:N       ℓ = min(N, L) for every request.
  threshold:X   ℓ = the leading draft tokens with survival a_k ≥ X (current step; a host sync per step).
  dspark-sync   Algorithm 1 with the early-stop break on the current step's survival (host sync per step).
  dspark        §5.2: the pass capacity K is fixed from survival two steps old by a global search over the
                SPS table (no break); the current step's top-K draft tokens by survival fill it on device.
                The host never waits for the current drafts to choose K.
A pass over R running requests with Σℓ draft tokens holds R + Σℓ tokens and runs in the smallest capacity
bucket that fits; `sps` is the profiled steps/s per bucket, expanded to a per-token step table.
"""

from __future__ import annotations

import dataclasses
import json

import jax
import numpy as np

from dspark_jax.policy import Policy
from dspark_jax.scheduling import (
    bucket_sps,
    capacity_search_host,
    prefix_schedule,
    survival,
    survival_host,
    threshold_lengths,
)

SchedulerSpec = Policy  # the one parser and meaning of policy strings (dspark_jax/policy.py)


def pick_bucket(tokens: int, buckets) -> int:
    """The smallest capacity bucket ≥ tokens."""
    for b in buckets:
        if b >= tokens:
            return int(b)
    raise ValueError(f"{tokens} tokens exceed the largest capacity bucket {buckets[-1]}")


def token_sps_table(sps_at_buckets, buckets) -> np.ndarray:
    """Per-token SPS (index = tokens in the pass) from the per-bucket table."""
    return np.asarray(bucket_sps(sps_at_buckets, buckets, int(buckets[-1])))


# Jitted once per shape: eager jnp here would cost dozens of small dispatches on every engine step.
_threshold = jax.jit(lambda conf, x, active: threshold_lengths(survival(conf), x, active))
_prefix = jax.jit(lambda conf, sps, active: prefix_schedule(survival(conf), sps, active))


def host_lengths(spec: SchedulerSpec, conf: np.ndarray | None, active: np.ndarray, block_size: int,
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


def warm_scheduler(spec: SchedulerSpec, batch_buckets, block_size: int, max_tokens: int) -> None:
    """Compiles the scheduler's jitted search for every batch bucket (start-up; a step never compiles)."""
    table = np.zeros(max_tokens + 1, np.float32)
    for bb in batch_buckets:
        conf, active = np.ones((bb, max(block_size, 1)), np.float32), np.ones(bb, bool)
        if spec.kind == "dspark":
            dspark_capacity(conf, active, block_size, table)
        elif spec.kind in ("threshold", "dspark-sync"):
            host_lengths(spec, conf, active, block_size, table)


@dataclasses.dataclass
class SpsTable:
    """The profiled cost model: steps/s of a full step (draft + verify) by (batch bucket, capacity bucket,
    context length). Profiled with repeats at a few context lengths, smoothed to be monotone (more tokens or
    longer contexts never make a step faster), saved and reloaded as JSON (`--sps-table PATH`).

    `token_table(rows, context)` is what the schedulers read: SPS indexed by tokens in the pass for the batch
    bucket of `rows` running requests, linearly interpolated between the profiled context lengths (clamped at
    the ends), so the capacity search prices long contexts correctly.
    """

    entries: dict[tuple[int, int, int], float]  # (batch bucket, capacity, context) → steps/s
    plain: dict[tuple[int, int], float] = dataclasses.field(default_factory=dict)  # (batch, context) → plain steps/s

    @property
    def contexts(self) -> list[int]:
        return sorted({c for _, _, c in self.entries})

    def smoothed(self) -> SpsTable:
        """Running minimum along capacity (for each batch bucket and context), then along context; a plain
        step is at least as fast as the full step of its batch bucket at the smallest capacity profiled there
        and the same context (it is that step without the draft pass and with ℓ = 0), then monotone in context."""
        out = dict(self.entries)
        for bb, ctx in {(b, c) for b, _, c in out}:
            best = np.inf
            for cap in sorted(k[1] for k in out if k[0] == bb and k[2] == ctx):
                best = min(best, out[bb, cap, ctx])
                out[bb, cap, ctx] = best
        for bb, cap in {(b, c) for b, c, _ in out}:
            best = np.inf
            for ctx in sorted(k[2] for k in out if k[0] == bb and k[1] == cap):
                best = min(best, out[bb, cap, ctx])
                out[bb, cap, ctx] = best
        plain = dict(self.plain)
        for bb, ctx in plain:
            caps = [c for b, c, x in out if b == bb and x == ctx]
            if caps:
                plain[bb, ctx] = max(plain[bb, ctx], out[bb, min(caps), ctx])
        for bb in {b for b, _ in plain}:
            best = np.inf
            for ctx in sorted(c for b, c in plain if b == bb):
                best = min(best, plain[bb, ctx])
                plain[bb, ctx] = best
        return SpsTable(out, plain)

    def plain_at(self, bb: int, context: float) -> float | None:
        """Steps/s of a plain step (no draft pass) for batch bucket bb, or None when not profiled."""
        ctxs = sorted(c for b, c in self.plain if b == bb)
        if not ctxs:
            return None
        return float(np.interp(context, ctxs, [self.plain[bb, c] for c in ctxs]))

    def at(self, bb: int, cap: int, context: float) -> float:
        ctxs = [c for c in self.contexts if (bb, cap, c) in self.entries]
        if not ctxs:
            return 0.0
        vals = [self.entries[bb, cap, c] for c in ctxs]
        return float(np.interp(context, ctxs, vals))

    def token_table(self, bb: int, context: float, capacities) -> np.ndarray:
        """f32 [capacities[-1] + 1]: SPS(N) = SPS of the smallest bucket ≥ N profiled for `bb`; 0 where none."""
        caps = [c for c in capacities if any(k[0] == bb and k[1] == c for k in self.entries)]
        table = np.zeros(int(capacities[-1]) + 1, np.float32)
        if not caps:
            return table
        sps_at = [self.at(bb, c, context) for c in caps]
        return np.asarray(bucket_sps(sps_at, caps, int(capacities[-1])), np.float32)

    def save(self, path: str) -> None:
        rows = [{"batch": b, "capacity": c, "context": x, "sps": v} for (b, c, x), v in sorted(self.entries.items())]
        plain = [{"batch": b, "context": x, "sps": v} for (b, x), v in sorted(self.plain.items())]
        with open(path, "w") as f:
            json.dump({"format": "dspark-sps-v2", "entries": rows, "plain": plain}, f, indent=1)

    @classmethod
    def load(cls, path: str) -> SpsTable:
        try:
            with open(path) as f:
                data = json.load(f)
            if data.get("format") != "dspark-sps-v2":
                raise ValueError(f"unknown format {data.get('format')!r}")
            return cls({(int(r["batch"]), int(r["capacity"]), int(r["context"])): float(r["sps"])
                        for r in data["entries"]},
                       {(int(r["batch"]), int(r["context"])): float(r["sps"]) for r in data.get("plain", [])})
        except (OSError, ValueError, KeyError, TypeError) as e:
            raise ValueError(f"not an SPS table: {path}: {e}") from None

    def covers(self, shapes) -> bool:
        """Whether every (batch bucket, capacity) the runner can take has an entry."""
        have = {(b, c) for b, c, _ in self.entries}
        return all(tuple(s) in have for s in shapes)

    def summary(self) -> str:
        ctx = self.contexts[0] if self.contexts else 0
        parts = [f"{b}x{c}: {self.entries[b, c, ctx]:.1f}" for b, c, x in sorted(self.entries) if x == ctx]
        return f"steps/s at context {ctx} (batch x capacity): " + ", ".join(parts)
