"""What a long chunk beside many short prompts costs in one prefill pass on the CPU's jnp attention path:
`ModelRunner.prefill_chunks` on the SmolLM2 target alone (max_batch 32, chunk buckets 32/128), medians of 5
after a compiling call. Why `ModelRunner.prefill_fits` bounds request rows × the longest chunk there.

    python reports/2026-12-07/engine-prefill/mix.py > reports/2026-12-07/engine-prefill/mix.txt
"""

from __future__ import annotations

import time

import numpy as np

import dspark_jax
from dspark_jax.runner import ModelRunner, PrefillItem


def main() -> None:
    target = dspark_jax.load_target("smollm2-135m-instruct")
    runner = ModelRunner(target, None, max_batch=32, num_pages=32 * 16, page_size=16, max_pages=16,
                         chunk_sizes=(32, 128))
    M = runner.max_pages

    def item(i: int, n: int, start: int = 0) -> PrefillItem:
        return PrefillItem([5] * n, start, np.arange(i * M, (i + 1) * M, dtype=np.int32), np.zeros(2, np.uint32),
                           0.0, 0, 1.0)

    def timed(fn, k: int = 5) -> float:
        fn()
        times = []
        for _ in range(k):
            t = time.perf_counter()
            fn()
            times.append(time.perf_counter() - t)
        return float(np.median(times))

    for context in (0, 128):
        if context:
            runner.prefill_chunks([item(0, 128)])  # an earlier chunk: the 100 tokens follow 128 in the cache
        alone = timed(lambda: runner.prefill_chunks([item(0, 100, context)]))  # noqa: B023
        shorts = timed(lambda: runner.prefill_chunks([item(1 + j, 1) for j in range(28)]))
        packed = timed(lambda: runner.prefill_chunks([item(0, 100, context)] + [item(1 + j, 1) for j in range(27)]))  # noqa: B023
        print(f"a 100-token chunk after {context} tokens: alone {alone * 1e3:.0f} ms + 28 one-token prompts "
              f"{shorts * 1e3:.0f} ms = {(alone + shorts) * 1e3:.0f} ms as two passes; packed in one pass "
              f"(32 request rows) {packed * 1e3:.0f} ms", flush=True)


if __name__ == "__main__":
    main()
