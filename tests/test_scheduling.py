"""Tests for dspark_jax.scheduling: hand tables, a literal Algorithm 1 loop as the oracle, and Appendix A.

Appendix A is run end to end: a drafter sample x1, a confidence that depends on x1, a verification length
from a policy, and the real `verify`. The retrospective search (argmax over the whole admission path
with the current survival, i.e. Algorithm 1 without its break) lives only here, to show its bias.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from dspark_jax.scheduling import (
    bucket_sps,
    capacity_search,
    capacity_search_host,
    fixed_lengths,
    prefix_schedule,
    survival,
    threshold_lengths,
    topk_fill,
)
from dspark_jax.verification import verify

# norm.ppf(1 - 0.001 / 2) from scipy.stats: a two-sided Monte Carlo check fails by chance once in 1,000.
Z_999 = 3.2905


# Jitted once per shape: eager dispatch would compile each of the dozens of small ops separately.
prefix_schedule_j = jax.jit(prefix_schedule)
capacity_search_j = jax.jit(capacity_search)
topk_fill_j = jax.jit(topk_fill)
threshold_lengths_j = jax.jit(threshold_lengths)
fixed_lengths_j = jax.jit(fixed_lengths)
survival_j = jax.jit(survival)


def retrospective_schedule(a, sps, active=None):
    """Algorithm 1 WITHOUT the break, on the current survival: the biased search of Appendix A."""
    return topk_fill(a, capacity_search(a, sps, active), active)


def _path_reference(a, sps, active=None):
    """Literal Algorithm 1 in Python floats: (lengths with the break, K of the no-break argmax)."""
    a = np.minimum.accumulate(np.asarray(a, np.float64), axis=1)
    active = np.ones(a.shape[0], bool) if active is None else np.asarray(active)
    sps = np.asarray(sps, np.float64)

    def sps_at(n):
        return sps[n] if n < sps.size else 0.0

    # Python's sort is stable and the candidates are listed r-major: ties go to lower r, then lower j.
    cands = [(r, j) for r in range(a.shape[0]) for j in range(a.shape[1]) if active[r] and a[r, j] > 0]
    cands.sort(key=lambda rj: -a[rj])
    num_requests = int(active.sum())
    tokens, tau = num_requests, float(num_requests)
    best = tau * sps_at(tokens)
    lengths, selected = np.zeros(a.shape[0], int), np.zeros(a.shape[0], int)
    broken = False
    thetas = [best]
    for r, j in cands:
        lengths[r] = j + 1
        tokens += 1
        tau += a[r, j]
        theta = tau * sps_at(tokens)
        thetas.append(theta)
        if not broken and theta > best:
            best = theta
            selected = lengths.copy()
        else:
            broken = True
    return selected, int(np.argmax(thetas))


def test_survival():
    c = jnp.array([[0.5, 0.5, 1.0], [1.0, 0.0, 0.7]])
    np.testing.assert_allclose(np.asarray(survival_j(c)), [[0.5, 0.25, 0.25], [1.0, 0.0, 0.0]])


def test_fixed_and_threshold_lengths():
    a = jnp.array([[0.9, 0.6, 0.5, 0.2], [0.4, 0.3, 0.0, 0.0], [1.0, 1.0, 1.0, 1.0]])
    active = jnp.array([True, True, False])
    np.testing.assert_array_equal(np.asarray(fixed_lengths_j(a, 2, active)), [2, 2, 0])
    np.testing.assert_array_equal(np.asarray(fixed_lengths_j(a, 9)), [4, 4, 4])
    # The threshold is on survival a (>= counts); survival is non-increasing so this is a count.
    np.testing.assert_array_equal(np.asarray(threshold_lengths_j(a, 0.5)), [3, 0, 4])
    np.testing.assert_array_equal(np.asarray(threshold_lengths_j(a, 0.25, active)), [3, 2, 0])


A_HAND = jnp.array([[0.9, 0.6, 0.1], [0.8, 0.3, 0.0]])


def test_prefix_schedule_flat_sps_admits_every_positive_survival():
    a = jnp.array([[0.9, 0.5, 0.0, 0.0], [0.7, 0.6, 0.2, 0.1], [0.0, 0.0, 0.0, 0.0]])
    np.testing.assert_array_equal(np.asarray(prefix_schedule_j(a, jnp.ones(32))), [2, 4, 0])


def test_prefix_schedule_steep_sps_admits_nothing():
    sps = 1.0 / jnp.maximum(jnp.arange(32.0), 1.0) ** 2  # Θ = τ / N², falls for any a <= 1
    np.testing.assert_array_equal(np.asarray(prefix_schedule_j(A_HAND, sps)), [0, 0])


def test_prefix_schedule_by_hand():
    # R = 2, Θ0 = 2·1.0 = 2. Path 0.9, 0.8, 0.6, 0.3, 0.1:
    #   Θ1 = 2.9·0.9 = 2.61, Θ2 = 3.7·0.8 = 2.96, Θ3 = 4.3·0.7 = 3.01, Θ4 = 4.6·0.6 = 2.76 <= 3.01: stop.
    sps = jnp.array([0.0, 1.0, 1.0, 0.9, 0.8, 0.7, 0.6, 0.5, 0.4])
    np.testing.assert_array_equal(np.asarray(prefix_schedule_j(A_HAND, sps)), [2, 1])
    assert int(capacity_search_j(A_HAND, sps)) == 3  # Θ5 = 4.7·0.5 = 2.35: the max is Θ3
    np.testing.assert_array_equal(np.asarray(topk_fill_j(A_HAND, 3)), [2, 1])


def test_capacity_search_crosses_a_jagged_cliff():
    # Θ0 = 1, Θ1 = 1.95, Θ2 = 2.85·0.6 = 1.71 (the break stops here), Θ3 = 2.22, Θ4 = 2.7 (global max).
    a = jnp.array([[0.95, 0.9, 0.85, 0.8]])
    sps = jnp.array([0.0, 1.0, 1.0, 0.6, 0.6, 0.6])
    np.testing.assert_array_equal(np.asarray(prefix_schedule_j(a, sps)), [1])
    k = capacity_search_j(a, sps)
    assert int(k) == 4
    np.testing.assert_array_equal(np.asarray(topk_fill_j(a, k)), [4])


def test_tokens_beyond_the_table_are_inadmissible():
    a = jnp.array([[0.9, 0.8], [0.7, 0.6]])
    np.testing.assert_array_equal(np.asarray(prefix_schedule_j(a, jnp.ones(4))), [1, 0])  # N <= 3
    assert int(capacity_search_j(a, jnp.ones(4))) == 1
    np.testing.assert_array_equal(np.asarray(prefix_schedule_j(a, jnp.ones(2))), [0, 0])  # R = 2 > 1


def test_inactive_slots_are_not_requests():
    a = jnp.array([[0.9, 0.9], [0.9, 0.9]])
    sps = jnp.array([0.0, 1.0, 1.0, 0.5, 0.5])
    # R = 1: Θ0 = 1, Θ1 = 1.9·1.0, Θ2 = 2.8·0.5 = 1.4. Were slot 1 counted, Θ0 = 2 and nothing is admitted.
    active = jnp.array([True, False])
    np.testing.assert_array_equal(np.asarray(prefix_schedule_j(a, sps, active)), [1, 0])
    np.testing.assert_array_equal(np.asarray(prefix_schedule_j(a, sps)), [0, 0])
    np.testing.assert_array_equal(np.asarray(topk_fill_j(a, 3, active)), [2, 0])
    assert int(capacity_search_j(a, sps, active)) == 1


def test_ties_keep_prefix_structure():
    a = jnp.array([[0.5, 0.5, 0.5], [0.5, 0.5, 0.0]])
    # Ties go to the lower request, then the lower position: r0j1, r0j2, r0j3, r1j1, r1j2.
    np.testing.assert_array_equal(np.asarray(prefix_schedule_j(a, jnp.ones(6))), [3, 0])  # N <= 5
    for k, want in [(0, [0, 0]), (1, [1, 0]), (3, [3, 0]), (4, [3, 1]), (5, [3, 2]), (9, [3, 2])]:
        np.testing.assert_array_equal(np.asarray(topk_fill_j(a, k)), want)
    # A non-monotone input is read as its running minimum, so prefixes still hold.
    np.testing.assert_array_equal(np.asarray(topk_fill_j(jnp.array([[0.3, 0.5]]), 1)), [1])


def test_tie_heavy_random_topk_fill_has_no_holes():
    rng = np.random.default_rng(0)
    a = np.minimum.accumulate(rng.choice([0.0, 0.25, 0.5, 1.0], size=(64, 5, 4)), axis=-1)
    n_cand = (a > 0).sum(axis=(1, 2))
    fill = jax.jit(jax.vmap(topk_fill, in_axes=(0, None)))
    for k in range(0, 22):
        lengths = np.asarray(fill(jnp.asarray(a, jnp.float32), k))
        # Leading-count lengths sum to the number admitted only if every admitted set is a prefix.
        np.testing.assert_array_equal(lengths.sum(-1), np.minimum(k, n_cand))


def test_matches_literal_algorithm_1_on_random_batches():
    rng = np.random.default_rng(1)
    n, b, l, nmax = 200, 6, 5, 40
    c = rng.uniform(0.2, 1.0, size=(n, b, l)) * (rng.uniform(size=(n, b, l)) > 0.1)
    a = np.asarray(survival_j(jnp.asarray(c, jnp.float32)))
    active = rng.uniform(size=(n, b)) > 0.2
    # Decreasing SPS curves of random steepness, half of them jagged by random cliffs.
    x = np.arange(nmax + 1)
    knee = rng.uniform(3, 30, size=(n, 1))
    sps = 1.0 / (1.0 + (x / knee) ** 2) * np.where(rng.uniform(size=(n, nmax + 1)) < 0.15, 0.8, 1.0)
    sps = sps.astype(np.float32)

    got_prefix = np.asarray(jax.jit(jax.vmap(prefix_schedule))(a, sps, active))
    got_k = np.asarray(jax.jit(jax.vmap(capacity_search))(a, sps, active))
    for i in range(n):
        want_prefix, want_k = _path_reference(a[i], sps[i], active[i])
        np.testing.assert_array_equal(got_prefix[i], want_prefix, err_msg=f"instance {i}")
        assert got_k[i] == want_k, i
        assert capacity_search_host(a[i], sps[i], active[i]) == want_k, i  # the engine's host twin
    assert 0 < (got_prefix.sum(-1) < got_k).sum() < n  # both regimes occur: the break does bind


def test_bucket_sps():
    table = bucket_sps([1.0, 0.9, 0.5], [1, 4, 8], bmax=10)
    np.testing.assert_allclose(np.asarray(table), [1.0, 1.0, 0.9, 0.9, 0.9, 0.5, 0.5, 0.5, 0.5, 0.0, 0.0])
    with pytest.raises(ValueError, match="increasing"):
        bucket_sps([1.0, 0.9], [4, 4], bmax=10)


def test_prefix_schedule_traces_once():
    traces = []

    @jax.jit
    def schedule(a, sps):
        traces.append(1)
        return prefix_schedule_j(a, sps)

    sps = jnp.linspace(1.0, 0.2, 33)
    for seed in range(3):
        schedule(jax.random.uniform(jax.random.key(seed), (4, 8)), sps)
    assert len(traces) == 1


# ---- Appendix A: selection bias without the early-stop break -------------------------------------
# One request, L = 2, vocabulary {A = 0, B = 1}. Target p = (0.7, 0.3) at every position; drafter
# q = (0.5, 0.5); c1 = 0.8 = Σ min(p, q); c2 = 0.9 after A, 0 after B. With SPS(1, 2, 3) = (1, 0.5, 0.45):
#   Θ0 = 1.0 > Θ1 = 1.8·0.5 = 0.9, but Θ2 = 2.52·0.45 = 1.134 after A and 1.8·0.45 = 0.81 after B.
P_APP = np.array([0.7, 0.3])
Q_APP = np.array([0.5, 0.5])
SPS_APP = jnp.array([0.0, 1.0, 0.5, 0.45])
A_STALE = jnp.array([[0.8, 0.72]])  # survival from an earlier step, fixed before x1 is drafted


def _survival_after(x1):
    return survival(jnp.stack([jnp.full_like(x1, 0.8, dtype=jnp.float32),
                               jnp.where(x1 == 0, 0.9, 0.0)], axis=-1))


POLICIES = {
    "retrospective": retrospective_schedule,
    "prefix": prefix_schedule,
    "stale_capacity": lambda a, sps: topk_fill(a, capacity_search(A_STALE, sps)),
}


def _p_first_is_a(x1, length):
    """Exact P(first emitted = A | x1, ℓ) from the rejection rule (recovered from norm(max(0, p - q)))."""
    if length == 0:
        return P_APP[0]
    accept = min(1.0, P_APP[x1] / Q_APP[x1])
    residual = np.maximum(P_APP - Q_APP, 0.0)
    return accept * (x1 == 0) + (1 - accept) * residual[0] / residual.sum()


@pytest.mark.parametrize(
    "policy, lengths, want",
    [("retrospective", (2, 0), 0.85), ("prefix", (0, 0), 0.70), ("stale_capacity", (2, 1), 0.70)],
)
def test_appendix_a_exact(policy, lengths, want):
    total = 0.0
    for x1 in (0, 1):
        a = _survival_after(jnp.array([x1]))  # [1, 2]
        length = int(jax.jit(POLICIES[policy])(a, SPS_APP)[0])
        assert length == lengths[x1]
        total += Q_APP[x1] * _p_first_is_a(x1, length)
    assert total == pytest.approx(want, abs=1e-9)


def test_appendix_a_monte_carlo_through_verify():
    n = 200_000
    names = list(POLICIES)

    @jax.jit
    def first_tokens(keys, draft):
        q = jnp.broadcast_to(jnp.asarray(Q_APP, jnp.float32), (n, 2, 2))
        p = jnp.broadcast_to(jnp.asarray(P_APP, jnp.float32), (n, 3, 2))
        a = _survival_after(draft[:, 0])[:, None, :]  # [n, R=1, L=2]: one single-request batch per trial
        lengths = [jax.vmap(POLICIES[name], in_axes=(0, None))(a, SPS_APP)[:, 0] for name in names]
        # All policies in one verify call, with the same keys (the same uniforms) for each.
        tile = lambda x: jnp.concatenate([x] * len(names))  # noqa: E731
        res = verify(tile(keys), tile(p), tile(draft), tile(q), jnp.concatenate(lengths))
        return res.emitted_tokens[:, 0].reshape(len(names), n)

    rng = np.random.default_rng(0)
    draft = (rng.random((n, 2)) >= Q_APP[0]).astype(np.int32)  # x_k ~ q = (0.5, 0.5)
    keys = rng.integers(0, 2**32, size=(n, 2), dtype=np.uint32)
    first = np.asarray(first_tokens(keys, draft))
    for name, want in [("retrospective", 0.85), ("prefix", 0.70), ("stale_capacity", 0.70)]:
        freq = float(np.mean(first[names.index(name)] == 0))
        tol = Z_999 * np.sqrt(want * (1 - want) / n)
        assert abs(freq - want) < tol, (name, freq, want)
