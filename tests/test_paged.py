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
