"""Verification-length policies: how many draft tokens of each request to verify (DSpark §3.2.2, §5.2).

Words (see also `verification.py`): request r in a batch of B slots drafts L tokens with confidence
c_{r,k} = P(draft token k accepted | tokens 1..k-1 accepted); its survival a_{r,k} = c_{r,1}⋯c_{r,k} is
the probability that draft token k is emitted. A policy picks verification lengths ℓ_r in 0..L.

The objective of one target pass over R active requests is the expected token throughput
    Θ = τ · SPS(N),   τ = Σ_r (1 + Σ_{k≤ℓ_r} a_{r,k}),   N = Σ_r (1 + ℓ_r) tokens in the pass,
with `sps` a profiled table f32 [Nmax+1] of steps per second indexed by N (index 0 unused; tokens beyond
the table are inadmissible, Θ = 0). Because a_{r,k} is non-increasing in k, admitting candidates (r, k)
in descending order of a_{r,k} always keeps each request's admitted set a prefix, so every policy here
walks one sorted admission path:
  * order: descending a; ties by request index r, then position k (a stable sort of the r-major
    flattening). Ties therefore never break prefix structure.
  * candidates: active requests with a_{r,k} > 0 (Algorithm 1, line 4). Inactive slots contribute
    nothing, not even their anchor token (+1 to both τ and N).
  * `a` is first made non-increasing by a running minimum along k (a no-op for `survival` output),
    so prefix structure holds even for slightly non-monotone inputs.

Policies:
  * `fixed_lengths`, `threshold_lengths`: the static baselines.
  * `prefix_schedule`: Algorithm 1 with its early-stop break, lossless with the current step's a.
  * `capacity_search` + `topk_fill`: the deployed §5.2 variant. The capacity K (global argmax, no break,
    robust to jagged SPS) must be computed from stale confidence (two steps old) so that it cannot
    depend on the current draft tokens; `topk_fill` then fills K slots from the current a. Feeding the
    current a to `capacity_search` is the retrospective search of Appendix A and is NOT lossless.

Shapes: a f32 [B, L]; active bool [B]; lengths int32 [B]. All policies are jittable.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np


def survival(confidence: jax.Array) -> jax.Array:
    """Survival a_k = c_1⋯c_k along the last axis.

    Args:
      confidence: f32 [..., L], conditional acceptance c_k in [0, 1].

    Returns:
      f32 [..., L], non-increasing along L (a running minimum guards against the cumulative product's
      rounding ever producing a_{k+1} > a_k).
    """
    return jax.lax.cummin(jnp.cumprod(confidence.astype(jnp.float32), axis=-1), axis=confidence.ndim - 1)


def _active(a: jax.Array, active: jax.Array | None) -> jax.Array:
    if a.ndim != 2:
        raise ValueError(f"survival must be [B, L], got {a.shape=}")
    if active is None:
        return jnp.ones(a.shape[:1], bool)
    if active.shape != a.shape[:1]:
        raise ValueError(f"active must be [B]={a.shape[:1]}, got {active.shape=}")
    return active.astype(bool)


def _leading_count(mask: jax.Array) -> jax.Array:
    """Number of leading True entries along the last axis, int32."""
    return jnp.sum(jnp.cumprod(mask.astype(jnp.int32), axis=-1), axis=-1).astype(jnp.int32)


def fixed_lengths(a: jax.Array, n, active: jax.Array | None = None) -> jax.Array:
    """ℓ_r = min(n, L) for every active request, 0 for inactive slots. a [B, L] only sets the shape."""
    active = _active(a, active)
    n = jnp.clip(jnp.asarray(n, jnp.int32), 0, a.shape[1])
    return jnp.where(active, n, 0).astype(jnp.int32)


def threshold_lengths(a: jax.Array, x, active: jax.Array | None = None) -> jax.Array:
    """ℓ_r = number of leading positions with survival a_{r,k} >= x (a threshold on a, not on c).

    Args:
      a: f32 [B, L] survival.
      x: scalar threshold (may be traced).
      active: optional bool [B]; inactive slots get 0.

    Returns:
      int32 [B].
    """
    active = _active(a, active)
    return jnp.where(active, _leading_count(a >= x), 0).astype(jnp.int32)


def _admission_path(a: jax.Array, active: jax.Array):
    """Sort all candidates (r, k) into the admission path.

    Returns:
      order: int32 [B*L], flat r-major index of the m-th candidate on the path.
      sorted_a: f32 [B*L], its survival (0 for non-candidates, which are sorted last).
      sorted_valid: bool [B*L], whether it is a candidate (active, a > 0).
      num_requests: int32 [], R = number of active slots.
    """
    a = jax.lax.cummin(a.astype(jnp.float32), axis=1)
    valid = active[:, None] & (a > 0)
    flat_a, flat_valid = a.reshape(-1), valid.reshape(-1)
    # Stable sort of the r-major flattening on -a: ties stay in (r, k) order, so a request's position
    # k+1 never overtakes its position k.
    order = jnp.argsort(jnp.where(flat_valid, -flat_a, jnp.inf), stable=True)
    sorted_a = jnp.where(flat_valid, flat_a, 0.0)[order]
    return order, sorted_a, flat_valid[order], jnp.sum(active).astype(jnp.int32)


def _throughput_path(sorted_a, sorted_valid, num_requests, sps):
    """Θ_m for m = 0..B*L admitted candidates, f32 [B*L+1]; -inf past the last candidate.

    Θ_m = (R + Σ_{i<m} sorted_a[i]) · SPS(R + m), with SPS = 0 beyond the table.
    """
    if sps.ndim != 1:
        raise ValueError(f"sps must be a 1-D table indexed by tokens per pass, got {sps.shape=}")
    m = jnp.arange(sorted_a.shape[0] + 1)
    tokens = num_requests + m
    max_tokens = sps.shape[0] - 1
    in_table = tokens <= max_tokens
    steps_per_s = jnp.where(in_table, sps.astype(jnp.float32)[jnp.minimum(tokens, max_tokens)], 0.0)
    tau = num_requests + jnp.concatenate([jnp.zeros((1,), jnp.float32), jnp.cumsum(sorted_a)])
    exists = jnp.concatenate([jnp.ones((1,), bool), sorted_valid])
    return jnp.where(exists, tau * steps_per_s, -jnp.inf)


def _lengths_from_path(order, admitted_sorted, shape):
    """Scatter the admitted flags back to [B, L] and count each request's admitted prefix."""
    admitted = jnp.zeros(admitted_sorted.shape, bool).at[order].set(admitted_sorted).reshape(shape)
    return _leading_count(admitted)


def prefix_schedule(a: jax.Array, sps: jax.Array, active: jax.Array | None = None) -> jax.Array:
    """Algorithm 1 (hardware-aware prefix scheduler) with its early-stop break.

    Walks the admission path and admits its longest prefix over which Θ strictly increases at every
    step, i.e. stops at the first candidate m with Θ_m <= Θ_best = Θ_{m-1}. The decision for draft
    token k then depends only on candidates ranked above it, never on a_{r,k+1} (which the Markov
    confidence head computes from token k itself), so verification stays lossless (Appendix A).

    Args:
      a: f32 [B, L] survival (current step).
      sps: f32 [Nmax+1], steps per second indexed by tokens per pass.
      active: optional bool [B]; inactive slots are not requests.

    Returns:
      lengths: int32 [B]; 0 for inactive slots.
    """
    active = _active(a, active)
    order, sorted_a, sorted_valid, num_requests = _admission_path(a, active)
    theta = _throughput_path(sorted_a, sorted_valid, num_requests, sps)
    num_admitted = _leading_count(theta[1:] > theta[:-1])
    admitted_sorted = jnp.arange(sorted_a.shape[0]) < num_admitted
    return _lengths_from_path(order, admitted_sorted, a.shape)


def capacity_search(a: jax.Array, sps: jax.Array, active: jax.Array | None = None) -> jax.Array:
    """§5.2 capacity: the number of draft tokens K maximising Θ over the whole admission path (no break).

    Finds the global maximum across jagged SPS cliffs where the break would stop at the first dip.
    Lossless only when `a` is stale (computed before the current draft tokens were sampled).

    Args:
      a: f32 [B, L] survival used to size the pass (two steps old in the deployed engine).
      sps: f32 [Nmax+1], steps per second indexed by tokens per pass.
      active: optional bool [B].

    Returns:
      K: int32 [], total draft tokens to verify Σ_r ℓ_r (the pass holds R + K tokens); the smallest
      maximiser on ties.
    """
    active = _active(a, active)
    _, sorted_a, sorted_valid, num_requests = _admission_path(a, active)
    theta = _throughput_path(sorted_a, sorted_valid, num_requests, sps)
    return jnp.argmax(theta).astype(jnp.int32)


def survival_host(confidence, dtype=np.float32) -> np.ndarray:
    """`survival` in numpy (the engine's host side): a_k = c_1⋯c_k with a running minimum along L."""
    return np.minimum.accumulate(np.cumprod(np.asarray(confidence, dtype), axis=-1), axis=-1)


def capacity_search_host(a, sps, active=None) -> int:
    """`capacity_search` in numpy, for the engine's host: the same admission path and Θ, the same K
    (tests/test_scheduling.py holds the two equal). The host computes K while the device runs the previous
    pass (§5.2); a jitted search would queue behind that pass on the same device and stall the host.

    Args:
      a: f32 [B, L] stale survival.
      sps: f32 [Nmax+1].
      active: optional bool [B].

    Returns:
      K: int.
    """
    a = np.asarray(a, np.float32)
    if a.ndim != 2:
        raise ValueError(f"survival must be [B, L], got {a.shape=}")
    a = np.minimum.accumulate(a, axis=1)
    active = np.ones(a.shape[0], bool) if active is None else np.asarray(active, bool)
    sps = np.asarray(sps, np.float32)
    valid = (active[:, None] & (a > 0)).reshape(-1)
    flat = a.reshape(-1)
    sorted_a = np.sort(flat[valid])[::-1]  # the valid candidates in path order (their values are all Θ needs)
    R = int(active.sum())
    tokens = R + np.arange(sorted_a.size + 1)
    max_tokens = sps.shape[0] - 1
    steps = np.where(tokens <= max_tokens, sps[np.minimum(tokens, max_tokens)], np.float32(0.0))
    tau = np.float32(R) + np.concatenate([np.zeros(1, np.float32), np.cumsum(sorted_a, dtype=np.float32)])
    return int(np.argmax(tau * steps))


def topk_fill(a: jax.Array, k, active: jax.Array | None = None) -> jax.Array:
    """Fill K verification slots with the highest-survival draft tokens (prefix-consistent).

    Candidates are the same as Algorithm 1's (active, a > 0), so fewer than K slots are filled when
    there are fewer candidates.

    Args:
      a: f32 [B, L] survival (current step).
      k: int scalar K (may be traced), e.g. from `capacity_search` on stale survival.
      active: optional bool [B].

    Returns:
      lengths: int32 [B] with Σ lengths = min(K, number of candidates).
    """
    active = _active(a, active)
    order, sorted_a, sorted_valid, _ = _admission_path(a, active)
    admitted_sorted = (jnp.arange(sorted_a.shape[0]) < k) & sorted_valid
    return _lengths_from_path(order, admitted_sorted, a.shape)


def bucket_sps(sps_at_buckets, buckets, bmax: int) -> jax.Array:
    """Step-function SPS table from capacity buckets, built once at start-up (host side).

    A pass of N tokens runs in the smallest precompiled bucket >= N, so SPS(N) = SPS(that bucket);
    N beyond the largest bucket cannot run (SPS = 0, hence Θ = 0).

    Args:
      sps_at_buckets: f32 [G], measured steps per second at each bucket size.
      buckets: int [G], strictly increasing bucket sizes in tokens.
      bmax: table size - 1 (largest N indexed).

    Returns:
      sps: f32 [bmax+1].
    """
    sps_at_buckets = np.asarray(sps_at_buckets, np.float32)
    buckets = np.asarray(buckets, np.int64)
    if buckets.ndim != 1 or sps_at_buckets.shape != buckets.shape or buckets.size == 0:
        raise ValueError(f"need matching 1-D tables, got {sps_at_buckets.shape=} {buckets.shape=}")
    if np.any(np.diff(buckets) <= 0):
        raise ValueError(f"buckets must be strictly increasing, got {buckets.tolist()}")
    idx = np.searchsorted(buckets, np.arange(bmax + 1), side="left")
    table = np.where(idx < buckets.size, sps_at_buckets[np.minimum(idx, buckets.size - 1)], 0.0)
    return jnp.asarray(table, jnp.float32)
