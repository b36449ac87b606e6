"""Static shapes: the buckets every jitted program is compiled for, and the one way to pick one (STYLE.md §8).

Variable sizes (running requests, tokens in a verification pass, prompt lengths) are padded up to a bucket so
that a new request never compiles a new program: batch buckets and capacity buckets are powers of two up to
their maximum; padded lengths are multiples of a fixed step.
"""

from __future__ import annotations


def round_up(n: int, m: int) -> int:
    """The smallest multiple of m that is ≥ n."""
    return -(-n // m) * m


def pow2_at_least(n: int) -> int:
    """The smallest power of two ≥ n (1 for n ≤ 1)."""
    return 1 << max(0, int(n) - 1).bit_length()


def pow2_buckets(top: int, start: int = 1) -> tuple[int, ...]:
    """Powers of two from `start` below `top`, and `top` itself."""
    out, b = [], start
    while b < top:
        out.append(b)
        b *= 2
    return tuple(out) + (top,)


def capacity_buckets(max_batch: int, block_size: int) -> tuple[int, ...]:
    """Verification capacities (tokens a pass verifies): powers of two up to, and including,
    max_batch · (L + 1) — every row's anchor and all L of its draft tokens."""
    return pow2_buckets(max_batch * (block_size + 1))


def pick(n: int, buckets) -> int:
    """The smallest bucket ≥ n."""
    for b in buckets:
        if b >= n:
            return int(b)
    raise ValueError(f"{n} exceeds the largest bucket {buckets[-1]}")
