"""Tests for pallas_kernels.ragged_verify_attention: ragged paged verification attention against its oracles.

Oracles: `ragged_verify_attention_reference` (plain jnp: gather pages, mask, exact softmax), a direct masked
attention in numpy (float64) for the contiguous-cache special case and for the reference itself, and lowering
for CUDA (Triton) and TPU (Mosaic) from this CPU. Kernels run in Pallas interpret mode here, through all three
drivers (cpu, gpu = Triton's in-kernel page loop, tpu = scalar-prefetched page grid); the `gpu` test compiles
for real and is skipped without a GPU.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels.ragged_verify_attention import ragged_verify_attention, ragged_verify_attention_reference


def make_inputs(q_lens, ctx_lens, *, T, N, K, H, page_size, dtype=jnp.float32, extra_pages=3, seed=0):
    """Random q / pages with each request's pages drawn without replacement from a shuffled pool.

    Entries of block_tables past a request's pages hold -1 or P + 5 (must be ignored). Returns numpy tables.
    """
    R = len(q_lens)
    rng = np.random.default_rng(seed)
    pages_needed = [-(-c // page_size) for c in ctx_lens]
    max_pages = max(pages_needed) + 1
    P = sum(pages_needed) + extra_pages
    perm = rng.permutation(P)
    block_tables = np.full((R, max_pages), -1, np.int32)
    block_tables[:, -1] = P + 5
    used = 0
    for r, n in enumerate(pages_needed):
        block_tables[r, :n] = perm[used:used + n]
        used += n
    query_start = np.concatenate([[0], np.cumsum(q_lens)]).astype(np.int32)
    assert query_start[-1] <= T
    k = jax.random.split(jax.random.key(seed), 3)
    q = jax.random.normal(k[0], (T, N, H)).astype(dtype)
    k_pages = jax.random.normal(k[1], (P, K, page_size, H)).astype(dtype)
    v_pages = jax.random.normal(k[2], (P, K, page_size, H)).astype(dtype)
    return q, k_pages, v_pages, block_tables, np.asarray(ctx_lens, np.int32), query_start


def numpy_attention(q, k, v, pos, scale):
    """Masked attention in float64: q [Q, N, H], k/v [S, K, H], query i sees keys 0..pos[i]."""
    q, k, v = (np.asarray(x, np.float64) for x in (q, k, v))
    G = q.shape[1] // k.shape[1]
    k, v = np.repeat(k, G, axis=1), np.repeat(v, G, axis=1)  # [S, N, H]
    s = np.einsum("qnh,snh->qns", q, k) * scale
    s = np.where(np.arange(k.shape[0])[None, None, :] <= np.asarray(pos)[:, None, None], s, -np.inf)
    p = np.exp(s - s.max(-1, keepdims=True))
    return np.einsum("qns,snh->qnh", p / p.sum(-1, keepdims=True), v)


# (q_lens, ctx_lens, T, N, K, H, page_size, dtype, opts). Covers: q_len 0 (first, middle), a single token, a full
# bucket (no padding rows), pages partly filled (ctx % page_size ≠ 0), a whole context inside the block (ctx ==
# q_len), several q tiles per request (q_len > block_q), G ∈ {1, 2, 4}, page_size ∈ {8, 16}, H ∈ {16, 64}, block_kv
# < page_size, and the three drivers, all interpreted.
CASES = [
    ((0, 3, 1, 5), (9, 17, 1, 21), 12, 4, 4, 16, 8, jnp.float32, {}),
    ((4, 1, 3), (4, 30, 19), 8, 4, 2, 64, 16, jnp.float32, {}),
    ((6, 2, 0), (40, 2, 11), 8, 8, 2, 16, 8, jnp.float32, dict(block_q=4)),
    ((3, 7, 2), (35, 23, 16), 16, 8, 2, 16, 16, jnp.float32, dict(backend="gpu", interpret=True)),
    ((5, 0, 4), (21, 12, 37), 10, 4, 1, 64, 16, jnp.float32, dict(backend="tpu", interpret=True, block_kv=8)),
    ((1, 4, 2), (13, 40, 7), 8, 8, 2, 16, 8, jnp.bfloat16, {}),
    ((2, 5, 1), (18, 26, 33), 8, 4, 1, 64, 16, jnp.bfloat16, dict(backend="gpu", interpret=True)),
    ((3, 3), (19, 8), 8, 8, 2, 16, 8, jnp.bfloat16, dict(backend="tpu", interpret=True)),
]


def case_id(case) -> str:
    q_lens, _, T, N, K, H, ps, dtype, opts = case
    backend = opts.get("backend", "cpu")
    return f"q{'-'.join(map(str, q_lens))}-T{T}-N{N}K{K}-H{H}-ps{ps}-{jnp.dtype(dtype).name}-{backend}"


@pytest.mark.parametrize("q_lens,ctx_lens,T,N,K,H,page_size,dtype,opts", CASES, ids=[case_id(c) for c in CASES])
def test_matches_reference(q_lens, ctx_lens, T, N, K, H, page_size, dtype, opts):
    args = make_inputs(q_lens, ctx_lens, T=T, N=N, K=K, H=H, page_size=page_size, dtype=dtype)
    got = ragged_verify_attention(*args, **opts)
    want = ragged_verify_attention_reference(*args)
    assert got.shape == (T, N, H) and got.dtype == dtype
    tol = 1e-5 if dtype == jnp.float32 else 2e-2
    np.testing.assert_allclose(np.asarray(got, np.float32), np.asarray(want, np.float32), rtol=tol, atol=tol)
    np.testing.assert_array_equal(np.asarray(got, np.float32)[sum(q_lens):], 0.0)  # padding rows


@pytest.mark.parametrize("opts", [{}, dict(backend="gpu", interpret=True), dict(backend="tpu", interpret=True)],
                         ids=["cpu", "gpu", "tpu"])
def test_stacked_pools_read_the_layer_asked_for(opts):
    """Stacked pools [num_layers, P, K, page_size, H] with a (traced) layer index: each layer's output equals the
    kernel on that layer's pool alone, and differs from its neighbours' (the index is really used)."""
    args = make_inputs((3, 1, 2), (19, 8, 30), T=8, N=4, K=2, H=16, page_size=16, dtype=jnp.float32)
    q, kp, vp, *rest = args
    ks = jnp.stack([kp, kp * 0.5 + 1.0, -kp])
    vs = jnp.stack([vp, vp * 2.0, vp + 3.0])
    f = jax.jit(lambda layer: ragged_verify_attention(q, ks, vs, *rest, layer=layer, **opts))
    outs = [np.asarray(f(jnp.int32(i))) for i in range(3)]
    for i in range(3):
        want = ragged_verify_attention_reference(q, ks[i], vs[i], *rest)
        np.testing.assert_allclose(outs[i], np.asarray(want), rtol=1e-5, atol=1e-5)
    assert not np.allclose(outs[0], outs[1]) and not np.allclose(outs[1], outs[2])
    with pytest.raises(ValueError, match="stacked"):
        ragged_verify_attention(q, kp, vp, *rest, layer=0, **opts)


def test_reference_matches_numpy_per_request():
    """The reference itself, request by request: pages gathered by hand, positions from the definition."""
    q_lens, ctx_lens, ps = (0, 3, 1, 4), (5, 20, 9, 4), 8
    q, kp, vp, bt, ctx, qs = make_inputs(q_lens, ctx_lens, T=10, N=4, K=2, H=16, page_size=ps)
    out = np.asarray(ragged_verify_attention_reference(q, kp, vp, bt, ctx, qs, sm_scale=0.3))
    for r, (n, c) in enumerate(zip(q_lens, ctx_lens, strict=True)):
        pages = bt[r, : -(-c // ps)]
        k = np.asarray(kp)[pages].transpose(0, 2, 1, 3).reshape(-1, 2, 16)[:c]  # [c, K, H]
        v = np.asarray(vp)[pages].transpose(0, 2, 1, 3).reshape(-1, 2, 16)[:c]
        want = numpy_attention(np.asarray(q)[qs[r]:qs[r] + n], k, v, c - n + np.arange(n), 0.3)
        np.testing.assert_allclose(out[qs[r]:qs[r] + n], want, rtol=1e-5, atol=1e-5)
    np.testing.assert_array_equal(out[sum(q_lens):], 0.0)


@pytest.mark.parametrize("backend", ["cpu", "tpu"])
def test_contiguous_cache_equals_numpy_masked_attention(backend):
    """P = B pages of page_size = S, block_tables = arange(B)[:, None]: the Decoder's [B, K, S, H] cache as is.

    Each row b verifies num_new[b] tokens ending at cache length lens[b] (a decode-style [B, T] block flattened).
    """
    B, S, N, K, H, Tb = 3, 32, 4, 2, 16, 4
    num_new, lens = np.array([4, 1, 3]), np.array([13, 32, 3])
    key = jax.random.split(jax.random.key(1), 3)
    cache_k = jax.random.normal(key[0], (B, K, S, H))
    cache_v = jax.random.normal(key[1], (B, K, S, H))
    q_block = jax.random.normal(key[2], (B, Tb, N, H))  # [B, T, N, H], rows ≥ num_new[b] unused
    query_start = np.concatenate([[0], np.cumsum(num_new)]).astype(np.int32)
    rows = np.concatenate([b * Tb + np.arange(n) for b, n in enumerate(num_new)])
    q = jnp.asarray(q_block).reshape(B * Tb, N, H)[rows]
    q = jnp.pad(q, ((0, B * Tb - len(rows)), (0, 0), (0, 0)))  # capacity bucket B·T
    out = ragged_verify_attention(q, cache_k, cache_v, jnp.arange(B, dtype=jnp.int32)[:, None],
                                  jnp.asarray(lens, jnp.int32), jnp.asarray(query_start), backend=backend,
                                  interpret=True, block_kv=8)
    for b in range(B):
        n, c = num_new[b], lens[b]
        want = numpy_attention(np.asarray(q_block)[b, :n], np.asarray(cache_k)[b].swapaxes(0, 1),
                               np.asarray(cache_v)[b].swapaxes(0, 1), c - n + np.arange(n), 1 / np.sqrt(H))
        np.testing.assert_allclose(out[query_start[b]:query_start[b + 1]], want, rtol=1e-5, atol=1e-5)
    np.testing.assert_array_equal(out[query_start[-1]:], 0.0)


def test_request_ignores_other_requests_and_page_order():
    """A request's rows depend only on its own pages: permuting the page pool (and tables) changes nothing."""
    args = make_inputs((2, 3, 1), (10, 17, 5), T=8, N=4, K=2, H=16, page_size=8)
    q, kp, vp, bt, ctx, qs = args
    perm = np.random.default_rng(3).permutation(kp.shape[0])
    inv = np.argsort(perm)
    bt2 = np.where((bt >= 0) & (bt < kp.shape[0]), inv[np.clip(bt, 0, kp.shape[0] - 1)], bt).astype(np.int32)
    a = ragged_verify_attention(*args)
    b = ragged_verify_attention(q, kp[perm], vp[perm], bt2, ctx, qs)
    np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-6)
    alone = ragged_verify_attention(q[2:5], kp, vp, bt[1:2], ctx[1:2], np.array([0, 3], np.int32))
    np.testing.assert_allclose(alone, a[2:5], rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("backend", ["cpu", "gpu", "tpu"])
def test_poisoned_positions_beyond_the_context_cannot_leak(backend):
    """K/V slots past a request's context (a freed page's old contents: here NaN and huge values) change
    nothing: scores are masked *and* values zeroed, in the kernel (every driver) and in the reference. (The
    serving engine's jnp path has the same test in tests/test_paged.py: this file imports only jax.)"""
    ps = 16  # Triton's dot needs block_kv >= 16
    args = make_inputs((2, 3, 1), (10, 17, 5), T=8, N=4, K=2, H=16, page_size=ps)
    q, kp, vp, bt, ctx, qs = args
    clean = ragged_verify_attention_reference(*args)
    kp2, vp2 = np.array(kp), np.array(vp)
    for r in range(len(ctx)):  # poison every slot at positions >= ctx in the request's own pages
        for pos in range(int(ctx[r]), -(-int(ctx[r]) // ps) * ps):
            page = bt[r, pos // ps]
            kp2[page, :, pos % ps] = 1e30
            vp2[page, :, pos % ps] = np.nan
    unused = sorted(set(range(kp.shape[0])) - set(bt[bt >= 0].tolist()))
    kp2[unused], vp2[unused] = np.nan, np.nan
    poisoned = (q, jnp.asarray(kp2), jnp.asarray(vp2), bt, ctx, qs)
    np.testing.assert_allclose(ragged_verify_attention_reference(*poisoned), clean, rtol=1e-6, atol=1e-6)
    out = ragged_verify_attention(*poisoned, backend=backend, interpret=True)
    assert np.isfinite(np.asarray(out)).all()
    np.testing.assert_allclose(out, clean, rtol=1e-5, atol=1e-5)


def test_bad_inputs_raise():
    q, kp, vp, bt, ctx, qs = make_inputs((2, 3), (10, 17), T=8, N=4, K=2, H=16, page_size=8)
    bad = [
        ("q must be a non-empty", (q[0], kp, vp, bt, ctx, qs)),
        ("q must be float32 or bfloat16", (q.astype(jnp.float16), kp, vp, bt, ctx, qs)),
        ("k_pages must be", (q, kp[0], vp, bt, ctx, qs)),
        ("v_pages must have k_pages' shape", (q, kp, vp[:, :1], bt, ctx, qs)),
        ("head dim of k_pages", (q[..., :8], kp, vp, bt, ctx, qs)),
        ("must be a multiple of KV heads", (q[:, :3], kp, vp, bt, ctx, qs)),
        ("must share a dtype", (q, kp.astype(jnp.bfloat16), vp, bt, ctx, qs)),
        ("block_tables must be int32", (q, kp, vp, bt[0], ctx, qs)),
        ("block_tables must be int32", (q, kp, vp, bt.astype(np.int64), ctx, qs)),
        ("context_lens must be int32", (q, kp, vp, bt, ctx[:1], qs)),
        ("query_start must be int32", (q, kp, vp, bt, ctx, qs[:-1])),
        ("query_start must be int32", (q, kp, vp, bt, ctx, qs.astype(np.float32))),
    ]
    for msg, args in bad:
        with pytest.raises(ValueError, match=msg):
            ragged_verify_attention(*args)
    call = functools.partial(ragged_verify_attention, q, kp, vp, bt, ctx, qs)
    for opts, msg in [
        (dict(backend="metal"), "backend must be one of"),
        (dict(backend="cpu", interpret=False), "only runs in interpret mode"),
        (dict(sm_scale=-1.0), "sm_scale must be a positive"),
        (dict(block_q=0), "block_q must be a positive int"),
        (dict(block_kv=3), "block_kv must divide page_size"),
        (dict(backend="gpu", interpret=True), "block_kv to be a power of two ≥ 16"),  # page_size 8 < Triton's 16
        (dict(backend="tpu", interpret=True, block_kv=4), "block_kv to be a multiple of 8"),
    ]:
        with pytest.raises(ValueError, match=msg):
            call(**opts)


# ---- lowering for accelerators we don't have (not executed) ------------------------------------------------
def _lower(platform: str, device_kind: str, T, R, max_pages, N, K, H, P, page_size, dtype, layers=None,
           **opts) -> str:
    """StableHLO text of ragged_verify_attention lowered for `platform` from this machine (shapes only).

    The abstract device names the chip: Mosaic TPU reads its generation from it, jax ≥ 0.11 reads the GPU's
    compute capability from it for Triton.
    """
    sd = jax.ShapeDtypeStruct
    pool = (P, K, page_size, H) if layers is None else (layers, P, K, page_size, H)
    args = (sd((T, N, H), dtype), sd(pool, dtype), sd(pool, dtype),
            sd((R, max_pages), jnp.int32), sd((R,), jnp.int32), sd((R + 1,), jnp.int32))
    device = jax.sharding.AbstractDevice(device_kind=device_kind, num_cores=1,
                                         platform="gpu" if platform == "cuda" else platform)
    mesh = jax.sharding.AbstractMesh((1,), ("x",), abstract_device=device)
    f = functools.partial(ragged_verify_attention, interpret=False, **opts)
    if layers is not None:  # the layer index traced, as inside a scan over layers
        args = (*args, sd((), jnp.int32))
        f = functools.partial(lambda *a, _f=f: _f(*a[:-1], layer=a[-1]))
    with jax.sharding.use_abstract_mesh(mesh):
        return jax.jit(f).trace(*args).lower(lowering_platforms=(platform,)).as_text()


# (T, R, max_pages, N, K, H, P, page_size, dtype, opts): small paged, SmolLM2-like (G=3, H=64), and the
# deployment-like shape (R=64, 8k context in 16-token pages, N=32, K=8, H=128), plus a contiguous cache.
LOWER_CASES = [
    (16, 3, 4, 4, 2, 16, 12, 16, jnp.float32, {}),
    (32, 4, 8, 9, 3, 64, 32, 16, jnp.bfloat16, {}),
    (512, 64, 512, 32, 8, 128, 64 * 512, 16, jnp.bfloat16, {}),
    (64, 8, 1, 32, 8, 128, 8, 2048, jnp.bfloat16, {}),
]


def lower_id(case) -> str:
    T, R, mp, N, K, H, P, ps, dtype, _ = case
    return f"T{T}-R{R}-N{N}K{K}-H{H}-ps{ps}x{mp}-{jnp.dtype(dtype).name}"


@pytest.mark.parametrize("case", LOWER_CASES, ids=[lower_id(c) for c in LOWER_CASES])
def test_lowers_for_cuda_triton(case):
    *shape, opts = case
    text = _lower("cuda", "NVIDIA H200", *shape, backend="gpu", **opts)
    assert text.count("xla.gpu.triton") == 1


@pytest.mark.parametrize("case", LOWER_CASES, ids=[lower_id(c) for c in LOWER_CASES])
def test_lowers_for_tpu_mosaic(case):
    *shape, opts = case
    text = _lower("tpu", "TPU v5 lite", *shape, backend="tpu", **opts)
    assert text.count("tpu_custom_call") == 1
    # Operands: the grid's dynamic KV extent (the blocks in use, not max_pages'), the 5 scalar-prefetched
    # tables, the q tiles and the K and V pools.
    call = next(line for line in text.splitlines() if "tpu_custom_call(" in line)
    assert len(call.split("tpu_custom_call(")[1].split(")")[0].split(", ")) == 9, call[:200]


@pytest.mark.parametrize("platform,kind,backend,marker", [("cuda", "NVIDIA H200", "gpu", "xla.gpu.triton"),
                                                          ("tpu", "TPU v5 lite", "tpu", "tpu_custom_call")])
def test_stacked_pools_lower_for_accelerators(platform, kind, backend, marker):
    """The stacked-pool form (what the serving scan runs): 36 layers of the deployment-like shape."""
    *shape, opts = LOWER_CASES[2]
    assert _lower(platform, kind, *shape, layers=36, backend=backend, **opts).count(marker) == 1


# ---- real accelerator ------------------------------------------------------------------------------------------
@pytest.mark.gpu
@pytest.mark.skipif(jax.default_backend() != "gpu", reason="needs a GPU")
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_gpu_compiled_matches_reference(dtype):
    rng = np.random.default_rng(0)
    q_lens = tuple(int(x) for x in rng.integers(0, 9, 16))
    ctx_lens = tuple(int(x) + n for x, n in zip(rng.integers(0, 700, 16), q_lens, strict=True))
    args = make_inputs(q_lens, ctx_lens, T=128, N=32, K=8, H=128, page_size=16, dtype=dtype)
    got = ragged_verify_attention(*args)
    want = ragged_verify_attention_reference(*args, max_q_len=8)
    tol = 1e-4 if dtype == jnp.float32 else 2e-2
    np.testing.assert_allclose(np.asarray(got, np.float32), np.asarray(want, np.float32), rtol=tol, atol=tol)
