"""dspark_jax/penalties.py against a numpy oracle written from vLLM's documented semantics: a request's history
read from the id pool through its pages, the penalised rows of a verification block (each row sees the anchor
and the drafts before it as generated), and the range checks."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest

from dspark_jax.penalties import (
    RowPenalties,
    check_frequency_penalty,
    check_presence_penalty,
    check_repetition_penalty,
    history,
    penalize,
    penalize_block,
)


def _oracle(x, prompt, generated, presence, frequency, repetition):
    """One logit row [V] (f64) penalised: repetition on prompt ∪ generated tokens, then frequency and presence on
    the generated ones."""
    x = np.asarray(x, np.float64).copy()
    counts = np.bincount(np.asarray(generated, int), minlength=x.size)[: x.size]
    hit = np.isin(np.arange(x.size), prompt) | (counts > 0)
    x = np.where(hit, np.where(x > 0, x / repetition, x * repetition), x)
    return x - frequency * counts - presence * (counts > 0)


def _pool(histories, page_size, M, P):
    """An id pool [P, page_size] and block tables [B, M] holding each history on shuffled pages (stale ids
    elsewhere, so only the positions before `upto` may count)."""
    rng = np.random.default_rng(0)
    ids = rng.integers(0, 11, (P, page_size)).astype(np.int32)
    pages = rng.permutation(P)
    tables = np.full((len(histories), M), P, np.int32)  # P: an unused entry
    at = 0
    for b, h in enumerate(histories):
        for m in range(-(-len(h) // page_size)):
            tables[b, m] = pages[at]
            ids[pages[at], : len(h[m * page_size:(m + 1) * page_size])] = h[m * page_size:(m + 1) * page_size]
            at += 1
    return ids, tables


def test_history_and_block_penalties_match_the_oracle():
    V, T, ps, M = 11, 4, 4, 5
    rng = np.random.default_rng(1)
    prompts = [[3, 5, 5, 1, 9], [2, 2, 2], [7]]
    generated = [[4, 4, 6, 3], [], [7, 7, 0, 1, 10, 7]]
    hist = [p + g for p, g in zip(prompts, generated, strict=True)]
    ids, tables = _pool(hist, ps, M, P=12)
    pen = RowPenalties(presence=jnp.asarray([0.5, -0.3, 0.0], jnp.float32),
                       frequency=jnp.asarray([0.25, 1.0, -0.7], jnp.float32),
                       repetition=jnp.asarray([1.6, 0.7, 1.0], jnp.float32),
                       prompt_len=jnp.asarray([len(p) for p in prompts], jnp.int32))
    upto = jnp.asarray([len(h) for h in hist], jnp.int32)
    counts, seen = history(jnp.asarray(ids), jnp.asarray(tables), upto, pen.prompt_len, V)
    for b in range(3):
        np.testing.assert_array_equal(np.asarray(counts[b]), np.bincount(generated[b], minlength=V))
        np.testing.assert_array_equal(np.asarray(seen[b]), np.isin(np.arange(V), prompts[b]))

    # A block [anchor, d1, d2, d3] per row, repeats included; row j's history is generated + block[:j+1].
    block = np.array([[4, 4, 9, 4], [2, 8, 8, 2], [7, 0, 5, 5]], np.int32)
    logits = rng.normal(0, 3, (3, T, V)).astype(np.float32)
    logits[0, 1, 9] = -np.inf  # a ban stays a ban
    got = np.asarray(penalize_block(jnp.asarray(logits), counts, seen, jnp.asarray(block), pen))
    p, f, r = (np.asarray(a) for a in (pen.presence, pen.frequency, pen.repetition))
    for b in range(3):
        for j in range(T):
            want = _oracle(logits[b, j], prompts[b], generated[b] + block[b, : j + 1].tolist(), p[b], f[b], r[b])
            np.testing.assert_allclose(got[b, j], want, rtol=1e-6, atol=1e-5, err_msg=f"row {b}, position {j}")
    assert got[0, 1, 9] == -np.inf
    # The [B, V] form (prefill: the history alone), and a row without penalties is left exactly as it was.
    flat = np.asarray(penalize(jnp.asarray(logits[:, 0]), counts, seen, pen))
    for b in range(3):
        np.testing.assert_allclose(flat[b], _oracle(logits[b, 0], prompts[b], generated[b], p[b], f[b], r[b]),
                                   rtol=1e-6, atol=1e-5)
    off = pen._replace(presence=jnp.zeros(3), frequency=jnp.zeros(3), repetition=jnp.ones(3))
    np.testing.assert_array_equal(np.asarray(penalize_block(jnp.asarray(logits), counts, seen, jnp.asarray(block),
                                                            off)), logits)
    assert not bool(off.on()) and bool(pen.on()) and not bool(pen.on(jnp.asarray([False] * 3)))


def test_history_counts_only_positions_before_upto():
    """A resumed request's generated tokens sit in the pool before its prompt ends being recomputed: positions
    ≥ upto (stale drafts, a chunk not yet prefilled) never count, and prompt_len splits prompt from output."""
    V = 6
    ids, tables = _pool([[1, 2, 3, 4, 5, 5, 5, 5]], 4, 2, P=3)
    counts, seen = history(jnp.asarray(ids), jnp.asarray(tables), jnp.asarray([6]), jnp.asarray([3]), V)
    np.testing.assert_array_equal(np.asarray(counts[0]), [0, 0, 0, 0, 1, 2])
    np.testing.assert_array_equal(np.asarray(seen[0]), [False, True, True, True, False, False])
    counts, seen = history(jnp.asarray(ids), jnp.asarray(tables), jnp.asarray([2]), jnp.asarray([3]), V)
    assert int(counts.sum()) == 0 and np.asarray(seen[0]).tolist() == [False, True, True, False, False, False]


@pytest.mark.parametrize(("check", "good", "bad"), [
    (check_presence_penalty, [None, -2, 0, 1.5, 2.0], [2.01, -3, float("nan"), "1", True]),
    (check_frequency_penalty, [None, -2.0, 0.0, 2], [-2.5, float("inf"), [1]]),
    (check_repetition_penalty, [None, 0.01, 1, 1.3, 10], [0, -1, 0.001, 10.5, float("inf"), "1.2"]),
])
def test_penalty_checks_name_their_range(check, good, bad):
    name = check.__name__.removeprefix("check_")
    for v in good:
        assert isinstance(check(v), float)
    for v in bad:
        with pytest.raises(ValueError, match=name):
            check(v)
