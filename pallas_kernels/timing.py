"""Timing helpers the kernel benchmarks share (scripts/bench_pallas_*.py): a kernel's median call time and the
device's measured copy bandwidth, against which a memory-bound kernel's speed is read."""

from __future__ import annotations

import statistics
import time

import jax
import jax.numpy as jnp


def timed(fn, *args, repeats: int) -> float:
    """Median seconds per call after one warm-up (compilation) call."""
    jax.block_until_ready(fn(*args))
    times = []
    for _ in range(repeats):
        t = time.perf_counter()
        jax.block_until_ready(fn(*args))
        times.append(time.perf_counter() - t)
    return statistics.median(times)


def copy_bandwidth(repeats: int, nbytes: int) -> float:
    """Bytes/s of a jitted elementwise pass (reads and writes nbytes each)."""
    x = jnp.zeros((nbytes // 4,), jnp.float32)
    return 2 * nbytes / timed(jax.jit(lambda x: x + 1.0), x, repeats=repeats)


def bench_setup(tiny_flag: bool, repeats: int) -> tuple[str, bool, bool, int, float]:
    """(platform, tiny, interpret, repeats, copy bandwidth) of a kernel benchmark: on a CPU the kernels run in
    interpret mode at the tiny shapes with at most 3 timed calls (a smoke test, not kernel speed)."""
    platform = jax.default_backend()
    tiny = tiny_flag or platform == "cpu"
    interpret = platform == "cpu"
    repeats = min(repeats, 3) if interpret else repeats
    return platform, tiny, interpret, repeats, copy_bandwidth(repeats, (64 << 20) if tiny else (1 << 30))


def mode_line(interpret: bool) -> str:
    return "INTERPRET MODE on CPU: timings are not kernel speed, a smoke test only" if interpret else "compiled"
