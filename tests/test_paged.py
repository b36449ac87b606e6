"""The CPU attention path of the paged engine (dspark_jax/paged.batched_ragged_attention) against the ragged
kernel's plain-jnp oracle, on ragged batches with idle requests, shuffled pages and GQA."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest

from dspark_jax.paged import batched_ragged_attention
from pallas_kernels.ragged_verify_attention import ragged_verify_attention_reference


@pytest.mark.parametrize("q_lens,ctx_extra,Q", [([3, 0, 8, 1], [5, 0, 17, 40], 8), ([32], [0], 32),
                                                 ([1, 1, 1], [0, 9, 63], 1)])
def test_batched_path_equals_the_reference(q_lens, ctx_extra, Q):
    rng = np.random.default_rng(0)
    R, N, K, H, ps, M = len(q_lens), 6, 2, 16, 8, 9
    P = R * M + 3
    T = max(sum(q_lens), 1) + 5  # padding rows at the end
    q = jnp.asarray(rng.normal(size=(T, N, H)), jnp.float32)
    kp = jnp.asarray(rng.normal(size=(P, K, ps, H)), jnp.float32)
    vp = jnp.asarray(rng.normal(size=(P, K, ps, H)), jnp.float32)
    tables = jnp.asarray(rng.permutation(P)[: R * M].reshape(R, M), jnp.int32)
    ctx = jnp.asarray(np.array(q_lens) + np.array(ctx_extra), jnp.int32)
    qs = jnp.asarray(np.concatenate([[0], np.cumsum(q_lens)]), jnp.int32)
    got = batched_ragged_attention(q, kp, vp, tables, ctx, qs, max_q_len=Q)
    want = ragged_verify_attention_reference(q, kp, vp, tables, ctx, qs, max_q_len=Q)
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), atol=2e-5)
    assert not np.isnan(np.asarray(got)).any()
    np.testing.assert_array_equal(np.asarray(got)[sum(q_lens):], 0.0)


def test_poisoned_positions_beyond_the_context_cannot_leak():
    """The engine's jnp path: K/V slots past each request's context (NaN, huge values: what a freed page may
    hold) change nothing, because values are zeroed as well as scores masked."""
    from test_pallas_ragged_attention import make_inputs

    ps = 16
    args = make_inputs((2, 3, 1), (10, 17, 5), T=8, N=4, K=2, H=16, page_size=ps)
    q, kp, vp, bt, ctx, qs = args
    clean = ragged_verify_attention_reference(*args)
    kp2, vp2 = np.array(kp), np.array(vp)
    for r in range(len(ctx)):
        for pos in range(int(ctx[r]), -(-int(ctx[r]) // ps) * ps):
            kp2[bt[r, pos // ps], :, pos % ps] = 1e30
            vp2[bt[r, pos // ps], :, pos % ps] = np.nan
    unused = sorted(set(range(kp.shape[0])) - set(bt[bt >= 0].tolist()))
    kp2[unused], vp2[unused] = np.nan, np.nan
    out = batched_ragged_attention(q, jnp.asarray(kp2), jnp.asarray(vp2), bt, ctx, qs, max_q_len=3, chunk_tokens=16)
    np.testing.assert_allclose(out, clean, rtol=1e-5, atol=1e-5)
