"""Fused Markov-head block sampler (DSpark §3.1, eq. 4–5): base logits + low-rank bias → draft tokens.

For B requests, draft block L, vocab V and Markov rank R, left to right for k = 0..L−1:
    e_k = W1[x_{k−1}]  (x_{−1} = anchor)          logits_k = U_k + e_k @ W2           (eq. 5, eq. 4)
    x_k = argmax(logits_k)                        if T == 0 (greedy; first index on ties)
    x_k ~ softmax(logits_k / T)                   otherwise, as argmax(logits_k / T + G_k), G_k Gumbel(0, 1)
Inputs:  U [B, L, V] f32|bf16, W1 [V, R], W2 [R, V] (same dtype, f32|bf16), anchor int32 [B],
         temperature f32 [B] (0 = greedy), seeds uint32 [B, 2] (noise: `gumbel_hash.py`).
Outputs (`MarkovSample`): tokens int32 [B, L]; logq f32 [B, L] = log q_k(x_k) (0.0 for greedy rows: q is
         one-hot); lse f32 [B, L] = logsumexp(logits_k / T) (T read as 1 for greedy rows), so q_k(v) =
         exp(logits_k(v) / T − lse) can be recomputed for the one position verification rejects;
         e [B, L, R] in W1's dtype (the confidence head reads W1[x_{k−1}], eq. 7).
Not fused: top-k / top-p filtering. They need a sort or a threshold search over all of V per position; callers
with filtered rows must take the reference path (`dspark_jax.drafter.draft_block`).

Design. The corrected logits [B, V] never reach HBM: each program computes them block_v columns at a time
(U chunk + e @ W2 chunk on the MXU / tensor cores, f32 accumulation) and folds each chunk into per-row running
statistics in the same pass: an online max and sum-exp (for lse) and a running Gumbel-max (score, index,
scaled logit). The noise is hashed from (seed, k, v) in registers, so nothing of size V is read besides U and W2.

The sequential dependency over k is carried *between* kernel launches, not inside one kernel: one pallas_call
per position (L is static and small; the Python loop unrolls), each with grid (S splits of V, row blocks).
x_k needs a reduction over all of V before x_{k+1} can start. Inside a single kernel that reduction forces
one program per row block to stream all of W2 (R×V: 78 MB in bf16 at V=151936, R=256) on its own — at B ≤ 16
one program on one of a GPU's 132 SMs. Splitting V across programs needs a grid-wide barrier per position,
which Pallas cannot express portably; a kernel boundary is exactly that barrier. Between launches only the
per-split partial statistics [S, B] and the tokens [B] travel; `_combine` (a few jnp ops on [S, B]) merges the
splits: lse by log-sum-exp of the partial (max, sum), x_k as the best partial score (lowest split on ties,
so the overall first-index tie rule holds). Splits are the outer grid axis so consecutive programs share one
W2 tile: Mosaic TPU skips a DMA whose block index did not change; on a GPU they can hit in L2. The cost of
this choice: L launches and L tiny combines per block, beside the L reads of W2 that any exact schedule needs.

Mosaic TPU needs the last two block dims (8, 128)-aligned or whole, which U_k's [bb, 1 of L, split_v] block
is not, so the TPU path transposes U to [L, B, V] once per call (a producer could emit that layout instead).
Ragged shapes cost no copies of U or W2: B need not divide by block_b, V need not divide by block_v or split_v.
On GPU (Triton) the loads are masked (`plgpu.load`), on TPU and in the interpreter the edge blocks are padded
by Pallas and columns ≥ V are masked to −inf before any reduction.

Float semantics match `markov_sample_reference` (same file): f32 weights use HIGHEST precision in both, the
division by T is the same op, and the noise is the same hash, so tokens agree exactly (up to a 1-ulp near-tie
in an f32 dot, which random data does not produce); logq / lse agree to ~1e-6.
"""

from __future__ import annotations

import functools
import math
from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from pallas_kernels.gumbel_hash import gumbel, row_keys

BACKENDS = ("cpu", "gpu", "tpu")


class MarkovSample(NamedTuple):
    """Result of `markov_sample` / `markov_sample_reference` (shapes in the module docstring)."""

    tokens: jax.Array  # int32 [B, L]
    logq: jax.Array  # f32 [B, L]
    lse: jax.Array  # f32 [B, L]
    e: jax.Array  # W1.dtype [B, L, R]


# ---- kernel ------------------------------------------------------------------------------------------------
def _markov_step_kernel(e_ref, t_ref, key_ref, u_ref, w2_ref, m_ref, s_ref, best_ref, idx_ref, val_ref, *,
                        vocab: int, batch: int, block_v: int, chunks_per_split: int, masked_loads: bool,
                        precision):
    """One draft position, one (V split j, row block i): fold the split's chunks into per-row statistics.

    Refs: e [bb, R]; temperature [bb, 1] f32; hash key [bb, 1] uint32; U_k [bb, split_v]; W2 [R, split_v];
    outputs [bb, 1] each: running max m, sum-exp s (both of logits / T), best score, its global index (int32)
    and its scaled logit.
    """
    j, i = pl.program_id(0), pl.program_id(1)
    bb, R = e_ref.shape
    e = e_ref[...]
    t = t_ref[...]
    greedy = t <= 0.0
    t = jnp.where(greedy, 1.0, t)  # greedy rows: argmax of the raw logits, no noise
    key = key_ref[...]
    lane = lax.broadcasted_iota(jnp.int32, (1, block_v), 1)
    first = j * chunks_per_split
    count = jnp.minimum(chunks_per_split, pl.cdiv(vocab, block_v) - first)

    def body(c, carry):
        m, s, best, idx, val = carry
        start = (first + c) * block_v  # global column of lane 0
        cols = start + lane  # [1, bv]
        valid = cols < vocab
        off = pl.multiple_of(c * block_v, block_v)  # column inside this program's split
        if masked_loads:  # Triton: rows ≥ B and columns ≥ V are outside the buffers, so never touch them
            from jax.experimental.pallas import triton as plgpu

            rows = i * bb + lax.broadcasted_iota(jnp.int32, (bb, 1), 0)
            u = plgpu.load(u_ref.at[:, pl.ds(off, block_v)], mask=(rows < batch) & valid, other=0.0)
            w = plgpu.load(w2_ref.at[:, pl.ds(off, block_v)],
                           mask=jnp.broadcast_to(valid, (R, block_v)), other=0.0)
        else:  # Mosaic TPU / interpreter: edge blocks are padded buffers; the padding is masked below
            u = u_ref[:, pl.ds(off, block_v)]
            w = w2_ref[:, pl.ds(off, block_v)]
        logits = u.astype(jnp.float32) + jnp.dot(e, w, preferred_element_type=jnp.float32, precision=precision)
        scaled = jnp.where(valid, logits / t, -jnp.inf)  # [bb, bv]
        score = scaled + jnp.where(greedy, 0.0, gumbel(key, cols))

        # Online log-sum-exp; the shift guards a chunk that is entirely −inf (masked vocab) from inf − inf.
        m_new = jnp.maximum(m, jnp.max(scaled, axis=1, keepdims=True))
        shift = jnp.where(m_new == -jnp.inf, 0.0, m_new)
        s = s * jnp.exp(m - shift) + jnp.sum(jnp.exp(scaled - shift), axis=1, keepdims=True)

        # Running Gumbel-max. First lane of the chunk maximum, and strict '>' across chunks: the first index
        # wins ties overall, as jnp.argmax does (it matters for greedy rows).
        c_best = jnp.max(score, axis=1, keepdims=True)
        c_lane = jnp.min(jnp.where(score == c_best, lane, block_v), axis=1, keepdims=True)
        c_val = jnp.sum(jnp.where(lane == c_lane, scaled, 0.0), axis=1, keepdims=True)
        better = c_best > best
        return (m_new, s, jnp.where(better, c_best, best), jnp.where(better, start + c_lane, idx),
                jnp.where(better, c_val, val))

    neg_inf = jnp.full((bb, 1), -jnp.inf, jnp.float32)
    zeros = jnp.zeros((bb, 1), jnp.float32)
    init = (neg_inf, zeros, neg_inf, jnp.zeros((bb, 1), jnp.int32), zeros)
    m, s, best, idx, val = lax.fori_loop(0, count, body, init)
    m_ref[...], s_ref[...], best_ref[...], idx_ref[...], val_ref[...] = m, s, best, idx, val


# ---- wrapper: grid and BlockSpecs for one position -----------------------------------------------------------
def _step_call(k: int, e, t_col, key_col, U, w2, *, cfg: _Config):
    """Partial statistics for position k: 5 arrays [S, B_pad, 1] (max, sum-exp, score, index, scaled logit)."""
    R, V = w2.shape
    bb, bv, sv = cfg.block_b, cfg.block_v, cfg.split_v
    if cfg.backend == "tpu":  # U arrives as [L, B, V]: Mosaic cannot squeeze L, U's second-minor dim
        B = U.shape[1]
        u_spec = pl.BlockSpec((None, bb, sv), lambda j, i: (k, i, j))
    else:
        B = U.shape[0]
        u_spec = pl.BlockSpec((bb, None, sv), lambda j, i: (i, k, j))
    n_splits, n_blocks = pl.cdiv(V, sv), e.shape[0] // bb
    kernel = functools.partial(
        _markov_step_kernel, vocab=V, batch=B, block_v=bv, chunks_per_split=sv // bv,
        masked_loads=cfg.backend == "gpu", precision=_precision(w2.dtype))
    row = lambda j, i: (i, 0)  # noqa: E731
    stat = pl.BlockSpec((None, bb, 1), lambda j, i: (j, i, 0))
    out_shape = [jax.ShapeDtypeStruct((n_splits, e.shape[0], 1), jnp.float32)] * 5
    out_shape[3] = jax.ShapeDtypeStruct((n_splits, e.shape[0], 1), jnp.int32)
    return pl.pallas_call(
        kernel,
        grid=(n_splits, n_blocks),
        in_specs=[
            pl.BlockSpec((bb, R), row),  # e_k = W1[x_{k-1}]
            pl.BlockSpec((bb, 1), row),  # temperature
            pl.BlockSpec((bb, 1), row),  # hash key of (seed, k)
            u_spec,  # U[:, k] — k is static per launch
            pl.BlockSpec((R, sv), lambda j, i: (0, j)),  # W2 split, shared by all row blocks
        ],
        out_specs=[stat] * 5,
        out_shape=out_shape,
        compiler_params=_compiler_params(cfg),
        interpret=cfg.interpret,
        name=f"markov_sample_k{k}",
    )(e, t_col, key_col, U, w2)


def _combine(partials, greedy):
    """Merge the S splits: [S, B, 1] statistics → (tokens int32 [B], logq f32 [B], lse f32 [B])."""
    m, s, best, idx, val = (x[..., 0] for x in partials)
    top = jnp.max(m, axis=0)
    shift = jnp.where(top == -jnp.inf, 0.0, top)
    lse = shift + jnp.log(jnp.sum(s * jnp.exp(m - shift), axis=0))
    j = jnp.argmax(best, axis=0)[None]  # first split on ties = lowest vocab index
    tokens = jnp.take_along_axis(idx, j, axis=0)[0]
    logq = jnp.where(greedy, 0.0, jnp.take_along_axis(val, j, axis=0)[0] - lse)
    return tokens, logq, lse


class _Config(NamedTuple):
    backend: str
    interpret: bool
    block_b: int
    block_v: int
    split_v: int


def _precision(dtype):
    return lax.Precision.HIGHEST if dtype == jnp.float32 else None


def _compiler_params(cfg: _Config):
    if cfg.interpret or cfg.backend == "cpu":
        return None
    if cfg.backend == "gpu":  # Triton: the Mosaic GPU default wants warpgroup-level code this kernel is not
        from jax.experimental.pallas import triton as plgpu

        return plgpu.CompilerParams(num_warps=4, num_stages=3)
    from jax.experimental.pallas import tpu as pltpu

    return pltpu.CompilerParams(dimension_semantics=("parallel", "parallel"))


@functools.partial(jax.jit, static_argnames=("cfg",))
def _markov_sample(U, w1, w2, anchor, temperature, seeds, cfg: _Config) -> MarkovSample:
    B, L, _ = U.shape
    pad = -B % cfg.block_b  # the small per-row inputs are padded; U is not (edge blocks, see module doc)
    anchor = jnp.pad(anchor, (0, pad))
    temperature = jnp.pad(temperature, (0, pad))
    seeds = jnp.pad(seeds, ((0, pad), (0, 0)))
    greedy = temperature <= 0.0
    # Mosaic TPU wants the last two block dims (8, 128)-aligned or whole, and U_k's block [bb, 1, split_v]
    # has 1 of L in the second-minor slot, so the TPU path pays one transpose of U to [L, B, V].
    U = U.swapaxes(0, 1) if cfg.backend == "tpu" else U
    prev, out = anchor, []
    for k in range(L):  # sequential over positions; each launch is parallel over (V splits, row blocks)
        e = jnp.take(w1, prev, axis=0, mode="clip")  # [B_pad, R]
        partials = _step_call(k, e, temperature[:, None], row_keys(seeds, k)[:, None], U, w2, cfg=cfg)
        prev, logq, lse = _combine(partials, greedy)
        out.append((prev, logq, lse, e))
    tokens, logq, lse, e = (jnp.stack(x, axis=1)[:B] for x in zip(*out, strict=True))
    return MarkovSample(tokens, logq, lse, e)


# ---- public API ----------------------------------------------------------------------------------------------
def markov_sample(U, w1, w2, anchor, temperature, seeds, *, block_v: int | None = None, split_v: int | None = None,
                  block_b: int | None = None, interpret: bool | None = None, backend: str | None = None,
                  top_k=None, top_p=None) -> MarkovSample:
    """Samples one Markov-head draft block per row with the fused kernel (semantics in the module docstring).

    Args:
        U: base logits [B, L, V], f32 or bf16.
        w1, w2: Markov factors [V, R] and [R, V], one dtype (f32 or bf16).
        anchor: int32 [B], x_{−1}.
        temperature: f32 [B]; 0 is greedy.
        seeds: uint32 [B, 2] per-row noise seeds (see `gumbel_hash`); the same seeds give the same tokens
            here and in `markov_sample_reference`.
        block_v: vocab columns per inner step (GPU: power of two ≥ 16; TPU: multiple of 128).
        split_v: vocab columns per program, a multiple of block_v (more splits = more parallel programs).
        block_b: rows per program (GPU: power of two ≥ 16, the tensor-core minimum; TPU: multiple of 8).
        interpret: run the Pallas interpreter; None means "only on CPU".
        backend: "gpu" (Triton), "tpu" (Mosaic) or "cpu" (interpreter only); None = jax.default_backend().
            Choosing "gpu"/"tpu" with interpret=True checks that flavour's shape rules on a CPU.
        top_k, top_p: not supported; anything but None raises (filtered rows take the reference path).

    Returns:
        MarkovSample(tokens, logq, lse, e).

    Raises:
        NotImplementedError: top_k / top_p given.
        ValueError: bad shapes, dtypes, block sizes or backend.
    """
    if top_k is not None or top_p is not None:
        raise NotImplementedError(
            "markov_sample fuses temperature sampling only; top-k/top-p need a sort over V per position and "
            "take the reference path (dspark_jax.drafter.draft_block with dspark_jax.sampling.filter_probs)")
    cfg = _make_config(U, w1, w2, anchor, temperature, seeds, block_v, split_v, block_b, interpret, backend)
    return _markov_sample(U, w1, w2, anchor, temperature, seeds, cfg=cfg)


def _make_config(U, w1, w2, anchor, temperature, seeds, block_v, split_v, block_b, interpret, backend) -> _Config:
    """Validates inputs and fills per-backend defaults; every failure is a ValueError naming the culprit."""
    if getattr(U, "ndim", None) != 3:
        raise ValueError(f"U must be [B, L, V], got {jnp.shape(U)=}")
    B, L, V = U.shape
    if B < 1 or L < 1 or V < 1:
        raise ValueError(f"U must be non-empty, got {U.shape=}")
    if U.dtype not in (jnp.float32, jnp.bfloat16):
        raise ValueError(f"U must be float32 or bfloat16, got {U.dtype=}")
    if jnp.ndim(w1) != 2 or w1.shape[0] != V:
        raise ValueError(f"w1 must be [V, R] with V={V}, got {jnp.shape(w1)=}")
    R = w1.shape[1]
    if jnp.shape(w2) != (R, V):
        raise ValueError(f"w2 must be [R, V]={(R, V)}, got {jnp.shape(w2)=}")
    if w1.dtype != w2.dtype or w1.dtype not in (jnp.float32, jnp.bfloat16):
        raise ValueError(f"w1 and w2 must share a float32/bfloat16 dtype, got {w1.dtype=}, {w2.dtype=}")
    for name, x, shape, dtype in (("anchor", anchor, (B,), jnp.int32), ("temperature", temperature, (B,),
                                  jnp.float32), ("seeds", seeds, (B, 2), jnp.uint32)):
        if jnp.shape(x) != shape or jnp.result_type(x) != dtype:
            raise ValueError(f"{name} must be {jnp.dtype(dtype).name} {list(shape)}, got "
                             f"{jnp.result_type(x).name} {list(jnp.shape(x))}")

    backend = jax.default_backend() if backend is None else backend
    if backend not in BACKENDS:
        raise ValueError(f"backend must be one of {BACKENDS} or None, got {backend=}")
    interpret = backend == "cpu" if interpret is None else bool(interpret)
    if backend == "cpu" and not interpret:
        raise ValueError("backend='cpu' only runs in interpret mode (Pallas has no CPU compiler)")

    pow2 = lambda n: 1 << max(0, math.ceil(math.log2(n)))  # noqa: E731
    if backend == "gpu":  # untuned starting points; scripts/bench_pallas_markov.py measures alternatives
        # block_b 64 with R = 256 asks for 232 KiB of shared memory, over an H200's 227 KiB
        default_b, default_v = min(64 if R <= 128 else 32, max(16, pow2(B))), min(128, max(16, pow2(V)))
    elif backend == "tpu":
        default_b, default_v = min(64, -(-B // 8) * 8), min(512, -(-V // 128) * 128)
    else:  # interpreter: one program per position (a single split) is the fastest schedule
        default_b, default_v = B, min(V, 512)
    block_b = default_b if block_b is None else block_b
    block_v = default_v if block_v is None else block_v
    if split_v is None and isinstance(block_v, int) and block_v > 0:
        split_v = block_v * (-(-V // block_v) if backend == "cpu" else 8)
    for name, n in (("block_b", block_b), ("block_v", block_v), ("split_v", split_v)):
        if not isinstance(n, int) or n < 1:
            raise ValueError(f"{name} must be a positive int, got {name}={n!r}")
    if split_v % block_v:
        raise ValueError(f"split_v must be a multiple of block_v, got {split_v=}, {block_v=}")
    if backend == "gpu":
        for name, n in (("block_b", block_b), ("block_v", block_v), ("R", R)):
            if n < 16 or n & (n - 1):  # Triton: power-of-two tensors, and tl.dot needs every dim ≥ 16
                raise ValueError(f"backend='gpu' needs {name} to be a power of two ≥ 16, got {name}={n}")
    elif backend == "tpu":
        for name, n, q in (("block_b", block_b, 8), ("block_v", block_v, 128), ("R", R, 8)):
            if n % q:  # Mosaic tiles are 8 sublanes × 128 lanes
                raise ValueError(f"backend='tpu' needs {name} to be a multiple of {q}, got {name}={n}")
    return _Config(backend, interpret, block_b, block_v, split_v)


# ---- reference ---------------------------------------------------------------------------------------------
@jax.jit
def markov_sample_reference(U, w1, w2, anchor, temperature, seeds) -> MarkovSample:
    """Plain-jnp oracle for `markov_sample`: same arguments (no block sizes), same outputs, same tokens.

    Materialises logits_k [B, V] per position with `lax.scan`; this is the semantics the kernel fuses.
    """
    temperature = jnp.asarray(temperature, jnp.float32)
    greedy = temperature <= 0.0
    t = jnp.where(greedy, 1.0, temperature)[:, None]
    cols = jnp.arange(U.shape[-1], dtype=jnp.int32)[None, :]

    def step(prev, inputs):
        k, U_k = inputs
        e = jnp.take(w1, prev, axis=0, mode="clip")  # [B, R]
        bias = jnp.einsum("BR,RV->BV", e, w2, preferred_element_type=jnp.float32, precision=_precision(w2.dtype))
        scaled = (U_k.astype(jnp.float32) + bias) / t
        lse = jax.nn.logsumexp(scaled, axis=-1)
        noise = gumbel(row_keys(seeds, k)[:, None], cols)
        x = jnp.argmax(scaled + jnp.where(greedy[:, None], 0.0, noise), axis=-1).astype(jnp.int32)
        logq = jnp.where(greedy, 0.0, jnp.take_along_axis(scaled, x[:, None], axis=-1)[:, 0] - lse)
        return x, (x, logq, lse, e)

    ks = jnp.arange(U.shape[1], dtype=jnp.int32)
    _, (tokens, logq, lse, e) = lax.scan(step, anchor, (ks, U.swapaxes(0, 1)))
    return MarkovSample(tokens.T, logq.T, lse.T, e.swapaxes(0, 1))
