"""Benchmark: ragged paged verification attention (pallas_kernels.ragged_verify_attention) against its reference.

    python -m scripts.bench_pallas_attention [--requests 16 64] [--context 2048 8192] [--max-q 8] [--heads 32]
        [--kv-heads 8] [--head-dim 128] [--page-size 16] [--dtype bfloat16] [--block-q 8] [--block-kv 16]
        [--repeats 20] [--tiny]

On a GPU or TPU it compiles the kernel for real. For each (R requests, mean context C) it draws per-request
verification lengths q_len ∈ 1..max_q and context lengths ∈ [C/2, 3C/2] (pages shuffled in the pool), packs the
queries into a bucket of T = R·max_q rows, and reports per call: median time of kernel and reference, the max
abs difference, and the achieved bandwidth

    compulsory bytes / time,   compulsory bytes = K and V of every request's context (Σ_r ctx_r · K · H · 2)
                                                  + q and out (2 · T · N · H), in the dtype,

beside the device's measured copy bandwidth (jitted `x + 1` over 1 GiB: read + write). Verification attention
is memory-bound (≈ 2·G·q_len flops per KV byte), so that bandwidth is the ceiling. The reference gathers each
request's pages into a dense [K, S, H] copy first (`lax.map` over requests, max_q_len = max_q).

On a CPU (or with --tiny) Pallas only interprets the kernel, so the numbers say nothing about a kernel's speed:
it runs a tiny shape (R ∈ {2, 4}, context 64, N=4, K=2, H=64) as a smoke test and says so in the table title.
"""

from __future__ import annotations

import argparse
import os
import sys

import jax
import jax.numpy as jnp
import numpy as np

if __package__ in (None, ""):  # run as a file: make the repo root importable (python -m needs no help)
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from pallas_kernels.ragged_verify_attention import (  # noqa: E402
    ragged_verify_attention,
    ragged_verify_attention_reference,
)
from pallas_kernels.timing import bench_setup, mode_line, timed  # noqa: E402


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--requests", type=int, nargs="+", default=None,
                   help="numbers of requests R (default: 16 64 on an accelerator, 2 4 when tiny)")
    p.add_argument("--context", type=int, nargs="+", default=None,
                   help="mean context lengths C (default: 2048 8192, or 64 when tiny)")
    p.add_argument("--max-q", type=int, default=8, help="largest verification length q_len (default: %(default)s)")
    p.add_argument("--heads", type=int, default=None, help="query heads N (default: 32, or 4 when tiny)")
    p.add_argument("--kv-heads", type=int, default=None, help="KV heads K (default: 8, or 2 when tiny)")
    p.add_argument("--head-dim", type=int, default=None, help="head dim H (default: 128, or 64 when tiny)")
    p.add_argument("--page-size", type=int, default=16, help="tokens per cache page (default: %(default)s)")
    p.add_argument("--dtype", choices=["bfloat16", "float32"], default="bfloat16",
                   help="dtype of q and the cache (default: %(default)s)")
    p.add_argument("--block-q", type=int, default=None, help="kernel query tokens per tile (default: kernel's)")
    p.add_argument("--block-kv", type=int, nargs="+", default=[None],
                   help="kernel cache tokens per inner step; several values are swept (default: kernel's)")
    p.add_argument("--repeats", type=int, default=20, help="timed calls per measurement (default: %(default)s)")
    p.add_argument("--tiny", action="store_true", help="the CPU smoke-test shape even on an accelerator")
    return p.parse_args(argv)


def make_inputs(R, C, max_q, N, K, H, page_size, dtype, seed=0):
    """Ragged bucket of T = R·max_q rows over a shuffled page pool; returns (args, Σ context, T)."""
    rng = np.random.default_rng(seed)
    q_lens = rng.integers(1, max_q + 1, R)
    ctx = np.maximum(rng.integers(C // 2, C + C // 2 + 1, R), q_lens).astype(np.int32)
    pages = -(-ctx // page_size)
    max_pages, P = int(pages.max()), int(pages.sum())
    perm = rng.permutation(P).astype(np.int32)
    block_tables = np.zeros((R, max_pages), np.int32)
    for r, start in enumerate(np.cumsum(pages) - pages):
        block_tables[r, : pages[r]] = perm[start:start + pages[r]]
    T = R * max_q
    query_start = np.concatenate([[0], np.cumsum(q_lens)]).astype(np.int32)
    k = jax.random.split(jax.random.key(seed), 3)
    q = jax.random.normal(k[0], (T, N, H), dtype)
    k_pages = jax.random.normal(k[1], (P, K, page_size, H), dtype)
    v_pages = jax.random.normal(k[2], (P, K, page_size, H), dtype)
    args = (q, k_pages, v_pages, *(jnp.asarray(x) for x in (block_tables, ctx, query_start)))
    return args, int(ctx.sum()), T


def main(argv=None) -> None:
    args = parse_args(argv)
    platform, tiny, interpret, repeats, bandwidth = bench_setup(args.tiny, args.repeats)
    requests = args.requests or ([2, 4] if tiny else [16, 64])
    contexts = args.context or ([64] if tiny else [2048, 8192])
    N = args.heads or (4 if tiny else 32)
    K = args.kv_heads or (2 if tiny else 8)
    H = args.head_dim or (64 if tiny else 128)
    dtype = jnp.dtype(args.dtype)

    mode = mode_line(interpret)
    print(f"ragged_verify_attention on {jax.devices()[0].device_kind} ({platform}), {mode}")
    print(f"N={N} K={K} H={H} page_size={args.page_size} q_len 1..{args.max_q} {dtype.name}; "
          f"measured copy bandwidth {bandwidth / 1e9:.1f} GB/s")
    header = (f"{'R':>4} {'ctx':>6} {'block_kv':>8} {'MiB':>8} {'kernel ms':>10} {'ref ms':>8} {'speedup':>8} "
              f"{'kernel GB/s':>12} {'% of copy':>9} {'max err':>8}")
    print(header)
    print("-" * len(header))
    ref_fn = jax.jit(lambda *a: ragged_verify_attention_reference(*a, max_q_len=args.max_q))
    for R in requests:
        for C in contexts:
            inputs, ctx_total, T = make_inputs(R, C, args.max_q, N, K, H, args.page_size, dtype)
            nbytes = dtype.itemsize * (2 * ctx_total * K * H + 2 * T * N * H)
            want = ref_fn(*inputs)
            t_ref = timed(ref_fn, *inputs, repeats=repeats)
            for block_kv in args.block_kv:
                fn = jax.jit(lambda *a, b=block_kv: ragged_verify_attention(
                    *a, block_q=args.block_q, block_kv=b, interpret=interpret or None))
                got = fn(*inputs)
                err = float(jnp.max(jnp.abs(got.astype(jnp.float32) - want.astype(jnp.float32))))
                t = timed(fn, *inputs, repeats=repeats)
                print(f"{R:>4} {C:>6} {block_kv or 'default':>8} {nbytes / 2**20:>8.1f} {t * 1e3:>10.3f} "
                      f"{t_ref * 1e3:>8.3f} {t_ref / t:>8.2f} {nbytes / t / 1e9:>12.1f} "
                      f"{100 * nbytes / t / bandwidth:>8.1f}% {err:>8.1e}")


if __name__ == "__main__":
    main()
