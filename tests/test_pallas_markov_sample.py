"""Tests for pallas_kernels.markov_sample: the fused Markov-head block sampler against its references.

Oracles: `markov_sample_reference` (plain jnp, same hash noise → identical tokens), a numpy greedy loop,
the softmax distribution itself (chi-square on the joint of two positions), murmur3_32 written out in Python,
and lowering for CUDA (Triton) and TPU (Mosaic) from this CPU. Kernels run in Pallas interpret mode here; the
`gpu` test compiles for real and is skipped without a GPU.
"""

from __future__ import annotations

import functools
import struct

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels.gumbel_hash import hash_bits, row_keys
from pallas_kernels.markov_sample import markov_sample, markov_sample_reference


def make_inputs(B, L, V, R, dtype=jnp.float32, temps=(0.0, 0.7, 1.0), seed=0, w2_scale=0.5):
    k = jax.random.split(jax.random.key(seed), 5)
    U = (2.0 * jax.random.normal(k[0], (B, L, V))).astype(dtype)
    w1 = jax.random.normal(k[1], (V, R)).astype(dtype)
    w2 = (w2_scale * jax.random.normal(k[2], (R, V))).astype(dtype)
    anchor = jax.random.randint(k[3], (B,), 0, V, jnp.int32)
    temperature = jnp.asarray([temps[b % len(temps)] for b in range(B)], jnp.float32)
    seeds = jax.random.bits(k[4], (B, 2), jnp.uint32)
    return U, w1, w2, anchor, temperature, seeds


# (B, L, V, R, dtype, kernel options): cover one split and several, ragged rows (B % block_b) and ragged
# vocab (V % block_v, V % split_v), and all three kernel flavours (cpu; gpu = masked Triton loads; tpu =
# U transposed to [L, B, V]), each interpreted.
CASES = [
    (1, 1, 256, 8, jnp.float32, {}),
    (3, 4, 384, 16, jnp.bfloat16, dict(block_v=256, split_v=256, block_b=2)),
    (3, 7, 320, 16, jnp.float32, dict(backend="gpu", interpret=True, block_v=128, split_v=256)),
    (3, 4, 320, 16, jnp.float32, dict(backend="tpu", interpret=True, block_v=128, split_v=256)),
]


def case_id(case) -> str:
    B, L, V, R, dtype, opts = case
    return f"B{B}-L{L}-V{V}-R{R}-{jnp.dtype(dtype).name}-{opts.get('backend', 'cpu')}"


@pytest.mark.parametrize("B,L,V,R,dtype,opts", CASES, ids=[case_id(c) for c in CASES])
def test_matches_reference(B, L, V, R, dtype, opts):
    args = make_inputs(B, L, V, R, dtype)
    got = markov_sample(*args, **opts)
    want = markov_sample_reference(*args)
    np.testing.assert_array_equal(got.tokens, want.tokens)
    np.testing.assert_allclose(got.logq, want.logq, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(got.lse, want.lse, rtol=1e-5, atol=1e-5)
    np.testing.assert_array_equal(got.e, want.e)
    assert got.tokens.dtype == jnp.int32 and got.e.dtype == dtype and got.e.shape == (B, L, R)
    greedy = np.asarray(args[4]) == 0.0
    assert np.all(np.asarray(got.logq)[greedy] == 0.0) and np.all(np.asarray(got.logq)[~greedy] < 0.0)


def test_reference_matches_definition():
    """The reference itself, against eq. 4–5 written out: lse, logq and e from the drawn tokens."""
    B, L, V, R = 3, 4, 64, 8
    U, w1, w2, anchor, temperature, seeds = make_inputs(B, L, V, R)
    out = markov_sample_reference(U, w1, w2, anchor, temperature, seeds)
    U, w1, w2, tok = (np.asarray(x, np.float64) for x in (U, w1, w2, out.tokens))
    prev = np.asarray(anchor)
    for k in range(L):
        e = w1[prev]
        t = np.where(np.asarray(temperature) > 0, np.asarray(temperature), 1.0)[:, None]
        scaled = (U[:, k] + e @ w2) / t
        lse = np.log(np.exp(scaled - scaled.max(1, keepdims=True)).sum(1)) + scaled.max(1)
        np.testing.assert_allclose(out.lse[:, k], lse, rtol=1e-5)
        np.testing.assert_allclose(out.e[:, k], e, rtol=1e-6)
        x = tok[:, k].astype(int)
        logq = np.where(np.asarray(temperature) > 0, scaled[np.arange(B), x] - lse, 0.0)
        np.testing.assert_allclose(out.logq[:, k], logq, rtol=1e-5, atol=1e-5)
        prev = x


def test_greedy_equals_numpy_argmax_loop():
    B, L, V, R = 2, 5, 256, 8
    U, w1, w2, anchor, _, seeds = make_inputs(B, L, V, R, seed=3, w2_scale=2.0)
    got = markov_sample(U, w1, w2, anchor, jnp.zeros((B,), jnp.float32), seeds, block_v=128)
    U, w1, w2 = np.asarray(U), np.asarray(w1), np.asarray(w2)
    prev, want = np.asarray(anchor), []
    for k in range(L):
        prev = np.argmax(U[:, k] + w1[prev] @ w2, axis=-1)
        want.append(prev)
    np.testing.assert_array_equal(got.tokens, np.stack(want, 1))
    np.testing.assert_array_equal(got.logq, 0.0)


def test_greedy_ties_pick_the_first_index():
    """Equal logits everywhere (W2 = 0, U constant): argmax's first-index rule, across chunks and splits."""
    B, L, V, R = 2, 2, 256, 8
    U = jnp.zeros((B, L, V)).at[:, :, 200].set(1.0).at[:, :, 70].set(1.0)
    args = (U, jnp.ones((V, R)), jnp.zeros((R, V)), jnp.zeros((B,), jnp.int32), jnp.zeros((B,)),
            jnp.zeros((B, 2), jnp.uint32))
    got = markov_sample(*args, block_v=64, split_v=128)
    np.testing.assert_array_equal(got.tokens, 70)


def softmax(z):
    p = np.exp(z - z.max(-1, keepdims=True))
    return p / p.sum(-1, keepdims=True)


def test_sampler_matches_softmax_chi_square():
    """T=1 and T=0.5 rows: the joint of (x_0, x_1) under the kernel's sampler vs eq. 4 (64 cells, V=8).

    Each row has its own seeds, so rows are independent draws. The two-position joint also checks the Markov
    dependency (x_1 | x_0 through W1, W2), and block_v=4, split_v=4 exercises the chunk and split merges.
    p > 2.5e-4 per temperature: a false alarm rate under 0.05% for the pair.
    """
    import scipy.stats as scipy_stats
    N, V, R = 16384, 8, 8
    k = jax.random.split(jax.random.key(7), 4)
    U0 = 0.5 * jax.random.normal(k[0], (1, 2, V))
    U = jnp.broadcast_to(U0, (N, 2, V))
    w1, w2 = jax.random.normal(k[1], (V, R)), 0.2 * jax.random.normal(k[2], (R, V))
    temperature = jnp.where(jnp.arange(N) % 2 == 0, 1.0, 0.5).astype(jnp.float32)
    anchor = jnp.full((N,), 3, jnp.int32)
    seeds = jax.random.bits(k[3], (N, 2), jnp.uint32)
    out = markov_sample(U, w1, w2, anchor, temperature, seeds, block_v=4, split_v=4)
    tok = np.asarray(out.tokens)
    U0, w1, w2 = (np.asarray(x, np.float64) for x in (U0[0], w1, w2))
    for t, rows in ((1.0, slice(0, None, 2)), (0.5, slice(1, None, 2))):
        p0 = softmax((U0[0] + w1[3] @ w2) / t)  # [V]
        p1 = softmax((U0[1][None] + w1 @ w2) / t)  # [V(prev), V]
        expected = (p0[:, None] * p1).ravel() * (N // 2)
        observed = np.bincount(tok[rows, 0] * V + tok[rows, 1], minlength=V * V)
        # Pool cells expected below 5, plus the next rarest if the pool is still small (chi-square's validity).
        order = np.argsort(expected)
        n_pool = max(int(np.sum(expected < 5)), 1)
        n_pool += expected[order[:n_pool]].sum() < 5
        pool, keep = order[:n_pool], order[n_pool:]
        expected = np.append(expected[keep], expected[pool].sum())
        observed = np.append(observed[keep], observed[pool].sum())
        assert len(expected) > 40 and expected.min() >= 5, (n_pool, expected.min())
        stat = ((observed - expected) ** 2 / expected).sum()
        p_value = scipy_stats.chi2.sf(stat, len(expected) - 1)
        assert p_value > 2.5e-4, (t, stat, p_value)
        # logq is log q(x_k) of the drawn token under the same distribution
        np.testing.assert_allclose(np.exp(out.logq[rows, 0]), p0[tok[rows, 0]], rtol=1e-4)


def test_hash_is_murmur3_and_noise_ignores_batch_slot():
    def murmur3_32(data: bytes, seed: int) -> int:  # Appleby's reference, for 4-byte-aligned input
        c1, c2, m = 0xCC9E2D51, 0x1B873593, 0xFFFFFFFF
        rotl = lambda x, r: ((x << r) | (x >> (32 - r))) & m  # noqa: E731
        h = seed
        for (w,) in struct.iter_unpack("<I", data):
            w = rotl((w * c1) & m, 15) * c2 & m
            h = (rotl(h ^ w, 13) * 5 + 0xE6546B64) & m
        h ^= len(data)
        for shift, mul in ((16, 0x85EBCA6B), (13, 0xC2B2AE35)):
            h = ((h ^ (h >> shift)) * mul) & m
        return h ^ (h >> 16)

    assert murmur3_32(b"\0\0\0\0", 0) == 0x2362F9DE  # published test vector
    seeds = np.array([[0, 0], [0xDEADBEEF, 0x12345678], [0xFFFFFFFF, 1]], np.uint32)
    for k in (0, 6):
        keys = row_keys(jnp.asarray(seeds), k)
        for v in (0, 1, 151935):
            got = np.asarray(hash_bits(keys, jnp.full((3,), v, jnp.int32)))
            want = [murmur3_32(struct.pack("<III", int(s1), k, v), int(s0)) for s0, s1 in seeds]
            np.testing.assert_array_equal(got, np.asarray(want, np.uint32))

    # A request's draft depends on its seeds, not on its row or its neighbours.
    U, w1, w2, anchor, temperature, seeds = make_inputs(3, 4, 64, 8, temps=(1.0,))
    alone = markov_sample_reference(U[1:2], w1, w2, anchor[1:2], temperature[1:2], seeds[1:2])
    together = markov_sample_reference(U, w1, w2, anchor, temperature, seeds)
    np.testing.assert_array_equal(alone.tokens[0], together.tokens[1])


def test_bad_inputs_raise():
    U, w1, w2, anchor, temperature, seeds = make_inputs(2, 3, 256, 16)
    call = functools.partial(markov_sample, U, w1, w2, anchor, temperature, seeds)
    with pytest.raises(NotImplementedError, match="top-k/top-p"):
        call(top_k=jnp.zeros((2,), jnp.int32))
    bad = [
        (dict(), "U must be", (U[0], w1, w2, anchor, temperature, seeds)),
        (dict(), "U must be float32 or bfloat16", (U.astype(jnp.float16), w1, w2, anchor, temperature, seeds)),
        (dict(), "w1 must be", (U, w1[:100], w2, anchor, temperature, seeds)),
        (dict(), r"w2 must be \[R, V\]", (U, w1, w2.T, anchor, temperature, seeds)),
        (dict(), "share a float32/bfloat16 dtype", (U, w1, w2.astype(jnp.bfloat16), anchor, temperature, seeds)),
        (dict(), "anchor must be int32", (U, w1, w2, anchor.astype(jnp.float32), temperature, seeds)),
        (dict(), "temperature must be float32", (U, w1, w2, anchor, temperature[:1], seeds)),
        (dict(), "seeds must be uint32", (U, w1, w2, anchor, temperature, jax.random.key_data(
            jax.random.split(jax.random.key(0), 2)).astype(jnp.int32))),
    ]
    for opts, msg, args in bad:
        with pytest.raises(ValueError, match=msg):
            markov_sample(*args, **opts)
    for opts, msg in [
        (dict(backend="metal"), "backend must be one of"),
        (dict(backend="cpu", interpret=False), "only runs in interpret mode"),
        (dict(backend="gpu", interpret=True, block_v=100), "block_v to be a power of two"),
        (dict(backend="gpu", interpret=True, block_b=8), "block_b to be a power of two"),
        (dict(backend="tpu", interpret=True, block_v=64), "block_v to be a multiple of 128"),
        (dict(backend="tpu", interpret=True, block_b=4), "block_b to be a multiple of 8"),
        (dict(block_v=128, split_v=192), "split_v must be a multiple of block_v"),
        (dict(block_v=0), "block_v must be a positive int"),
    ]:
        with pytest.raises(ValueError, match=msg):
            call(**opts)
    w1_8, w2_8 = w1[:, :8], w2[:8]
    with pytest.raises(ValueError, match="R to be a power of two"):
        markov_sample(U, w1_8, w2_8, anchor, temperature, seeds, backend="gpu", interpret=True)


# ---- lowering for accelerators we don't have (not executed) ------------------------------------------------
def _lower(platform: str, device_kind: str, B, L, V, R, dtype, **opts) -> str:
    """StableHLO text of markov_sample lowered for `platform` from this machine (shapes only, no memory).

    The abstract device names the chip: Mosaic TPU reads its generation from it (the TPU lowering needs
    it), and jax ≥ 0.11 reads the GPU's compute capability from it for Triton.
    """
    sd = jax.ShapeDtypeStruct
    args = (sd((B, L, V), dtype), sd((V, R), dtype), sd((R, V), dtype), sd((B,), jnp.int32),
            sd((B,), jnp.float32), sd((B, 2), jnp.uint32))
    device = jax.sharding.AbstractDevice(device_kind=device_kind, num_cores=1,
                                         platform="gpu" if platform == "cuda" else platform)
    mesh = jax.sharding.AbstractMesh((1,), ("x",), abstract_device=device)
    f = functools.partial(markov_sample, interpret=False, **opts)
    with jax.sharding.use_abstract_mesh(mesh):
        return jax.jit(f).trace(*args).lower(lowering_platforms=(platform,)).as_text()


# Small ragged shapes with explicit blocks, and the deployment shape (Qwen3 vocab, R=256, L=7) with defaults.
LOWER_CASES = [(3, 2, 384, 16, jnp.float32, dict(block_v=128, split_v=256)),
               (3, 2, 384, 16, jnp.bfloat16, dict(block_v=128, split_v=256)),
               (64, 7, 151936, 256, jnp.bfloat16, {})]


@pytest.mark.parametrize("B,L,V,R,dtype,opts", LOWER_CASES, ids=[case_id(c)[:-4] for c in LOWER_CASES])
def test_lowers_for_cuda_triton(B, L, V, R, dtype, opts):
    text = _lower("cuda", "NVIDIA H200", B, L, V, R, dtype, backend="gpu", **opts)
    assert text.count("xla.gpu.triton") == L  # one kernel launch per draft position


@pytest.mark.parametrize("B,L,V,R,dtype,opts", LOWER_CASES, ids=[case_id(c)[:-4] for c in LOWER_CASES])
def test_lowers_for_tpu_mosaic(B, L, V, R, dtype, opts):
    text = _lower("tpu", "TPU v5 lite", B, L, V, R, dtype, backend="tpu", **opts)
    assert text.count("tpu_custom_call") == L


# ---- real accelerator ------------------------------------------------------------------------------------------
@pytest.mark.gpu
@pytest.mark.skipif(jax.default_backend() != "gpu", reason="needs a GPU")
@pytest.mark.parametrize("B", [1, 16, 20])
def test_gpu_compiled_matches_reference(B):
    args = make_inputs(B, 7, 4096 + 96, 256, jnp.bfloat16)
    got = markov_sample(*args)
    want = markov_sample_reference(*args)
    assert np.mean(np.asarray(got.tokens) == np.asarray(want.tokens)) > 0.99  # near-ties may flip on a GPU
    np.testing.assert_allclose(got.lse, want.lse, rtol=1e-4, atol=1e-4)
