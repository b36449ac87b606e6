"""Tests for dspark_jax.verification: greedy hand tables (vLLM style) and output-distribution tests.

The distribution tests run 200k independent trials in one jitted call and compare emitted-token
frequencies with the target by a chi-square test at false-alarm probability 0.1%. A deliberately wrong
verifier (recovered token resampled from the full p instead of the residual) must fail the same test,
which proves the test has power.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from dspark_jax import verification
from dspark_jax.sampling import filter_probs, sample
from dspark_jax.verification import greedy_verify, verify

# chi2.ppf(1 - 1e-3, df) from scipy.stats.chi2.ppf (scipy is not a dependency; checked in test_sampling).
CHI2_999 = {3: 16.2662, 4: 18.4668, 15: 37.6973, 24: 51.1786}

N_TRIALS = 200_000
V = 10

# (draft tokens, target argmax at positions 1..L+1, ℓ, expected emitted tokens); L = 3.
GREEDY_TABLE = [
    ([1, 2, 3], [1, 2, 4, 9], 3, [1, 2, 4]),  # third rejected: recovered = target's 4
    ([1, 2, 3], [1, 2, 3, 9], 3, [1, 2, 3, 9]),  # all accepted: bonus 9
    ([1, 2, 3], [5, 2, 3, 9], 3, [5]),  # first rejected: only the recovered token
    ([1, 2, 3], [7, 2, 3, 9], 0, [7]),  # ℓ = 0: only the target's token (a bonus)
    ([1, 2, 3], [1, 2, 3, 9], 0, [1]),  # ℓ = 0 even though the draft matches
    ([1, 2, 3], [1, 2, 8, 9], 2, [1, 2, 8]),  # ℓ = 2, both accepted: bonus from p_3; x_3 ignored
    ([1, 2, 3], [4, 2, 3, 9], 1, [4]),  # ℓ = 1, rejected
    ([0, 0, 0], [0, 0, 0, 0], 2, [0, 0, 0]),  # ℓ = 2 all accepted, bonus 0
]


def _greedy_inputs():
    draft = jnp.array([row[0] for row in GREEDY_TABLE], jnp.int32)
    target = jnp.array([row[1] for row in GREEDY_TABLE], jnp.int32)
    lengths = jnp.array([row[2] for row in GREEDY_TABLE], jnp.int32)
    want = np.full(target.shape, -1)
    for i, row in enumerate(GREEDY_TABLE):
        want[i, : len(row[3])] = row[3]
    return draft, target, lengths, want


def test_greedy_table_one_hot_verify():
    draft, target, lengths, want = _greedy_inputs()
    b = draft.shape[0]
    run = jax.jit(lambda k: verify(jax.random.split(k, b), jax.nn.one_hot(target, V),
                                   draft, jax.nn.one_hot(draft, V), lengths))
    for seed in range(3):  # greedy is deterministic whatever the keys
        res = run(jax.random.key(seed))
        np.testing.assert_array_equal(np.asarray(res.emitted_tokens), want)
        np.testing.assert_array_equal(np.asarray(res.num_emitted), (want >= 0).sum(-1))
        np.testing.assert_array_equal(np.asarray(res.num_accepted), (want >= 0).sum(-1) - 1)


def test_greedy_verify_matches_table():
    draft, target, lengths, want = _greedy_inputs()
    res = jax.jit(greedy_verify)(target, draft, lengths)
    np.testing.assert_array_equal(np.asarray(res.emitted_tokens), want)
    np.testing.assert_array_equal(np.asarray(res.num_emitted), (want >= 0).sum(-1))


def test_greedy_verify_equals_verify_on_one_hot_rows():
    k_target, k_draft, k_len, k_verify = jax.random.split(jax.random.key(7), 4)
    b, n_draft, v = 1024, 4, 2  # a small vocabulary so long matches are common
    target = jax.random.randint(k_target, (b, n_draft + 1), 0, v)
    draft = jax.random.randint(k_draft, (b, n_draft), 0, v)
    lengths = jax.random.randint(k_len, (b,), 0, n_draft + 1)
    got = jax.jit(verify)(jax.random.split(k_verify, b), jax.nn.one_hot(target, v), draft,
                          jax.nn.one_hot(draft, v), lengths)
    want = greedy_verify(target, draft, lengths)
    for g, w in zip(got, want, strict=True):
        np.testing.assert_array_equal(np.asarray(g), np.asarray(w))
    assert len(set(np.asarray(want.num_accepted).tolist())) == n_draft + 1  # every outcome occurs


def test_masked_positions_are_ignored_and_edge_cases_are_safe():
    nan = jnp.nan
    # Row 0: ℓ = 1; everything past the bonus row is NaN garbage and draft position 2 is -1 padding.
    # Row 1: q(x) = 0 for the drafted token (inconsistent input) and p(x) > 0: accepted, no NaN.
    # Row 2: p == q with the draft on a zero-probability token: rejected, the residual is empty and the
    #        recovered token falls back to p.
    target = jnp.array([
        [[0.5, 0.5, 0, 0], [0.25, 0.75, 0, 0], [nan] * 4],
        [[0.0, 1.0, 0, 0], [0.0, 0.0, 1, 0], [0, 0, 0, 1]],
        [[0.5, 0.5, 0, 0], [0.5, 0.5, 0, 0], [0.5, 0.5, 0, 0]],
    ])
    draft_probs = jnp.array([
        [[0.5, 0.5, 0, 0], [nan] * 4],
        [[1.0, 0.0, 0, 0], [0.0, 0.0, 1, 0]],
        [[0.5, 0.5, 0, 0], [0.5, 0.5, 0, 0]],
    ])
    draft = jnp.array([[1, -1], [1, 2], [2, 0]], jnp.int32)
    lengths = jnp.array([1, 2, 2], jnp.int32)
    run = jax.jit(lambda k: verify(jax.random.split(k, 3), target, draft, draft_probs, lengths))
    for seed in range(20):
        res = run(jax.random.key(seed))
        e = np.asarray(res.emitted_tokens)
        assert e[0, 0] == 1 and e[0, 1] in (0, 1) and e[0, 2] == -1  # accepted (p >= q), then a bonus
        np.testing.assert_array_equal(e[1], [1, 2, 3])
        assert e[2, 0] in (0, 1) and list(e[2, 1:]) == [-1, -1]


def test_verify_rejects_bad_shapes():
    with pytest.raises(ValueError, match="target_probs"):
        verify(jax.random.split(jax.random.key(0), 2), jnp.zeros((2, 3, 5)), jnp.zeros((2, 3), jnp.int32),
               jnp.zeros((2, 3, 5)), jnp.zeros(2, jnp.int32))
    with pytest.raises(ValueError, match="keys"):
        verify(jax.random.split(jax.random.key(0), 3), jnp.zeros((2, 4, 5)), jnp.zeros((2, 3), jnp.int32),
               jnp.zeros((2, 3, 5)), jnp.zeros(2, jnp.int32))


def _two_rounds(key, p_rows, q_rows):
    """First two tokens of the output stream over N_TRIALS independent trials.

    Each trial drafts L tokens from q, picks ℓ uniformly in 0..L independently of the draft (a
    non-anticipating schedule) and verifies; if the round emitted a single token, the stream's second
    token is the first emitted token of a second, independent round.

    Args:
      key: PRNG key.
      p_rows: f32 [L+1, V] target distributions by block position.
      q_rows: f32 [L, V] draft distributions by block position.

    Returns:
      y1, y2: int32 [N_TRIALS]; plus the structural invariants checked inside.
    """
    n, (n_draft, v) = N_TRIALS, q_rows.shape

    def round_(key):
        k_draft, k_len, k_verify = jax.random.split(key, 3)
        q = jnp.broadcast_to(q_rows, (n, n_draft, v))
        draft = sample(jax.random.split(k_draft, n), q)
        lengths = jax.random.randint(k_len, (n,), 0, n_draft + 1)
        res = verify(jax.random.split(k_verify, n), jnp.broadcast_to(p_rows, (n, n_draft + 1, v)),
                     draft, q, lengths)
        pos = jnp.arange(n_draft)
        ok = (res.num_accepted <= lengths) & (res.num_emitted == res.num_accepted + 1)
        accepted = pos < res.num_accepted[:, None]
        ok &= jnp.all(jnp.where(accepted, res.emitted_tokens[:, :-1] == draft, True), -1)
        ok &= jnp.all((res.emitted_tokens >= 0) == (jnp.arange(n_draft + 1) < res.num_emitted[:, None]), -1)
        return res, jnp.all(ok)

    # Both rounds as one vmapped graph: half the (slow to compile) threefry code of two calls.
    res, ok = jax.vmap(round_)(jax.random.split(key))
    first, num_emitted = res.emitted_tokens[:, :, 0], res.num_emitted[0]
    y2 = jnp.where(num_emitted >= 2, res.emitted_tokens[0, :, 1], first[1])
    return first[0], y2, jnp.all(ok)


# Compiled once for every test that shares the shapes (the threefry-heavy graph takes seconds to compile).
_TWO_ROUNDS = jax.jit(_two_rounds)


def _run(key, p_rows, q_rows, two_rounds=_TWO_ROUNDS):
    y1, y2, ok = two_rounds(key, jnp.asarray(p_rows, jnp.float32), jnp.asarray(q_rows, jnp.float32))
    assert bool(ok)
    return np.asarray(y1), np.asarray(y2)


def _chi2(samples, probs):
    """Pearson statistic over the support of probs (counts off the support must be zero); and its df."""
    probs = np.asarray(probs, np.float64).ravel()
    counts = np.bincount(samples, minlength=probs.size)
    support = probs > 0
    assert counts[~support].sum() == 0, "emitted a token the target gives zero probability"
    expected = samples.size * probs[support]
    return float(np.sum((counts[support] - expected) ** 2 / expected)), int(support.sum()) - 1


# Target rows differ by position; the drafter is poor (mass on the wrong tokens, different per position).
# V = 8 with tokens 5..7 unused, so every distribution test shares one compiled graph.
P_ROWS = np.pad(np.array([
    [0.5, 0.2, 0.15, 0.1, 0.05],
    [0.1, 0.4, 0.1, 0.3, 0.1],
    [0.2, 0.2, 0.2, 0.2, 0.2],
    [0.05, 0.05, 0.1, 0.3, 0.5],
]), ((0, 0), (0, 3)))
Q_ROWS = np.pad(np.array([
    [0.05, 0.1, 0.15, 0.2, 0.5],
    [0.3, 0.05, 0.3, 0.05, 0.3],
    [0.6, 0.1, 0.1, 0.1, 0.1],
]), ((0, 0), (0, 3)))


def _first_token_stat(seed, two_rounds=_TWO_ROUNDS):
    y1, _ = _run(jax.random.key(seed), P_ROWS, Q_ROWS, two_rounds)
    return _chi2(y1, P_ROWS[0])


def _joint_stat(seed, two_rounds=_TWO_ROUNDS):
    # Position-independent target, so the output stream must be i.i.d. p: (y1, y2) ~ p ⊗ p.
    p = P_ROWS[0]
    y1, y2 = _run(jax.random.key(seed), np.tile(p, (4, 1)), Q_ROWS, two_rounds)
    return _chi2(y1 * p.size + y2, np.outer(p, p))


def test_first_emitted_token_is_distributed_as_p1():
    stat, df = _first_token_stat(10)
    assert stat < CHI2_999[df], stat


def test_first_two_emitted_tokens_are_iid_target():
    stat, df = _joint_stat(11)
    assert stat < CHI2_999[df], stat


def test_resampling_rejections_from_full_p_is_detected(monkeypatch):
    # The classic bug: on rejection draw from p instead of norm(max(0, p - q)). It over-weights the
    # tokens q over-proposes (here token 4), and the same tests must fail.
    monkeypatch.setattr(verification, "_residual", lambda p, q: p)
    wrong = jax.jit(functools.partial(_two_rounds))  # a fresh jit, so the patched helper is traced in
    stat, df = _first_token_stat(10, wrong)
    assert stat > CHI2_999[df], stat
    stat, df = _joint_stat(11, wrong)
    assert stat > CHI2_999[df], stat


def test_filtered_sampling_distribution():
    # Temperature 0.7, top-k 5, top-p 0.9 on both sides (V = 8). The target keeps tokens {0, 1, 2, 4};
    # each draft row keeps a different set, including tokens the target filtered out.
    params = (jnp.full(4, 0.7), jnp.full(4, 5, jnp.int32), jnp.full(4, 0.9))
    target_logits = jnp.tile(jnp.array([2.0, 1.5, 1.2, 0.3, 1.0, -1.0, -2.0, 0.9]), (4, 1))
    draft_logits = jnp.array([
        [0.5, 2.0, -1.0, 1.8, 0.2, 1.6, -0.5, 0.0],
        [1.0, 1.0, 1.4, -1.0, 1.9, 0.0, 0.0, 1.7],
        [0.0, 0.3, 2.2, 0.1, 0.2, 1.0, 1.1, 0.5],
        [0.0] * 8,  # padding row so the batch of parameters is [4]
    ])
    p_rows = np.asarray(filter_probs(target_logits, *params), np.float64)
    q_rows = np.asarray(filter_probs(draft_logits, *params))[:3]
    assert (p_rows[0] > 0).sum() == 4

    y1, y2 = _run(jax.random.key(12), p_rows, q_rows)
    stat, df = _chi2(y1, p_rows[0])
    assert stat < CHI2_999[df], stat
    stat, df = _chi2(y1 * 8 + y2, np.outer(p_rows[0], p_rows[0]))
    assert stat < CHI2_999[df], stat
