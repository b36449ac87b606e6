"""Ragged paged attention for the speculative verification pass: a flat bucket of query tokens from R requests.

Vocabulary. A *request* r verifies q_len_r = query_start[r+1] − query_start[r] tokens (its anchor and draft
tokens) in one target forward; all requests' query tokens are packed back to back into one capacity bucket of
T rows (rows ≥ query_start[R] are padding). Each request owns a *paged* KV cache: page ids block_tables[r, :],
context_lens[r] tokens in it, *including* this block (its K/V were written before the call, as vLLM does).
Query i of request r sits at absolute position p = context_lens[r] − q_len_r + i and attends to cache positions
0..p of its own request: causal inside the block, full over the earlier context.

    q [T, N, H], k_pages / v_pages [P, K, page_size, H] (G = N // K query heads share a KV head),
    block_tables int32 [R, max_pages], context_lens int32 [R], query_start int32 [R+1]  →  out [T, N, H]
    out[t, n] = softmax_s(sm_scale · q[t, n] · k[s, n // G]) @ v[s, n // G] over s ≤ p(t); padding rows → 0.

A contiguous cache [B, K, S, H] is this layout as is: P = B pages of page_size = S, block_tables = arange(B)[:, None].

Design. The unit of work is a *q tile*: up to block_q consecutive query tokens of ONE request × one KV head, with
all G query heads of that KV head stacked as M = block_q·G matrix rows (row i = query i // G, head i % G), so
every K/V element read feeds G·block_q rows of the MXU / tensor-core matmuls (GQA reuse). A tile streams its
request's cache in blocks of block_kv tokens (block_kv divides page_size; a page is one or more blocks) with an
online softmax (running max m, sum l, f32 accumulator), flash-decoding style, and stops at the block holding its
last query's position, so causality costs one iota compare per block and nothing beyond it.

Tiles come from a *tile table* built in the jitted wrapper with a few jnp ops on [R] vectors: request r owns
cdiv(q_len_r, block_q) tiles, numbered consecutively; the static tile count n_tiles = (T + min(R, T)·(block_q−1))
// block_q bounds Σ_r cdiv(q_len_r, block_q) for any split of T tokens, so shapes stay static per bucket and
unused tiles are empty programs. The q rows of each tile are *gathered* into a dense [n_tiles, K, M, H] array and
the output gathered back to [T, N, H]. Why not index the flat q in place (as vLLM-TPU's ragged kernel does with
manual DMAs): a tile starts at an arbitrary row query_start[r] + j·block_q, which a BlockSpec cannot express (it
addresses whole blocks), and handling it needs per-backend manual copies. The gather moves T·N·H elements twice
— at T=512, N=32, H=128 bf16 that is 4 MiB against ~1 GiB of KV for R=64 × 4k context — and buys one simple,
aligned kernel that Triton, Mosaic TPU and the interpreter all accept.

Two drivers share one kernel step (`_online_softmax_step`):
- "gpu" (Triton) and "cpu" (interpreter): grid (n_tiles, K); the cache stays whole in HBM and the kernel loops
  (`lax.fori_loop`) over its tile's KV blocks, reading the page id from block_tables and loading
  k_pages[page, kv_head, offset : offset + block_kv] directly — Triton programs cannot carry an accumulator
  across grid steps, so the reduction has to be a loop inside one program.
- "tpu" (Mosaic): grid (n_tiles, K, kv_blocks_in_use) with the tile table and block_tables *scalar-prefetched*
  (`pltpu.PrefetchScalarGridSpec`) into SMEM; the K/V BlockSpec index maps look the page up, so Mosaic's
  pipeline double-buffers page DMAs; the KV axis is "arbitrary" with m / l / acc in VMEM scratch. Its extent is
  a *dynamic* grid bound: the longest tile's KV blocks this call, not what max_pages allows, so a short batch in
  a long-context bucket runs few steps. Steps past a shorter tile's last block re-point to that block (same
  index → no DMA) and skip compute.
Not done (future work): splitting one tile's KV range across programs (flash-decoding's split-K) for few
requests with very long contexts, and several pages per step for pages smaller than Triton's 16-wide dot.

Numerics: scores and softmax in f32 (f32 inputs use HIGHEST-precision dots); bf16 inputs feed the MXU in bf16
and P is rounded to bf16 before P @ V, as flash attention kernels do. `ragged_verify_attention_reference` (same
file, plain jnp) gathers pages, masks and takes an exact softmax; f32 agrees to ~1e-6.
Inputs are not checked against each other at run time (that would need a host sync): page ids are clamped
into [0, P), and a request with context_lens[r] < q_len_r gets undefined rows.
"""

from __future__ import annotations

import functools
import math
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.experimental import pallas as pl

BACKENDS = ("cpu", "gpu", "tpu")
# Finite "minus infinity": a fully masked row then gives exp(0) garbage instead of NaN. Only padding rows can
# be fully masked (position 0 is visible to every real query and sits in the first KV block).
MASK_VALUE = -0.7 * float(np.finfo(np.float32).max)


class _Config(NamedTuple):
    backend: str
    interpret: bool
    block_q: int  # query tokens per tile
    block_kv: int  # cache tokens per inner step; divides page_size
    rows: int  # M: block_q·G padded to the backend's row granularity
    sm_scale: float


# ---- kernel ------------------------------------------------------------------------------------------------
def _online_softmax_step(q, k, v, first_key, pos0, n_keys, carry, *, group: int, sm_scale: float, precision):
    """Folds one KV block into the running (m [M, 1], l [M, 1], acc [M, H] f32) of one q tile.

    q [M, H]; k, v [block_kv, H]; first_key: cache position of k's row 0; pos0: position of the tile's query 0;
    n_keys: positions 0..n_keys−1 are the request's. Value rows at positions ≥ n_keys are zeroed before P @ V:
    a masked score gives p = 0, but 0 · NaN is NaN, so whatever a page held before (another request's values,
    even NaN) must not reach the product.
    """
    m_prev, l_prev, acc_prev = carry
    M, bkv = q.shape[0], k.shape[0]
    own = first_key + lax.broadcasted_iota(jnp.int32, (bkv, 1), 0) < n_keys
    v = jnp.where(own, v, jnp.zeros_like(v))
    s = lax.dot_general(q, k, (((1,), (1,)), ((), ())), preferred_element_type=jnp.float32,
                        precision=precision) * sm_scale  # [M, bkv]
    q_pos = pos0 + lax.div(lax.broadcasted_iota(jnp.int32, (M, bkv), 0), group)
    k_pos = first_key + lax.broadcasted_iota(jnp.int32, (M, bkv), 1)
    s = jnp.where(k_pos <= q_pos, s, MASK_VALUE)  # causal; positions ≥ context_len are > every real q_pos
    m_new = jnp.maximum(m_prev, jnp.max(s, axis=1, keepdims=True))
    alpha = jnp.exp(m_prev - m_new)
    p = jnp.exp(s - m_new)
    l_new = alpha * l_prev + jnp.sum(p, axis=1, keepdims=True)
    pv = jnp.dot(p.astype(v.dtype), v, preferred_element_type=jnp.float32, precision=precision)
    return m_new, l_new, alpha * acc_prev + pv


def _init_carry(M: int, H: int):
    return (jnp.full((M, 1), MASK_VALUE, jnp.float32), jnp.zeros((M, 1), jnp.float32),
            jnp.zeros((M, H), jnp.float32))


def _finish(l, acc, dtype):
    return (acc / jnp.where(l == 0.0, 1.0, l)).astype(dtype)  # l == 0 only for empty tiles


def _loop_kernel(req_ref, pos0_ref, nkeys_ref, layer_ref, bt_ref, q_ref, k_ref, v_ref, o_ref, *, group, sm_scale,
                 block_kv, page_size, precision):
    """GPU / interpreter driver, program (tile t, KV head h): loop over the tile's KV blocks in HBM."""
    t, h = pl.program_id(0), pl.program_id(1)
    r, pos0, n_keys, layer = req_ref[t], pos0_ref[t], nkeys_ref[t], layer_ref[0]
    q = q_ref[...]  # [M, H]
    blocks_per_page = page_size // block_kv

    def body(j, carry):
        # lax.div / lax.rem (j ≥ 0): jnp's floor-division wrappers emit a select Triton's lowering mistypes
        page = bt_ref[r, lax.div(j, blocks_per_page)]
        off = pl.multiple_of(lax.rem(j, blocks_per_page) * block_kv, block_kv)
        k = k_ref[layer, page, h, pl.ds(off, block_kv), :]
        v = v_ref[layer, page, h, pl.ds(off, block_kv), :]
        return _online_softmax_step(q, k, v, j * block_kv, pos0, n_keys, carry, group=group, sm_scale=sm_scale,
                                    precision=precision)

    _, l, acc = lax.fori_loop(0, pl.cdiv(n_keys, block_kv), body, _init_carry(*q.shape))
    o_ref[...] = _finish(l, acc, o_ref.dtype)


def _grid_kernel(req_ref, pos0_ref, nkeys_ref, layer_ref, bt_ref, q_ref, k_ref, v_ref, o_ref, m_scr, l_scr, acc_scr, *,
                 group, sm_scale, block_kv, precision):
    """TPU driver, grid step (tile t, KV head h, KV block j): K/V blocks arrive by BlockSpec (page lookup)."""
    t, j = pl.program_id(0), pl.program_id(2)

    @pl.when(j == 0)
    def _():
        m_scr[...], l_scr[...], acc_scr[...] = _init_carry(*q_ref.shape)

    @pl.when(j * block_kv < nkeys_ref[t])
    def _():
        carry = (m_scr[...], l_scr[...], acc_scr[...])
        m_scr[...], l_scr[...], acc_scr[...] = _online_softmax_step(
            q_ref[...], k_ref[...], v_ref[...], j * block_kv, pos0_ref[t], nkeys_ref[t], carry, group=group,
            sm_scale=sm_scale, precision=precision)

    @pl.when(j == pl.num_programs(2) - 1)
    def _():
        o_ref[...] = _finish(l_scr[...], acc_scr[...], o_ref.dtype)


# ---- wrapper: tile table, gathers, grid ------------------------------------------------------------------------
def _tile_table(context_lens, query_start, T: int, block_q: int):
    """Per tile: request, position of its query 0, keys it needs (0 = empty tile), first q row; plus n_tiles."""
    R = context_lens.shape[0]
    n_tiles = (T + min(R, T) * (block_q - 1)) // block_q  # ≥ Σ_r cdiv(q_len_r, block_q) whenever Σ q_len ≤ T
    q_len = query_start[1:] - query_start[:-1]
    tiles = (q_len + block_q - 1) // block_q
    tile_end = jnp.cumsum(tiles)  # [R] exclusive end of each request's tile range
    t = jnp.arange(n_tiles, dtype=jnp.int32)
    req = jnp.minimum(jnp.searchsorted(tile_end, t, side="right"), R - 1).astype(jnp.int32)
    j = t - (tile_end[req] - tiles[req])  # tile index inside its request
    n_q = jnp.clip(q_len[req] - j * block_q, 0, block_q)  # real queries in the tile
    pos0 = context_lens[req] - q_len[req] + j * block_q
    n_keys = jnp.where(n_q > 0, pos0 + n_q, 0)  # the last query sees positions 0..pos0 + n_q − 1
    row0 = query_start[req] + j * block_q
    return req, pos0.astype(jnp.int32), n_keys.astype(jnp.int32), row0, n_q, n_tiles


@functools.partial(jax.jit, static_argnames=("cfg",))
def _ragged_verify_attention(q, k_pages, v_pages, block_tables, context_lens, query_start, layer, cfg: _Config):
    """k_pages, v_pages: stacked pools [num_layers, P, K, page_size, H] read at `layer` (int32 [1])."""
    T, N, H = q.shape
    _, P, K, page_size, _ = k_pages.shape
    G, bq, bkv, M = N // K, cfg.block_q, cfg.block_kv, cfg.rows
    req, pos0, n_keys, row0, n_q, n_tiles = _tile_table(context_lens, query_start, T, bq)
    block_tables = jnp.clip(block_tables, 0, P - 1)  # entries past a request's pages may hold anything

    # Gather q into tiles [n_tiles, K, M, H]: row i of a tile = query i // G, head i % G of that KV head.
    i = jnp.arange(bq, dtype=jnp.int32)
    rows = jnp.clip(row0[:, None] + i, 0, T - 1)  # [n_tiles, bq]; rows past n_q are never read back
    qt = q[rows].reshape(n_tiles, bq, K, G, H).transpose(0, 2, 1, 3, 4).reshape(n_tiles, K, bq * G, H)
    qt = jnp.pad(qt, ((0, 0), (0, 0), (0, M - bq * G), (0, 0)))

    kernel_kw = dict(group=G, sm_scale=cfg.sm_scale, block_kv=bkv,
                     precision=lax.Precision.HIGHEST if q.dtype == jnp.float32 else None)
    scalars = (req, pos0, n_keys, layer)
    out_shape = jax.ShapeDtypeStruct((n_tiles, K, M, H), q.dtype)
    if cfg.backend == "tpu":
        from jax.experimental.pallas import tpu as pltpu

        blocks_per_page = page_size // bkv
        n_blocks = block_tables.shape[1] * blocks_per_page  # what max_pages allows: the index maps' clamp
        # The grid's KV axis spans the blocks in use (the longest tile's), a run-time bound: a dynamic grid
        # dimension (Mosaic reads it from SMEM), so a bucket sized for max_pages costs no steps past the pages
        # actually held. At least one step, so that every tile's output is written.
        in_use = jnp.clip((jnp.max(n_keys) + bkv - 1) // bkv, 1, n_blocks).astype(jnp.int32)

        def kv_map(t, h, j, req, pos0, n_keys, layer, bt):
            # Past the tile's last block: repeat it (same block index → Mosaic skips the DMA; compute is skipped).
            j = jnp.clip(jnp.minimum(j, (n_keys[t] - 1) // bkv), 0, n_blocks - 1)
            return layer[0], bt[req[t] * block_tables.shape[1] + j // blocks_per_page], h, j % blocks_per_page, 0

        tile_spec = pl.BlockSpec((None, None, M, H), lambda t, h, j, *_: (t, h, 0, 0))
        kv_spec = pl.BlockSpec((None, None, None, bkv, H), kv_map)
        out = pl.pallas_call(
            functools.partial(_grid_kernel, **kernel_kw),
            grid_spec=pltpu.PrefetchScalarGridSpec(
                num_scalar_prefetch=5, grid=(n_tiles, K, in_use), in_specs=[tile_spec, kv_spec, kv_spec],
                out_specs=tile_spec,
                scratch_shapes=[pltpu.VMEM((M, 1), jnp.float32), pltpu.VMEM((M, 1), jnp.float32),
                                pltpu.VMEM((M, H), jnp.float32)]),
            out_shape=out_shape,
            compiler_params=None if cfg.interpret else pltpu.CompilerParams(
                dimension_semantics=("parallel", "parallel", "arbitrary")),
            interpret=cfg.interpret,
            name="ragged_verify_attention",
        )(*scalars, block_tables.reshape(-1), qt, k_pages, v_pages)  # SMEM wants 1-D tables
    else:
        whole = pl.BlockSpec()  # no block shape: the whole array, unblocked
        tile_spec = pl.BlockSpec((None, None, M, H), lambda t, h: (t, h, 0, 0))
        compiler_params = None
        if cfg.backend == "gpu" and not cfg.interpret:
            from jax.experimental.pallas import triton as plgpu

            compiler_params = plgpu.CompilerParams(num_warps=4, num_stages=2)
        out = pl.pallas_call(
            functools.partial(_loop_kernel, page_size=page_size, **kernel_kw),
            grid=(n_tiles, K),
            in_specs=[whole] * 5 + [tile_spec, whole, whole],  # the cache and tables stay whole in HBM
            out_specs=tile_spec,
            out_shape=out_shape,
            compiler_params=compiler_params,
            interpret=cfg.interpret,
            name="ragged_verify_attention",
        )(*scalars, block_tables, qt, k_pages, v_pages)

    # Gather back to [T, N, H]: flat row → (its request's tile, row in tile); padding rows → 0.
    out = out[:, :, : bq * G].reshape(n_tiles, K, bq, G, H).transpose(0, 2, 1, 3, 4).reshape(n_tiles * bq, N, H)
    t_row = jnp.arange(T, dtype=jnp.int32)
    r = jnp.clip(jnp.searchsorted(query_start, t_row, side="right") - 1, 0, query_start.shape[0] - 2)
    tiles = (query_start[1:] - query_start[:-1] + bq - 1) // bq
    first_tile = jnp.cumsum(tiles) - tiles
    offset = t_row - query_start[r]
    src = (first_tile[r] + offset // bq) * bq + offset % bq
    valid = (t_row >= query_start[0]) & (t_row < query_start[-1])
    return jnp.where(valid[:, None, None], out[jnp.clip(src, 0, n_tiles * bq - 1)], 0).astype(q.dtype)


# ---- public API ----------------------------------------------------------------------------------------------
def ragged_verify_attention(q, k_pages, v_pages, block_tables, context_lens, query_start, *,
                            sm_scale: float | None = None, block_q: int | None = None, block_kv: int | None = None,
                            interpret: bool | None = None, backend: str | None = None, layer=None):
    """Attention of a flat bucket of verification queries over their requests' paged caches (module docstring).

    Args:
        q: [T, N, H] query tokens of all requests, back to back; rows ≥ query_start[R] are padding. f32 or bf16.
        k_pages, v_pages: [P, K, page_size, H] in q's dtype; N % K == 0. With `layer`: stacked pools
            [num_layers, P, K, page_size, H] (a decoder's layers scanned over one pool array), read at that layer
            in place — the kernel indexes the layer itself, so no layer's pool is sliced out (a copy) first.
        block_tables: int32 [R, max_pages]; page ids of request r in order (entries past its pages are ignored).
        context_lens: int32 [R]; cached tokens of request r including this block.
        query_start: int32 [R+1]; cumulative query lengths, query_start[0] = 0.
        sm_scale: softmax scale (default 1/sqrt(H)).
        block_q: query tokens per tile (GPU: block_q·G is padded to a power of two ≥ 16; TPU: to a multiple of 8).
        block_kv: cache tokens per inner step; must divide page_size (GPU: power of two ≥ 16; TPU: multiple of 8).
        interpret: run the Pallas interpreter; None means "only on CPU".
        backend: "gpu" (Triton), "tpu" (Mosaic) or "cpu" (interpreter only); None = jax.default_backend().
            Choosing "gpu"/"tpu" with interpret=True runs that flavour's driver on a CPU.
        layer: int32 scalar (may be traced) selecting the layer of stacked pools; None for [P, K, page_size, H].

    Returns:
        [T, N, H] in q's dtype; padding rows are 0.

    Raises:
        ValueError: bad shapes, dtypes, block sizes or backend.
    """
    if layer is None:
        one_k, one_v = k_pages, v_pages
    elif getattr(k_pages, "ndim", None) != 5 or jnp.shape(v_pages) != jnp.shape(k_pages):
        raise ValueError(f"with layer=..., k_pages and v_pages must be stacked [num_layers, P, K, page_size, H] "
                         f"pools of one shape, got {jnp.shape(k_pages)=}, {jnp.shape(v_pages)=}")
    else:  # validated as one layer's pool
        one_k = jax.ShapeDtypeStruct(k_pages.shape[1:], k_pages.dtype)
        one_v = jax.ShapeDtypeStruct(v_pages.shape[1:], v_pages.dtype)
    cfg = _make_config(q, one_k, one_v, block_tables, context_lens, query_start, sm_scale, block_q, block_kv,
                       interpret, backend)
    if layer is None:  # one pool: a stack of one layer (a free reshape), so both cases share one kernel
        k_pages, v_pages, layer = k_pages[None], v_pages[None], 0
    layer = jnp.clip(jnp.asarray(layer, jnp.int32), 0, k_pages.shape[0] - 1).reshape(1)
    return _ragged_verify_attention(q, k_pages, v_pages, block_tables, context_lens, query_start, layer, cfg=cfg)


def _pow2(n: int) -> int:
    return 1 << max(0, math.ceil(math.log2(n)))


def _make_config(q, k_pages, v_pages, block_tables, context_lens, query_start, sm_scale, block_q, block_kv,
                 interpret, backend) -> _Config:
    """Validates inputs and fills per-backend defaults; every failure is a ValueError naming the culprit."""
    if getattr(q, "ndim", None) != 3 or 0 in q.shape:
        raise ValueError(f"q must be a non-empty [T, N, H], got {jnp.shape(q)=}")
    T, N, H = q.shape
    if q.dtype not in (jnp.float32, jnp.bfloat16):
        raise ValueError(f"q must be float32 or bfloat16, got {q.dtype=}")
    if getattr(k_pages, "ndim", None) != 4 or 0 in k_pages.shape:
        raise ValueError(f"k_pages must be a non-empty [P, K, page_size, H], got {jnp.shape(k_pages)=}")
    P, K, page_size, Hk = k_pages.shape
    if jnp.shape(v_pages) != k_pages.shape:
        raise ValueError(f"v_pages must have k_pages' shape {k_pages.shape}, got {jnp.shape(v_pages)=}")
    if Hk != H:
        raise ValueError(f"head dim of k_pages ({Hk}) must equal q's ({H}): {q.shape=}, {k_pages.shape=}")
    if N % K:
        raise ValueError(f"query heads N={N} must be a multiple of KV heads K={K} (GQA)")
    if k_pages.dtype != q.dtype or v_pages.dtype != q.dtype:
        raise ValueError(f"q, k_pages, v_pages must share a dtype, got {q.dtype=}, {k_pages.dtype=}, "
                         f"{v_pages.dtype=}")
    if jnp.ndim(block_tables) != 2 or 0 in jnp.shape(block_tables):
        raise ValueError(f"block_tables must be int32 [R, max_pages], got {jnp.shape(block_tables)=}")
    R = block_tables.shape[0]
    for name, x, shape in (("block_tables", block_tables, block_tables.shape), ("context_lens", context_lens, (R,)),
                           ("query_start", query_start, (R + 1,))):
        dtype = np.dtype(getattr(x, "dtype", None) or jnp.result_type(x))  # an int64 numpy table is an error
        if jnp.shape(x) != shape or dtype != np.int32:
            raise ValueError(f"{name} must be int32 {list(shape)} (R={R} from block_tables), got "
                             f"{dtype.name} {list(jnp.shape(x))}")
    sm_scale = 1.0 / math.sqrt(H) if sm_scale is None else sm_scale
    if not isinstance(sm_scale, (int, float)) or not sm_scale > 0:
        raise ValueError(f"sm_scale must be a positive Python float, got {sm_scale=!r}")

    backend = jax.default_backend() if backend is None else backend
    if backend not in BACKENDS:
        raise ValueError(f"backend must be one of {BACKENDS} or None, got {backend=}")
    interpret = backend == "cpu" if interpret is None else bool(interpret)
    if backend == "cpu" and not interpret:
        raise ValueError("backend='cpu' only runs in interpret mode (Pallas has no CPU compiler)")

    G = N // K
    if block_q is None:  # verification blocks are short; one tile per request covers q_len ≤ 8
        block_q = max(1, min(8, _pow2(T), 16 // G if backend == "gpu" else 8))
    block_kv = math.gcd(page_size, 128 if backend == "gpu" else 512) if block_kv is None else block_kv
    for name, n in (("block_q", block_q), ("block_kv", block_kv)):
        if not isinstance(n, int) or isinstance(n, bool) or n < 1:
            raise ValueError(f"{name} must be a positive int, got {name}={n!r}")
    if page_size % block_kv:
        raise ValueError(f"block_kv must divide page_size, got {block_kv=}, {page_size=}")
    rows = block_q * G
    if backend == "gpu":
        rows = max(16, _pow2(rows))  # Triton: power-of-two tensors, tl.dot needs every dim ≥ 16
        for name, n in (("block_kv", block_kv), ("H", H)):
            if n < 16 or n & (n - 1):
                raise ValueError(f"backend='gpu' needs {name} to be a power of two ≥ 16 (Triton dot), got "
                                 f"{name}={n}; page_size={page_size} must allow it")
    elif backend == "tpu":
        rows = -(-rows // 8) * 8  # Mosaic tiles are 8 sublanes × 128 lanes
        if block_kv % 8:
            raise ValueError(f"backend='tpu' needs block_kv to be a multiple of 8, got {block_kv=}")
    return _Config(backend, interpret, block_q, block_kv, rows, float(sm_scale))


# ---- reference ---------------------------------------------------------------------------------------------
@functools.partial(jax.jit, static_argnames=("sm_scale", "max_q_len"))
def ragged_verify_attention_reference(q, k_pages, v_pages, block_tables, context_lens, query_start, *,
                                      sm_scale: float | None = None, max_q_len: int | None = None):
    """Plain-jnp oracle for `ragged_verify_attention`: gather each request's pages, mask, exact f32 softmax.

    One request at a time (`lax.map`), so memory stays at one request's [max_q_len, N, S] scores. max_q_len
    (static, default T) bounds every q_len_r; a smaller value only makes the reference cheaper.
    """
    T, N, H = q.shape
    P, K, page_size, _ = k_pages.shape
    G, Q = N // K, T if max_q_len is None else max_q_len
    scale = 1.0 / math.sqrt(H) if sm_scale is None else sm_scale
    precision = lax.Precision.HIGHEST if q.dtype == jnp.float32 else None
    q_pad = jnp.pad(q, ((0, Q), (0, 0), (0, 0)))
    i = jnp.arange(Q, dtype=jnp.int32)

    def one_request(args):
        pages, ctx, start, q_len = args
        pages = jnp.clip(pages, 0, P - 1)
        k = k_pages[pages].transpose(1, 0, 2, 3).reshape(K, -1, H)  # [K, S, H], S = max_pages · page_size
        v = v_pages[pages].transpose(1, 0, 2, 3).reshape(K, -1, H)
        qr = lax.dynamic_slice_in_dim(q_pad, start, Q).reshape(Q, K, G, H)
        s = jnp.einsum("QKGH,KSH->QKGS", qr, k, preferred_element_type=jnp.float32, precision=precision) * scale
        pos = ctx - q_len + i  # absolute position of each query
        visible = jnp.arange(k.shape[1])[None, :] <= pos[:, None]  # [Q, S]
        s = jnp.where(visible[:, None, None, :], s, -jnp.inf)
        p = jax.nn.softmax(s, axis=-1)
        v = jnp.where((jnp.arange(k.shape[1]) < ctx)[None, :, None], v, 0)  # never 0 · (another request's NaN)
        o = jnp.einsum("QKGS,KSH->QKGH", p, v.astype(jnp.float32), precision=precision)
        return o.reshape(Q, N, H)

    q_len = query_start[1:] - query_start[:-1]
    o = lax.map(one_request, (block_tables, context_lens, query_start[:-1], q_len))  # [R, Q, N, H]
    dest = jnp.where(i[None, :] < q_len[:, None], query_start[:-1, None] + i, T)  # T = dropped
    out = jnp.zeros((T, N, H), jnp.float32).at[dest.reshape(-1)].set(o.reshape(-1, N, H), mode="drop")
    return out.astype(q.dtype)
