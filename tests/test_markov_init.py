"""DSpark's Markov head started from the data's bigram PMI (train/markov_init.py, `drafter.markov_init: pmi`):
the sparse-plus-rank-one PMI against the dense formula, the randomized SVD against numpy's, the bigram counts'
rows and columns, and a run that starts from it."""

from __future__ import annotations

import json

import numpy as np
import pytest
import scipy.sparse
from test_train_pipeline import _cfg, _overrides, tiny  # noqa: F401  (tiny: a module fixture)

from train.config import load_config
from train.markov_init import bigram_counts, centred_pmi, pmi_factors, pmi_head


def _dense_centred_pmi(n: np.ndarray, prior: float) -> np.ndarray:
    col, row = n.sum(0), n.sum(1)
    pc = (col + 1) / (col.sum() + n.shape[1])
    m = np.log((n + prior * pc) / (row[:, None] + prior)) - np.log(pc)
    return m - m.mean(1, keepdims=True)


def test_centred_pmi_is_the_dense_formula():
    n = np.random.default_rng(0).poisson(0.4, (30, 25)).astype(float)
    n[4] = 0  # a previous token never seen: its row is zero
    a, m = centred_pmi(scipy.sparse.csr_matrix(n), prior=10.0)
    dense = a.toarray() - m[:, None]
    np.testing.assert_allclose(dense, _dense_centred_pmi(n, 10.0), atol=2e-6)
    np.testing.assert_allclose(dense[4], 0, atol=1e-7)


def test_pmi_factors_are_the_best_low_rank_approximation():
    rng = np.random.default_rng(1)
    n = rng.poisson(np.outer(rng.gamma(0.5, 4, 60), rng.gamma(0.5, 4, 50)) * 0.3).astype(float)
    want = _dense_centred_pmi(n, 5.0)
    u, s, vt = np.linalg.svd(want)
    for rank in (4, 12):
        w1, w2, kept = pmi_factors(scipy.sparse.csr_matrix(n), rank, prior=5.0, oversample=20, power_iters=6)
        assert w1.shape == (60, rank) and w2.shape == (rank, 50)
        best = (u[:, :rank] * s[:rank]) @ vt[:rank]
        assert np.abs(w1 @ w2 - best).max() < 1e-3 * np.abs(best).max()
        assert kept == pytest.approx((s[:rank] ** 2).sum() / (s ** 2).sum(), rel=1e-4)
        # split evenly: W1's columns and W2's rows carry √σ each
        np.testing.assert_allclose(np.linalg.norm(w1, axis=0), np.sqrt(s[:rank]), rtol=1e-3)
        np.testing.assert_allclose(np.linalg.norm(w2, axis=1), np.sqrt(s[:rank]), rtol=1e-3)
    w1, w2, _ = pmi_factors(scipy.sparse.csr_matrix(n), 4, prior=5.0, scale=0.25, power_iters=6)
    np.testing.assert_allclose(w1 @ w2, 0.25 * (u[:, :4] * s[:4]) @ vt[:4], atol=1e-3 * np.abs(want).max())


def test_pmi_factors_are_exact_over_few_seen_rows():
    """Rows never seen are zero in M and W1; when the seen rows are few the factors are exact."""
    n = np.zeros((40, 30))
    n[[2, 7, 11, 30]] = np.random.default_rng(2).poisson(1.0, (4, 30))
    w1, w2, kept = pmi_factors(scipy.sparse.csr_matrix(n), 8, prior=3.0)
    np.testing.assert_allclose(w1 @ w2, _dense_centred_pmi(n, 3.0), atol=1e-5)
    assert kept == pytest.approx(1.0, abs=1e-5)
    assert not w1[[0, 1, 3, 39]].any() and not w1[:, 4:].any()  # rank 4 at most: the other columns are zero


def test_bigram_counts_read_responses_into_markov_rows():
    # target ids 0..5; draft vocabulary {1, 3, 4} → columns 0, 1, 2; others share W1's row 3 and have no column
    t2d = np.array([3, 0, 3, 1, 2, 3])
    seqs = [np.array([5, 1, 3, 4, 0, 3]), np.array([2, 2, 4, 1])]
    counts = bigram_counts(seqs, [2, 1], t2d, 4, 3).toarray()
    want = np.zeros((4, 3))
    # seq 0, response from index 2: (1→3) (3→4) (4→0: dropped) (0→3); seq 1 from 1: (2→2: dropped) (2→4) (4→1)
    for r, c in [(0, 1), (1, 2), (3, 1), (3, 2), (2, 0)]:
        want[r, c] += 1
    np.testing.assert_array_equal(counts, want)


def test_fit_starts_the_markov_head_from_the_data_pmi(tiny, tmp_path):  # noqa: F811
    from dspark_jax.drafter import flat_params
    from train.fit import build, fit
    from train.vocab import read_records

    target, data = tiny
    cfg = load_config(None, [*_overrides(_cfg(data, tmp_path, steps=3)), "drafter.markov_init=pmi"])
    _, drafter = build(cfg, target)
    flat = flat_params(drafter.params)
    recs = read_records(data)
    w1, w2, stats = pmi_head(drafter.config, [r["tokens"] for r in recs], [r["prompt_len"] for r in recs])
    assert stats["bigrams"] > 500 and 0 < stats["kept_energy"] < 1
    np.testing.assert_allclose(np.asarray(flat["markov_w1"]) @ np.asarray(flat["markov_w2"]), w1 @ w2, atol=1e-5)
    zero = build(load_config(None, _overrides(_cfg(data, tmp_path / "zero", steps=3))), target)[1]
    for k, x in flat_params(zero.params).items():  # everything else is the fresh init
        if not k.startswith("markov_w"):
            np.testing.assert_array_equal(np.asarray(flat[k]), np.asarray(x), err_msg=k)
    assert not np.asarray(flat_params(zero.params)["markov_w2"]).any()
    fit(cfg, target=target, progress=False)
    losses = [json.loads(ln)["loss"] for ln in open(tmp_path / "metrics.jsonl") if '"loss"' in ln]
    assert len(losses) == 3 and all(np.isfinite(losses))


def test_markov_init_is_checked():
    with pytest.raises(ValueError, match="expected 'zero' or 'pmi'"):
        load_config(None, ["drafter.markov_init=bigram"])
    with pytest.raises(ValueError, match="starts a fresh head"):
        load_config(None, ["drafter.markov_init=pmi", "drafter.init_from=some/drafter"])
