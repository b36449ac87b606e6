"""The per-request PRNG key scheme, in one place for `generate`, the serving engine and the tests.

A request owns one key, `request_key_data(seed)` — raw threefry key data uint32 [2], exactly
`jax.random.key_data(jax.random.key(seed))` for seeds in [0, 2^32) and the same (hi, lo) split for 64-bit
seeds. Its round r (r = 0 is the token sampled after prefill) draws from
    fold_in(fold_in(key, r), salt),   salt 0 = drafting, salt 1 = verification / target sampling,
so a request's tokens depend only on its own seed and round, never on which other requests share its batch.
`generate` gives batch row b the key of fold_in(key(seed), b).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

DRAFT, VERIFY = 0, 1

SEED_MIN, SEED_MAX = -(2**63), 2**64 - 1


def request_key_data(seed: int) -> np.ndarray:
    """uint32 [2] key data of a request seeded with `seed` (any integer in [−2^63, 2^64))."""
    seed = int(seed)
    if not SEED_MIN <= seed <= SEED_MAX:
        raise ValueError(f"seed must be a 64-bit integer, got {seed}")
    seed &= 0xFFFF_FFFF_FFFF_FFFF
    return np.array([seed >> 32, seed & 0xFFFF_FFFF], np.uint32)


def row_key_data(seed: int, rows: int) -> np.ndarray:
    """uint32 [rows, 2]: `generate`'s row b gets fold_in(key(seed), b)."""
    base = jax.random.wrap_key_data(jnp.asarray(request_key_data(seed)))
    keys = jax.vmap(lambda b: jax.random.fold_in(base, b))(jnp.arange(rows))
    return np.asarray(jax.random.key_data(keys))


def round_keys(key_data: jax.Array, rounds: jax.Array, salt: int) -> jax.Array:
    """Typed keys [B] for this round: fold_in(fold_in(key, round), salt), from key data uint32 [B, 2]."""
    keys = jax.random.wrap_key_data(key_data.astype(jnp.uint32))
    return jax.vmap(lambda k, r: jax.random.fold_in(jax.random.fold_in(k, r), salt))(keys, rounds)
