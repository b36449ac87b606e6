"""Tests for dspark_jax.verification: greedy hand tables (vLLM style) and output-distribution tests.

The distribution tests run 200k independent trials (draft tokens and lengths drawn on the host with
numpy, one jitted `verify` call per round) and compare emitted-token frequencies with the target by a
chi-square test at false-alarm probability 0.1%. A deliberately wrong
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
from dspark_jax.sampling import filter_probs
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
    draft = np.array([row[0] for row in GREEDY_TABLE], np.int32)
    target = np.array([row[1] for row in GREEDY_TABLE], np.int32)
    lengths = np.array([row[2] for row in GREEDY_TABLE], np.int32)
    want = np.full(target.shape, -1)
    for i, row in enumerate(GREEDY_TABLE):
        want[i, : len(row[3])] = row[3]
    return draft, target, lengths, want


def _raw_keys(seed, n):
    """n independent raw uint32 [n, 2] keys straight from numpy (no threefry to compile in the test)."""
    return np.random.default_rng(seed).integers(0, 2**32, size=(n, 2), dtype=np.uint32)


# Jitted once per shape; the threefry code inside verify is what takes seconds to compile on CPU.
VERIFY = jax.jit(verify)


GREEDY_BATCH = 1024  # the greedy tests share one compiled shape [1024, L, V]


def test_greedy_table_one_hot_verify():
    draft, target, lengths, want = _greedy_inputs()
    # The table repeated 128 times, each copy with its own key: greedy is deterministic whatever the key.
    reps = GREEDY_BATCH // len(GREEDY_TABLE)
    draft, target, lengths, want = (np.tile(np.asarray(x), (reps,) + (1,) * (np.ndim(x) - 1))
                                    for x in (draft, target, lengths, want))
    eye = np.eye(V, dtype=np.float32)
    res = VERIFY(_raw_keys(0, GREEDY_BATCH), eye[target], draft, eye[draft], lengths)
    np.testing.assert_array_equal(np.asarray(res.emitted_tokens), want)
    np.testing.assert_array_equal(np.asarray(res.num_emitted), (want >= 0).sum(-1))
    np.testing.assert_array_equal(np.asarray(res.num_accepted), (want >= 0).sum(-1) - 1)


def test_greedy_verify_matches_table():
    draft, target, lengths, want = _greedy_inputs()
    res = jax.jit(greedy_verify)(target, draft, lengths)
    np.testing.assert_array_equal(np.asarray(res.emitted_tokens), want)
    np.testing.assert_array_equal(np.asarray(res.num_emitted), (want >= 0).sum(-1))


def test_greedy_verify_equals_verify_on_one_hot_rows():
    rng = np.random.default_rng(7)
    b, n_draft = GREEDY_BATCH, 3
    # Tokens from {0, 1} only, so long matches are common.
    target = rng.integers(0, 2, size=(b, n_draft + 1), dtype=np.int32)
    draft = rng.integers(0, 2, size=(b, n_draft), dtype=np.int32)
    lengths = rng.integers(0, n_draft + 1, size=b, dtype=np.int32)
    eye = np.eye(V, dtype=np.float32)
    got = VERIFY(_raw_keys(8, b), eye[target], draft, eye[draft], lengths)
    want = jax.jit(greedy_verify)(target, draft, lengths)
    for g, w in zip(got, want, strict=True):
        np.testing.assert_array_equal(np.asarray(g), np.asarray(w))
    assert len(set(np.asarray(want.num_accepted).tolist())) == n_draft + 1  # every outcome occurs


def test_masked_positions_are_ignored_and_edge_cases_are_safe():
    nan = np.nan
    # Row 0: ℓ = 1; everything past the bonus row is NaN garbage and draft position 2 is -1 padding.
    # Row 1: q(x) = 0 for the drafted token (inconsistent input) and p(x) > 0: accepted, no NaN.
    # Row 2: p == q with the draft on a zero-probability token: rejected, the residual is empty and the
    #        recovered token falls back to p.
    target = np.array([
        [[0.5, 0.5, 0, 0], [0.25, 0.75, 0, 0], [nan] * 4],
        [[0.0, 1.0, 0, 0], [0.0, 0.0, 1, 0], [0, 0, 0, 1]],
        [[0.5, 0.5, 0, 0], [0.5, 0.5, 0, 0], [0.5, 0.5, 0, 0]],
    ], np.float32)
    draft_probs = np.array([
        [[0.5, 0.5, 0, 0], [nan] * 4],
        [[1.0, 0.0, 0, 0], [0.0, 0.0, 1, 0]],
        [[0.5, 0.5, 0, 0], [0.5, 0.5, 0, 0]],
    ], np.float32)
    draft = np.array([[1, -1], [1, 2], [2, 0]], np.int32)
    lengths = np.array([1, 2, 2], np.int32)

    def tile(x):  # 20 independent trials of the 3 rows as one batch of 60
        return np.tile(x, (20,) + (1,) * (x.ndim - 1))

    keys = jax.random.wrap_key_data(_raw_keys(0, 60))  # typed keys [B] are accepted as well as raw ones
    res = VERIFY(keys, tile(target), tile(draft), tile(draft_probs), tile(lengths))
    e = np.asarray(res.emitted_tokens).reshape(20, 3, 3)
    assert np.all(e[:, 0, 0] == 1) and np.all(np.isin(e[:, 0, 1], [0, 1])) and np.all(e[:, 0, 2] == -1)
    np.testing.assert_array_equal(e[:, 1], np.tile([1, 2, 3], (20, 1)))  # accepted, accepted, bonus
    assert np.all(np.isin(e[:, 2, 0], [0, 1])) and np.all(e[:, 2, 1:] == -1)
    assert set(e[:, 2, 0].tolist()) == {0, 1}  # the fallback really samples p


def test_verify_rejects_bad_shapes():
    with pytest.raises(ValueError, match="target_probs"):
        verify(_raw_keys(0, 2), jnp.zeros((2, 3, 5)), jnp.zeros((2, 3), jnp.int32),
               jnp.zeros((2, 3, 5)), jnp.zeros(2, jnp.int32))
    with pytest.raises(ValueError, match="keys"):
        verify(_raw_keys(0, 3), jnp.zeros((2, 4, 5)), jnp.zeros((2, 3), jnp.int32),
               jnp.zeros((2, 3, 5)), jnp.zeros(2, jnp.int32))


def _verify_rows(keys, p_rows, draft, q_rows, lengths):
    """`verify` with the per-position target [L+1, V] and draft [L, V] rows shared by every trial."""
    n, (n_draft, v) = draft.shape[0], q_rows.shape
    return verify(keys, jnp.broadcast_to(p_rows, (n, n_draft + 1, v)), draft,
                  jnp.broadcast_to(q_rows, (n, n_draft, v)), lengths)


# Compiled once for every distribution test (they share shapes).
_VERIFY_ROWS = jax.jit(_verify_rows)


def _two_rounds(seed, p_rows, q_rows, verify_rows=_VERIFY_ROWS):
    """First two tokens of the output stream over N_TRIALS independent trials, and invariant checks.

    Each trial drafts L tokens from q (host-side numpy), picks ℓ uniformly in 0..L independently of the
    draft (a non-anticipating schedule) and verifies; if the round emitted a single token, the stream's
    second token is the first emitted token of a second, independent round.

    Args:
      seed: int.
      p_rows: [L+1, V] target distributions by block position.
      q_rows: [L, V] draft distributions by block position.
      verify_rows: the jitted `_verify_rows` to use.

    Returns:
      y1, y2: int [N_TRIALS].
    """
    rng = np.random.default_rng(seed)
    n, (n_draft, v) = N_TRIALS, q_rows.shape
    p_rows, q_rows = np.asarray(p_rows, np.float32), np.asarray(q_rows, np.float32)
    rounds = []
    for _ in range(2):
        # Inverse-CDF draws x_k ~ q_k; min() guards a float cumsum ending a hair below 1.
        cdf = np.cumsum(q_rows, axis=-1)
        draft = np.minimum((rng.random((n, n_draft, 1)) >= cdf).sum(-1), v - 1).astype(np.int32)
        assert np.all(q_rows[np.arange(n_draft), draft] > 0)
        lengths = rng.integers(0, n_draft + 1, size=n, dtype=np.int32)
        keys = rng.integers(0, 2**32, size=(n, 2), dtype=np.uint32)
        emitted, num_emitted, num_accepted = (np.asarray(x) for x in verify_rows(keys, p_rows, draft, q_rows,
                                                                                lengths))
        assert np.all(num_accepted <= lengths) and np.all(num_emitted == num_accepted + 1)
        pos = np.arange(n_draft + 1)
        assert np.all((emitted >= 0) == (pos < num_emitted[:, None]))  # -1 padding past num_emitted
        accepted = pos[:n_draft] < num_accepted[:, None]
        assert np.all(np.where(accepted, emitted[:, :n_draft] == draft, True))  # accepted = draft tokens
        rounds.append((emitted, num_emitted))
    (e1, n1), (e2, _) = rounds
    return e1[:, 0], np.where(n1 >= 2, e1[:, 1], e2[:, 0])


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


def _first_token_stat(seed, verify_rows=_VERIFY_ROWS):
    y1, _ = _two_rounds(seed, P_ROWS, Q_ROWS, verify_rows)
    return _chi2(y1, P_ROWS[0])


def _joint_stat(seed, verify_rows=_VERIFY_ROWS):
    # Position-independent target, so the output stream must be i.i.d. p: (y1, y2) ~ p ⊗ p.
    p = P_ROWS[0]
    y1, y2 = _two_rounds(seed, np.tile(p, (4, 1)), Q_ROWS, verify_rows)
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
    wrong = jax.jit(functools.partial(_verify_rows))  # a fresh jit, so the patched helper is traced in
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
    p_rows = np.asarray(jax.jit(filter_probs)(target_logits, *params), np.float64)
    q_rows = np.asarray(jax.jit(filter_probs)(draft_logits, *params))[:3]
    assert (p_rows[0] > 0).sum() == 4

    y1, y2 = _two_rounds(12, p_rows, q_rows)
    stat, df = _chi2(y1, p_rows[0])
    assert stat < CHI2_999[df], stat
    stat, df = _chi2(y1 * 8 + y2, np.outer(p_rows[0], p_rows[0]))
    assert stat < CHI2_999[df], stat
