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
- "tpu" (Mosaic): grid (n_tiles, K, max_kv_blocks) with the tile table and block_tables *scalar-prefetched*
  (`pltpu.PrefetchScalarGridSpec`) into SMEM; the K/V BlockSpec index maps look the page up, so Mosaic's
  pipeline double-buffers page DMAs; the KV axis is "arbitrary" with m / l / acc in VMEM scratch. Steps past a
  tile's last block re-point to that block (same index → no DMA) and skip compute.
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
def _online_softmax_step(q, k, v, first_key, pos0, carry, *, group: int, sm_scale: float, precision):
    """Folds one KV block into the running (m [M, 1], l [M, 1], acc [M, H] f32) of one q tile.

    q [M, H]; k, v [block_kv, H]; first_key: cache position of k's row 0; pos0: position of the tile's query 0.
    """
    m_prev, l_prev, acc_prev = carry
    M, bkv = q.shape[0], k.shape[0]
    s = lax.dot_general(q, k, (((1,), (1,)), ((), ())), preferred_element_type=jnp.float32,
                        precision=precision) * sm_scale  # [M, bkv]
    q_pos = pos0 + lax.broadcasted_iota(jnp.int32, (M, bkv), 0) // group
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


def _loop_kernel(req_ref, pos0_ref, nkeys_ref, bt_ref, q_ref, k_ref, v_ref, o_ref, *, group, sm_scale,
                 block_kv, page_size, precision):
    """GPU / interpreter driver, program (tile t, KV head h): loop over the tile's KV blocks in HBM."""
    t, h = pl.program_id(0), pl.program_id(1)
    r, pos0, n_keys = req_ref[t], pos0_ref[t], nkeys_ref[t]
    q = q_ref[...]  # [M, H]
    blocks_per_page = page_size // block_kv

    def body(j, carry):
        page = bt_ref[r, j // blocks_per_page]
        off = pl.multiple_of((j % blocks_per_page) * block_kv, block_kv)
        k = k_ref[page, h, pl.ds(off, block_kv), :]
        v = v_ref[page, h, pl.ds(off, block_kv), :]
        return _online_softmax_step(q, k, v, j * block_kv, pos0, carry, group=group, sm_scale=sm_scale,
                                    precision=precision)

    _, l, acc = lax.fori_loop(0, pl.cdiv(n_keys, block_kv), body, _init_carry(*q.shape))
    o_ref[...] = _finish(l, acc, o_ref.dtype)


def _grid_kernel(req_ref, pos0_ref, nkeys_ref, bt_ref, q_ref, k_ref, v_ref, o_ref, m_scr, l_scr, acc_scr, *,
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
            q_ref[...], k_ref[...], v_ref[...], j * block_kv, pos0_ref[t], carry, group=group,
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
def _ragged_verify_attention(q, k_pages, v_pages, block_tables, context_lens, query_start, cfg: _Config):
    T, N, H = q.shape
    P, K, page_size, _ = k_pages.shape
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
    scalars = (req, pos0, n_keys)
    out_shape = jax.ShapeDtypeStruct((n_tiles, K, M, H), q.dtype)
    if cfg.backend == "tpu":
        from jax.experimental.pallas import tpu as pltpu

        blocks_per_page = page_size // bkv
        n_blocks = block_tables.shape[1] * blocks_per_page

        def kv_map(t, h, j, req, pos0, n_keys, bt):
            # Past the tile's last block: repeat it (same block index → Mosaic skips the DMA; compute is skipped).
            j = jnp.clip(jnp.minimum(j, (n_keys[t] - 1) // bkv), 0, n_blocks - 1)
            return bt[req[t] * block_tables.shape[1] + j // blocks_per_page], h, j % blocks_per_page, 0

        tile_spec = pl.BlockSpec((None, None, M, H), lambda t, h, j, *_: (t, h, 0, 0))
        kv_spec = pl.BlockSpec((None, None, bkv, H), kv_map)
        out = pl.pallas_call(
            functools.partial(_grid_kernel, **kernel_kw),
            grid_spec=pltpu.PrefetchScalarGridSpec(
                num_scalar_prefetch=4, grid=(n_tiles, K, n_blocks), in_specs=[tile_spec, kv_spec, kv_spec],
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
        whole = pl.BlockSpec(memory_space=pl.ANY) if False else None  # noqa: F841  (kept whole: no BlockSpec)
        tile_spec = pl.BlockSpec((None, None, M, H), lambda t, h: (t, h, 0, 0))
        compiler_params = None
        if cfg.backend == "gpu" and not cfg.interpret:
            from jax.experimental.pallas import triton as plgpu

            compiler_params = plgpu.CompilerParams(num_warps=4, num_stages=2)
        out = pl.pallas_call(
            functools.partial(_loop_kernel, page_size=page_size, **kernel_kw),
            grid=(n_tiles, K),
            in_specs=[None, None, None, None, tile_spec, None, None],  # None: the whole array, unblocked
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
