"""Benchmark: the fused Markov-head sampler (pallas_kernels.markov_sample) against its plain-jnp reference.

    python -m scripts.bench_pallas_markov [--batch 1 16 64] [--vocab 151936] [--rank 256] [--block 7]
        [--dtype bfloat16] [--block-v 128] [--split-v 1024] [--block-b 16] [--repeats 20] [--tiny]

On a GPU or TPU it compiles the kernel for real at the deployment shape (Qwen3 vocab V=151936, Markov rank
R=256, draft block L=7) for each batch size B, half the rows greedy and half at temperature 0.8, and reports
per call: median time of kernel and reference, the share of identical tokens, and the achieved bandwidth

    compulsory bytes / time,   compulsory bytes = U (B·L·V) + L reads of W2 (R·V) + W1 rows, in the dtype,

beside the device's measured copy bandwidth (jitted `x + 1` over 1 GiB: read + write). The kernel can do no
better than that bandwidth; the reference also writes and rereads [B, V] f32 logits per position, which the
kernel never materialises. Block sizes default to the kernel's own per-backend defaults; pass several
`--split-v` values to sweep them.

On a CPU (or with --tiny) Pallas only interprets the kernel, so the numbers say nothing about a kernel's
speed: it runs a tiny shape (V=4096, R=16, B ∈ {1, 4}) as a smoke test and says so in the table title.
"""

from __future__ import annotations

import argparse
import os
import sys

import jax
import jax.numpy as jnp

if __package__ in (None, ""):  # run as a file: make the repo root importable (python -m needs no help)
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from pallas_kernels.markov_sample import markov_sample, markov_sample_reference  # noqa: E402
from pallas_kernels.timing import bench_setup, mode_line, timed  # noqa: E402


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--batch", type=int, nargs="+", default=None,
                   help="batch sizes B (default: 1 16 64 on an accelerator, 1 4 when tiny)")
    p.add_argument("--vocab", type=int, default=None, help="vocab V (default: 151936, or 4096 when tiny)")
    p.add_argument("--rank", type=int, default=None, help="Markov rank R (default: 256, or 16 when tiny)")
    p.add_argument("--block", type=int, default=7, help="draft block L (default: %(default)s)")
    p.add_argument("--dtype", choices=["bfloat16", "float32"], default="bfloat16",
                   help="dtype of U, W1 and W2 (default: %(default)s)")
    p.add_argument("--block-v", type=int, default=None, help="kernel vocab columns per inner step")
    p.add_argument("--split-v", type=int, nargs="+", default=[None],
                   help="kernel vocab columns per program; several values are swept")
    p.add_argument("--block-b", type=int, default=None, help="kernel rows per program")
    p.add_argument("--repeats", type=int, default=20, help="timed calls per measurement (default: %(default)s)")
    p.add_argument("--tiny", action="store_true", help="the CPU smoke-test shape even on an accelerator")
    return p.parse_args(argv)


def make_inputs(B, L, V, R, dtype, seed=0):
    k = jax.random.split(jax.random.key(seed), 5)
    U = (2.0 * jax.random.normal(k[0], (B, L, V))).astype(dtype)
    w1 = jax.random.normal(k[1], (V, R)).astype(dtype)
    w2 = (0.1 * jax.random.normal(k[2], (R, V))).astype(dtype)
    anchor = jax.random.randint(k[3], (B,), 0, V, jnp.int32)
    temperature = jnp.where(jnp.arange(B) % 2 == 0, 0.0, 0.8).astype(jnp.float32)
    seeds = jax.random.bits(k[4], (B, 2), jnp.uint32)
    return U, w1, w2, anchor, temperature, seeds


def main(argv=None) -> None:
    args = parse_args(argv)
    platform, tiny, interpret, repeats, bandwidth = bench_setup(args.tiny, args.repeats)
    batches = args.batch or ([1, 4] if tiny else [1, 16, 64])
    V = args.vocab or (4096 if tiny else 151936)
    R = args.rank or (16 if tiny else 256)
    L, dtype = args.block, jnp.dtype(args.dtype)

    mode = mode_line(interpret)
    print(f"markov_sample on {jax.devices()[0].device_kind} ({platform}), {mode}")
    print(f"V={V} R={R} L={L} {dtype.name}; measured copy bandwidth {bandwidth / 1e9:.1f} GB/s")
    header = (f"{'B':>4} {'split_v':>8} {'kernel ms':>10} {'ref ms':>8} {'speedup':>8} {'kernel GB/s':>12} "
              f"{'ref GB/s':>9} {'% of copy':>9} {'same tok':>9}")
    print(header)
    print("-" * len(header))
    for B in batches:
        inputs = make_inputs(B, L, V, R, dtype)
        ref_fn = jax.jit(markov_sample_reference)
        want = ref_fn(*inputs)
        t_ref = timed(ref_fn, *inputs, repeats=repeats)
        nbytes = dtype.itemsize * (B * L * V + L * R * V + B * L * R)
        for split_v in args.split_v:
            fn = jax.jit(lambda *a, s=split_v: markov_sample(
                *a, block_v=args.block_v, split_v=s, block_b=args.block_b, interpret=interpret or None))
            got = fn(*inputs)
            same = float(jnp.mean(got.tokens == want.tokens))
            t = timed(fn, *inputs, repeats=repeats)
            print(f"{B:>4} {split_v or 'default':>8} {t * 1e3:>10.3f} {t_ref * 1e3:>8.3f} {t_ref / t:>8.2f} "
                  f"{nbytes / t / 1e9:>12.1f} {nbytes / t_ref / 1e9:>9.1f} {100 * nbytes / t / bandwidth:>8.1f}% "
                  f"{100 * same:>8.1f}%")


if __name__ == "__main__":
    main()
