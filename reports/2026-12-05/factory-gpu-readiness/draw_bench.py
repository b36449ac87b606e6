"""One training batch drawn the old way (distill.make_batch run op by op on host arrays: the whole window set
converted and gathered each call) against the new (one jitted program on arrays put on the device once), at the
factory's batch shape (64 windows × 16 anchors) from 30,000 windows of 512 tokens.

    python reports/2026-12-05/factory-gpu-readiness/draw_bench.py
"""

import time

import jax
import numpy as np

from train.distill import make_batch

N, T = 30000, 512
rng = np.random.default_rng(0)
tokens = rng.integers(0, 49152, (N, T), dtype=np.int32)
lengths = rng.integers(200, T + 1, N).astype(np.int32)
min_anchor = rng.integers(20, 100, N).astype(np.int32)
key = jax.random.key(0)
eager = make_batch.__wrapped__  # the same function, not jitted


def bench(f, *a, n=20):
    jax.block_until_ready(f(jax.random.fold_in(key, 0), *a, 64, anchors_per_seq=16))
    t = time.perf_counter()
    for i in range(n):
        out = f(jax.random.fold_in(key, i), *a, 64, anchors_per_seq=16)
    jax.block_until_ready(out)
    return (time.perf_counter() - t) / n * 1e3


old = bench(eager, tokens, lengths, min_anchor)
dev = jax.device_put((tokens, lengths, min_anchor))
new = bench(make_batch, *dev)
a = eager(key, tokens, lengths, min_anchor, 64, anchors_per_seq=16)
b = make_batch(key, *dev, 64, anchors_per_seq=16)
same = all(np.array_equal(a[k], b[k]) for k in a)
print(f"backend {jax.default_backend()}: eager draw from host arrays {old:.2f} ms, jitted draw from device arrays "
      f"{new:.2f} ms ({old / new:.1f}x); identical batches: {same}")
