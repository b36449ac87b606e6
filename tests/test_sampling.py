"""Tests for dspark_jax.sampling: filtering vs a plain-numpy reference, and the exponential-trick sampler."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from dspark_jax.sampling import filter_probs, sample

# chi2.ppf(1 - 1e-3, df), computed with scipy.stats.chi2.ppf; a false alarm every 1,000 runs at most.
CHI2_999 = {4: 18.4668, 5: 20.5150, 24: 51.1786}

# Eager dispatch of the dozens of small ops costs seconds; jit once per shape instead.
jit_filter = jax.jit(filter_probs)
jit_sample = jax.jit(sample)


def _reference_filter(logits, temperature, top_k, top_p, min_p=None):
    """Plain float64 numpy, one row at a time, written straight from the vLLM / HF definitions (vLLM's order:
    min-p on the temperature-scaled probabilities first, then top-k, then top-p)."""
    logits = np.asarray(logits, np.float64)
    out = np.zeros_like(logits)
    for idx in np.ndindex(logits.shape[:-1]):
        b, row = idx[0], logits[idx]
        if temperature[b] == 0:
            out[idx][np.argmax(row)] = 1.0
            continue
        x = row / temperature[b]
        if min_p is not None and min_p[b] > 0:
            p = np.exp(x - x.max())
            x = np.where(p / p.max() >= min_p[b], x, -np.inf)
        if 0 < top_k[b] < x.size:
            x = np.where(x >= np.sort(x)[::-1][top_k[b] - 1], x, -np.inf)
        p = np.exp(x - x.max())
        p /= p.sum()
        if top_p[b] < 1.0:
            order = np.argsort(-p, kind="stable")
            before = np.cumsum(p[order]) - p[order]
            kept = order[(before < top_p[b]) | (np.arange(p.size) == 0)]
            mask = np.zeros(p.size, bool)
            mask[kept] = True
            p = np.where(mask, p, 0.0)
            p /= p.sum()
        out[idx] = p
    return out


def _params():
    temperature = np.array([0.0, 0.5, 1.0, 1.7, 0.7, 1.0, 0.0, 2.0], np.float32)
    top_k = np.array([0, 0, 5, 1, 3, 64, 4, 100], np.int32)
    top_p = np.array([1.0, 0.9, 1.0, 0.5, 0.8, 0.01, 0.3, 0.95], np.float32)
    return temperature, top_k, top_p


@pytest.mark.parametrize("shape", [(8, 3, 64), (8, 64)])
def test_filter_matches_numpy_reference(shape):
    logits = np.random.default_rng(0).normal(size=shape).astype(np.float32) * 3.0
    temperature, top_k, top_p = _params()
    # Parameters are traced: one compilation serves any mix of requests.
    got = jit_filter(logits, temperature, top_k, top_p)
    want = _reference_filter(logits, temperature, top_k, top_p)
    np.testing.assert_allclose(np.asarray(got), want, atol=2e-6)
    np.testing.assert_array_equal(np.asarray(got) > 0, want > 0)  # identical supports
    np.testing.assert_allclose(np.asarray(got).sum(-1), 1.0, atol=1e-5)


@pytest.mark.parametrize("shape", [(8, 3, 64), (8, 64)])
def test_min_p_matches_numpy_reference(shape):
    """min_p (vLLM's: keep p >= min_p · p_max of the temperature-scaled distribution, before top-k / top-p)
    mixed with the other filters, per row; rows with min_p 0 are unchanged."""
    logits = np.random.default_rng(1).normal(size=shape).astype(np.float32) * 3.0
    temperature, top_k, top_p = _params()
    min_p = np.array([0.5, 0.0, 0.05, 0.3, 0.9, 0.2, 0.1, 1.0], np.float32)
    got = np.asarray(jit_filter(logits, temperature, top_k, top_p, min_p))
    want = _reference_filter(logits, temperature, top_k, top_p, min_p)
    np.testing.assert_allclose(got, want, atol=2e-6)
    np.testing.assert_array_equal(got > 0, want > 0)
    np.testing.assert_allclose(got[1], np.asarray(jit_filter(logits, temperature, top_k, top_p))[1], atol=0)
    off = np.asarray(jit_filter(logits, temperature, top_k, top_p, np.zeros(8, np.float32)))  # the skipped branch
    np.testing.assert_array_equal(off, np.asarray(jit_filter(logits, temperature, top_k, top_p)))
    spot = jit_filter(jnp.log(jnp.array([[0.5, 0.2, 0.15, 0.1, 0.05]] * 3)), jnp.ones(3), jnp.zeros(3, jnp.int32),
                      jnp.array([1.0, 1.0, 0.6]), jnp.array([0.35, 0.15, 0.15]))
    np.testing.assert_allclose(np.asarray(spot), [[5 / 7, 2 / 7, 0, 0, 0],  # 0.15 < 0.35 · 0.5
                                                  [0.5 / 0.95, 0.2 / 0.95, 0.15 / 0.95, 0.1 / 0.95, 0],
                                                  [5 / 7, 2 / 7, 0, 0, 0]], atol=1e-6)  # then top-p on what is left


def test_check_min_p():
    from dspark_jax.sampling import check_min_p

    assert check_min_p(0) == 0.0 and check_min_p(0.25) == 0.25 and check_min_p(1) == 1.0
    for bad in (-0.1, 1.5, float("nan"), True, "0.1", 10**400):
        with pytest.raises(ValueError, match="min_p"):
            check_min_p(bad)


def test_check_logit_bias():
    from dspark_jax.sampling import LOGIT_BIAS_MAX, check_logit_bias

    assert check_logit_bias(None, 10) == {} and check_logit_bias({}, 10) == {}
    assert check_logit_bias({"7": -100, 2: 1.5, "0": 0}, 10) == {0: 0.0, 2: 1.5, 7: -100.0}  # sorted, floats
    assert list(check_logit_bias({"7": 1, "2": 1}, 10)) == [2, 7]
    many = {str(i): 1.0 for i in range(LOGIT_BIAS_MAX)}
    assert len(check_logit_bias(many, LOGIT_BIAS_MAX)) == LOGIT_BIAS_MAX
    for bad, what in [({str(LOGIT_BIAS_MAX + 1): 1}, "outside"), ({"-1": 1}, "outside"), ({"x": 1}, "token ids"),
                      ({"1.5": 1}, "token ids"), ({True: 1}, "token ids"), ({"3": 100.5}, r"\[-100, 100\]"),
                      ({"3": float("nan")}, r"\[-100, 100\]"), ({"3": "1"}, r"\[-100, 100\]"),
                      ({"3": 10**400}, r"\[-100, 100\]"), ({"²": 1}, "token ids"), ({"+-3": 1}, "token ids"),
                      ({"3": 1, 3: 2}, "twice"), ([(3, 1.0)], "object"),
                      ({**many, str(LOGIT_BIAS_MAX): 1.0}, "at most")]:
        with pytest.raises(ValueError, match=what):
            check_logit_bias(bad, LOGIT_BIAS_MAX + 1)


@pytest.mark.parametrize("shape", [(3, 4, 16), (3, 16)])
def test_add_logit_bias_matches_numpy(shape):
    """Each row's sparse bias lands on its own ids at every position; padding entries (bias 0) change nothing;
    the same id twice in a row adds both; no bias anywhere returns the logits as they were."""
    from dspark_jax.sampling import add_logit_bias

    logits = np.random.default_rng(2).normal(size=shape).astype(np.float32)
    ids = np.array([[5, 0, 0, 0], [0, 0, 0, 0], [15, 3, 3, 9]], np.int32)
    bias = np.array([[-100.0, 0, 0, 0], [0, 0, 0, 0], [2.5, 1.0, 0.5, -0.25]], np.float32)
    dense = np.zeros((3, shape[-1]), np.float32)
    for b in range(3):
        np.add.at(dense[b], ids[b], bias[b])
    want = logits + (dense if len(shape) == 2 else dense[:, None, :])
    got = np.asarray(jax.jit(add_logit_bias)(logits, ids, bias))
    np.testing.assert_allclose(got, want, atol=1e-6)
    assert dense[2, 3] == 1.5  # both entries for token 3
    np.testing.assert_array_equal(np.asarray(jax.jit(add_logit_bias)(logits, ids, bias * 0)), logits)
    with pytest.raises(ValueError, match="logit bias"):
        add_logit_bias(jnp.asarray(logits), ids[:2], bias[:2])


@pytest.mark.parametrize("shape", [(2, 3, 12), (2, 12)])
def test_min_tokens_bans_apply_before_ban_until(shape):
    """A ban (−inf entry) applies at the positions before its row's ban_until and nowhere after; a bias beside
    it on the same id applies everywhere; a row with bans over and no bias is returned as it was."""
    from dspark_jax.sampling import add_logit_bias

    logits = np.random.default_rng(3).normal(size=shape).astype(np.float32)
    ids = np.array([[4, 4, 7, 0], [2, 0, 0, 0]], np.int32)
    bias = np.array([[1.5, -np.inf, -np.inf, 0], [-np.inf, 0, 0, 0]], np.float32)
    until = np.array([12, 5], np.int32)
    pos = np.array([[10, 11, 12], [5, 6, 7]], np.int32)[:, : shape[1] if len(shape) == 3 else 1]
    if len(shape) == 2:
        pos = pos[:, 0]
    got = np.asarray(jax.jit(add_logit_bias)(logits, ids, bias, pos, until))
    want = logits.copy()
    want[0, ..., 4] += 1.5
    for t, p in enumerate(np.atleast_1d(pos[0])):
        if p < 12:
            idx = (0, t) if len(shape) == 3 else (0,)
            want[idx + (4,)] = want[idx + (7,)] = -np.inf
    np.testing.assert_array_equal(got, want)
    assert np.isneginf(got[0, ..., 7]).any() and not np.isneginf(got[1]).any()  # row 1: positions ≥ 5 only
    same = np.asarray(jax.jit(add_logit_bias)(logits[1:], ids[1:], bias[1:], pos[1:], until[1:]))
    np.testing.assert_array_equal(same, logits[1:])


def test_token_bias_entries_and_limits():
    from dspark_jax.sampling import LOGIT_BIAS_MAX, TokenBias, check_min_tokens

    assert TokenBias.of({}, stop_ids=(2, 3)) is None  # min_tokens 0: no ban
    assert TokenBias.of(None, stop_ids=(), min_tokens=4) is None  # nothing to ban (ignore_eos, no stop ids)
    tb = TokenBias.of({5: 1.0}, stop_ids=[3, 2, 3], prompt_len=10, min_tokens=4)
    assert tb == TokenBias({5: 1.0}, (2, 3), 14)
    assert tb.entries() == ([5, 2, 3], [1.0, -np.inf, -np.inf])
    assert TokenBias.of({5: 1.0}) == TokenBias({5: 1.0}, (), 0)
    many = {i: 1.0 for i in range(LOGIT_BIAS_MAX - 1)}
    assert len(TokenBias.of(many, stop_ids=(100,), min_tokens=1).entries()[0]) == LOGIT_BIAS_MAX
    with pytest.raises(ValueError, match="min_tokens bans the 2 stop token ids"):
        TokenBias.of(many, stop_ids=(100, 101), min_tokens=1)
    assert check_min_tokens(3, 3) == 3 and check_min_tokens(0, 0) == 0
    for bad, what in [(-1, ">= 0"), (1.0, ">= 0"), (True, ">= 0"), (5, "at most max_tokens")]:
        with pytest.raises(ValueError, match=what):
            check_min_tokens(bad, 4)


def test_filter_spot_values():
    logits = jnp.log(jnp.array([[0.5, 0.2, 0.15, 0.1, 0.05]] * 4))
    probs = jit_filter(
        logits,
        temperature=jnp.array([1.0, 1.0, 1.0, 1.0]),
        top_k=jnp.array([2, 0, 0, 3], jnp.int32),
        top_p=jnp.array([1.0, 0.6, 0.45, 0.7], jnp.float32),
    )
    want = [
        [5 / 7, 2 / 7, 0, 0, 0],  # top-2
        [5 / 7, 2 / 7, 0, 0, 0],  # 0.5 < 0.6, so the crossing token 0.2 is kept
        [1.0, 0, 0, 0, 0],  # 0.5 already reaches 0.45: nothing more
        [5 / 7, 2 / 7, 0, 0, 0],  # top-3 renormalised to (0.588, 0.235, 0.176), then top-p 0.7
    ]
    np.testing.assert_allclose(np.asarray(probs), want, atol=1e-6)


def test_greedy_rows_are_one_hot_first_index_on_ties():
    logits = jnp.array([[0.0, 3.0, 3.0, 1.0], [2.0, -1.0, 2.0, 2.0]])
    probs = jit_filter(logits, jnp.zeros(2), jnp.array([2, 0], jnp.int32), jnp.array([0.5, 1.0]))
    np.testing.assert_array_equal(np.asarray(probs), [[0, 1, 0, 0], [1, 0, 0, 0]])


def test_top_k_keeps_ties_at_kth_value():
    probs = jit_filter(jnp.array([[1.0, 2.0, 2.0, 0.0]]), jnp.ones(1), jnp.array([1], jnp.int32), jnp.ones(1))
    np.testing.assert_allclose(np.asarray(probs), [[0, 0.5, 0.5, 0]], atol=1e-7)


def test_filter_rejects_bad_shapes():
    with pytest.raises(ValueError, match="temperature"):
        filter_probs(jnp.zeros((2, 5)), jnp.ones(3), jnp.zeros(2, jnp.int32), jnp.ones(2))
    with pytest.raises(ValueError, match="logits"):
        filter_probs(jnp.zeros((5,)), jnp.ones(1), jnp.zeros(1, jnp.int32), jnp.ones(1))
    with pytest.raises(ValueError, match="min_p"):
        filter_probs(jnp.zeros((2, 5)), jnp.ones(2), jnp.zeros(2, jnp.int32), jnp.ones(2), jnp.zeros(3))


def test_sample_one_hot_returns_argmax():
    hot = jnp.array([3, 0, 7, 7, 1])
    probs = jax.nn.one_hot(hot, 8)
    raw_keys = np.random.default_rng(1).integers(0, 2**32, size=(2000, 2), dtype=np.uint32)
    tokens = jax.jit(jax.vmap(sample, in_axes=(0, None)))(raw_keys, probs)
    np.testing.assert_array_equal(np.asarray(tokens), np.broadcast_to(hot, tokens.shape))
    assert tokens.dtype == jnp.int32


def test_sample_frequencies_chi_square():
    p = np.array([0.4, 0.25, 0.0, 0.2, 0.1, 0.05])
    n = 200_000
    tokens = jit_sample(jax.random.key(2), jnp.broadcast_to(jnp.asarray(p, jnp.float32), (n, p.size)))
    counts = np.bincount(np.asarray(tokens), minlength=p.size)
    assert counts[2] == 0  # zero-probability tokens are never drawn
    support = p > 0
    expected = n * p[support]
    chi2 = np.sum((counts[support] - expected) ** 2 / expected)
    assert chi2 < CHI2_999[int(support.sum()) - 1], (chi2, counts)


def test_sample_per_row_keys_and_3d():
    probs = np.random.default_rng(3).dirichlet(np.ones(10), size=(4, 3)).astype(np.float32)
    keys = jax.random.split(jax.random.key(4), 4)
    got = jit_sample(keys, probs)
    assert got.shape == (4, 3) and got.dtype == jnp.int32
    # Row b depends on keys[b] and probs[b] only, not on which rows share its batch.
    # Row 3 moved to the front of a batch whose other rows differ: same key, same probs, same tokens.
    other = jit_sample(keys[::-1], np.concatenate([probs[3:], probs[2::-1] ** 2], axis=0))
    np.testing.assert_array_equal(np.asarray(got[3]), np.asarray(other[0]))
    raw = jax.random.split(jax.random.PRNGKey(5), 4)  # legacy uint32 [B, 2] keys
    assert jit_sample(raw, probs[:, 0]).shape == (4,)
    with pytest.raises(ValueError, match="per-row keys"):
        sample(keys[:3], probs)


def test_chi2_constants():
    from scipy import stats  # a dev dependency: its absence is an error, not a skip
    for df, value in CHI2_999.items():
        assert abs(stats.chi2.ppf(0.999, df) - value) < 1e-3


def test_check_params_is_the_one_validator_and_normalises():
    from dspark_jax.sampling import check_params

    assert check_params(0.7, 5, 0.9, vocab=100) == (0.7, 5, 0.9)
    assert check_params(1e-6, -1, 1.0, vocab=100) == (0.0, 0, 1.0)  # greedy; -1 is off
    assert check_params(1, 100, 1, vocab=100) == (1.0, 0, 1.0)  # keeping the whole vocabulary is off
    assert check_params(1.0, 100, 1.0) == (1.0, 100, 1.0)  # no vocabulary given: kept as asked
    for bad, field in (((-0.1, 0, 1.0), "temperature"), ((float("nan"), 0, 1.0), "temperature"),
                       ((float("inf"), 0, 1.0), "temperature"), ((1.0, -2, 1.0), "top_k"),
                       ((1.0, 2.5, 1.0), "top_k"), ((1.0, True, 1.0), "top_k"), ((1.0, 0, 0.0), "top_p"),
                       ((1.0, 0, 1.5), "top_p"), ((1.0, 0, float("nan")), "top_p"), (("1", 0, 1.0), "temperature"),
                       ((10**400, 0, 1.0), "temperature"), ((1.0, 0, 10**400), "top_p")):  # too big for a float
        with pytest.raises(ValueError, match=field):
            check_params(*bad)
