"""The per-request PRNG key scheme, in one place for `generate`, the serving engine and the tests.

A request owns one key, `request_key_data(seed)` — raw threefry key data uint32 [2], exactly
`jax.random.key_data(jax.random.key(seed))` for seeds in [0, 2^32) and the same (hi, lo) split for 64-bit
seeds. Its round r (r = 0 is the token sampled after prefill) draws from
    fold_in(fold_in(key, r), salt),   salt 0 = drafting, salt 1 = verification / target sampling,
so a request's tokens depend only on its own seed and round, never on which other requests share its batch.
`generate` gives batch row b the request key fold_in(key(seed), b), and training-data regeneration gives
prompt i the request key fold_in(key(seed), i) (`key_data_of`). Every fold of a key in the project goes through
`fold` / `fold_rows` here.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from dspark_jax.buckets import pow2_at_least

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
    return key_data_of(seed, np.arange(rows))


def key_data_of(seed: int, indices) -> np.ndarray:
    """uint32 [n, 2]: the request key fold_in(key(seed), i) of each index i (≥ 0, < 2^32) of `indices` [n]:
    `generate`'s row i, training-data regeneration's prompt i."""
    indices = np.asarray(indices, np.int64)
    if indices.size and not (0 <= indices.min() and indices.max() < 2**32):
        raise ValueError("request indices must lie in [0, 2^32)")
    n = indices.size
    padded = np.zeros(pow2_at_least(n), np.uint32)  # a power-of-two length: few compiled shapes
    padded[:n] = indices
    return np.asarray(_fold_indices(request_key_data(seed), padded))[:n]


@jax.jit
def _fold_indices(key_data: jax.Array, indices: jax.Array) -> jax.Array:
    """uint32 [n, 2]: key_data(fold_in(key, i)) for each i of `indices` [n]."""
    base = jax.random.wrap_key_data(key_data)
    return jax.random.key_data(jax.vmap(lambda i: jax.random.fold_in(base, i))(indices))


def row_keys(seed: int, rows: int) -> jax.Array:
    """Typed keys [rows]: `generate`'s row b gets fold_in(key(seed), b) (`row_key_data`, wrapped)."""
    return jax.random.wrap_key_data(jnp.asarray(row_key_data(seed, rows)))


def fold(key: jax.Array, *data) -> jax.Array:
    """fold_in(…fold_in(key, data[0])…, data[-1]) for one typed key."""
    for d in data:
        key = jax.random.fold_in(key, d)
    return key


def fold_rows(keys: jax.Array, *data) -> jax.Array:
    """`fold` per row of typed keys [B]; each datum is a scalar (the same for every row) or an array [B]."""
    axes = (0,) + tuple(None if jnp.ndim(d) == 0 else 0 for d in data)
    return jax.vmap(fold, in_axes=axes)(keys, *data)


def round_keys(key_data: jax.Array, rounds: jax.Array, salt: int) -> jax.Array:
    """Typed keys [B] for this round: fold_in(fold_in(key, round), salt), from key data uint32 [B, 2]."""
    return fold_rows(jax.random.wrap_key_data(key_data.astype(jnp.uint32)), rounds, salt)
