"""DSpark's Markov head started from the training data's bigram statistics (`drafter.markov_init: pmi`).

The head adds W1[x_{k−1}]·W2 to block position k's logits: what the previous token says about the next one beyond
what the backbone, blind to it, already predicts. Trained from zero (W2 = 0) it spends its first hundreds of steps
learning the bigram table; started at the data's smoothed pointwise mutual information it begins there:

    M[r, c] = log P(c | r) − log P(c),   P(c | r) = (n(r, c) + k·P(c)) / (n(r) + k),   P(c) = (n(c) + 1) / (N + V)

over consecutive response tokens (r: the previous token's Markov row, c: the next token's draft index, pairs whose
next token is outside the draft vocabulary dropped), shrunk toward P(c) by k = `prior` pseudo-counts, each row
centred (a constant per row does not change a softmax), cut to rank R by a randomized SVD and split evenly:
W1 = U·√S, W2 = √S·Vᵀ. An unseen pair's M is a row constant, log(k / (n(r) + k)), so M is a sparse matrix plus one
rank-one term and is never formed densely (the whole vocabulary is 49,152² entries).

Measured (reports/2026-12-06/markov-pmi): at the cheap-A/B budget a rank-256 head started this way reaches at step 50
the held-out c* a zero-started one reaches at step 300.
"""

from __future__ import annotations

import numpy as np
import scipy.sparse


def bigram_counts(sequences, prompt_lens, index: np.ndarray, n_rows: int, n_cols: int) -> scipy.sparse.csr_matrix:
    """float64 [n_rows, n_cols] CSR: how often the previous token's Markov row `index[prev]` is followed by the next
    token's draft column `index[next]` (≥ n_cols: outside the draft vocabulary, dropped), the next token a
    response token."""
    rows, cols = [], []
    for seq, p in zip(sequences, prompt_lens, strict=True):
        seq = np.asarray(seq, np.int64)
        p = max(int(p), 1)
        if len(seq) <= p:
            continue
        r, c = index[seq[p - 1:-1]], index[seq[p:]]
        keep = c < n_cols
        rows.append(r[keep])
        cols.append(c[keep])
    r = np.concatenate(rows) if rows else np.zeros(0, np.int64)
    c = np.concatenate(cols) if cols else np.zeros(0, np.int64)
    return scipy.sparse.csr_matrix((np.ones(len(r)), (r, c)), shape=(n_rows, n_cols))


def centred_pmi(counts: scipy.sparse.csr_matrix, prior: float = 10.0):
    """(A, m): the row-centred smoothed PMI as A − m·1ᵀ, A sparse where pairs were seen (float32 CSR), m [rows]."""
    counts = scipy.sparse.csr_matrix(counts, dtype=np.float64)
    n_rows, n_cols = counts.shape
    col = np.asarray(counts.sum(0)).ravel()
    row = np.asarray(counts.sum(1)).ravel()
    pc = (col + 1.0) / (col.sum() + n_cols)
    unseen = np.log(prior / (row + prior))  # M of an unseen pair in row r
    coo = counts.tocoo()
    m_seen = np.log((coo.data + prior * pc[coo.col]) / (row[coo.row] + prior)) - np.log(pc[coo.col])
    a = scipy.sparse.csr_matrix((m_seen - unseen[coo.row], (coo.row, coo.col)), shape=counts.shape)
    mean = np.asarray(a.sum(1)).ravel() / n_cols  # row mean of M, less the row constant
    return a.astype(np.float32), mean.astype(np.float32)


def pmi_factors(counts, rank: int, prior: float = 10.0, scale: float = 1.0, oversample: int = 64,
                power_iters: int = 1, seed: int = 0) -> tuple[np.ndarray, np.ndarray, float]:
    """(W1 [rows, rank], W2 [rank, cols], the share of the centred PMI's squared norm the rank keeps).

    A randomized SVD (Halko, Martinsson & Tropp 2011: a Gaussian sketch and `power_iters` re-orthonormalised power
    iterations) of A − m·1ᵀ through products with the sparse A and Aᵀ (scipy) and dense QR and SVD in jax (on the
    accelerator when there is one), over the rows that were seen (the others are zero in M and in W1); exact when
    those rows are no more than rank + oversample. W1·W2 is the rank-`rank` approximation times `scale`."""
    import jax.numpy as jnp

    a, m = centred_pmi(counts, prior)
    n_rows, n_cols = a.shape
    seen = np.flatnonzero(np.diff(a.indptr))
    a, m = a[seen], m[seen]
    k = min(rank + oversample, len(seen), n_cols)
    at = a.T.tocsr()

    def mul(x):  # (A − m·1ᵀ) x
        x = np.asarray(x, np.float32)
        return a @ x - np.outer(m, x.sum(0))

    def mul_t(y):  # (A − m·1ᵀ)ᵀ y
        y = np.asarray(y, np.float32)
        return at @ y - (m @ y)[None, :]

    def orth(x):
        return jnp.linalg.qr(jnp.asarray(x))[0]

    if k == len(seen):  # as many seen rows as the sketch: the basis of the row space is exact
        q = jnp.eye(k, dtype=jnp.float32)
    else:
        q = orth(mul(np.random.default_rng(seed).standard_normal((n_cols, k)).astype(np.float32)))
        for _ in range(power_iters):
            q = orth(mul(orth(mul_t(q))))
    u_b, s, vt = jnp.linalg.svd(jnp.asarray(mul_t(q)).T, full_matrices=False)
    r = min(rank, k)
    u, s, vt = np.asarray(q @ u_b[:, :r]), np.asarray(s[:r]), np.asarray(vt[:r])
    total = float(a.multiply(a).sum() - n_cols * np.sum(m.astype(np.float64) ** 2))
    kept = float(np.sum(s.astype(np.float64) ** 2) / total) if total > 0 else 1.0
    root = np.sqrt(s * scale)
    w1 = np.zeros((n_rows, rank), np.float32)
    w2 = np.zeros((rank, n_cols), np.float32)
    w1[seen, :r] = u * root
    w2[:r] = root[:, None] * vt
    return w1, w2, kept


def markov_index(cfg) -> tuple[np.ndarray, int, int]:
    """(index [V], n_rows, n_cols) for a DrafterConfig: target id → its W1 row and its W2 column, the same number (a
    reduced vocabulary's outside tokens, index Vd, share W1's last row and have no column)."""
    from dspark_jax import draft_vocab

    if not draft_vocab.is_reduced(cfg):
        return np.arange(cfg.vocab_size), cfg.vocab_size, cfg.vocab_size
    vd = draft_vocab.size(cfg)
    return np.asarray(draft_vocab.t2d(cfg)), vd + 1, vd


def pmi_head(cfg, sequences, prompt_lens, prior: float = 10.0) -> tuple[np.ndarray, np.ndarray, dict]:
    """(W1, W2, stats) for a DSpark config from token sequences and their prompt lengths."""
    counts = bigram_counts(sequences, prompt_lens, *markov_index(cfg))
    w1, w2, kept = pmi_factors(counts, cfg.markov_rank, prior)
    return w1, w2, {"bigrams": int(counts.sum()), "pairs": int(counts.nnz), "kept_energy": round(kept, 6),
                    "prior": prior}


def data_pmi_head(cfg, data_dir: str, prior: float = 10.0) -> tuple[np.ndarray, np.ndarray, dict]:
    """`pmi_head` over the responses of a prepared data directory (train/prepare.py shards)."""
    from train.vocab import read_records

    records = read_records(data_dir)
    if not records:
        raise ValueError(f"drafter.markov_init pmi: no prepared data in {data_dir!r} to count bigrams from")
    return pmi_head(cfg, [r["tokens"] for r in records], [r["prompt_len"] for r in records], prior)


__all__ = ["bigram_counts", "centred_pmi", "data_pmi_head", "markov_index", "pmi_factors", "pmi_head"]
