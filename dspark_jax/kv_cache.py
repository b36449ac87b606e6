"""The target's KV cache: a value passed into the forward and returned, never mutated in place.

Layout per layer: k, v [B, K, S, H] (batch, KV heads, cache positions, head dim); `lengths` [B] counts the
committed tokens of each row. A forward over T new tokens writes them at positions lengths[b] + t and
advances `lengths` by the number of valid new tokens per row. Speculative verification writes ℓ+1 tokens
and then *rewinds* `lengths` to what was accepted: the stale entries past `lengths` are masked out of
attention and overwritten by the next write, so rejecting tokens costs nothing.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import struct


@struct.dataclass
class KVCache:
    """Per-layer keys and values plus committed lengths.

    Attributes:
        k: tuple over layers of [B, K, S, H].
        v: tuple over layers of [B, K, S, H].
        lengths: int32 [B], committed tokens per row.
    """

    k: tuple[jax.Array, ...]
    v: tuple[jax.Array, ...]
    lengths: jax.Array

    @classmethod
    def init(cls, *, num_layers: int, batch: int, num_kv_heads: int, capacity: int, head_dim: int,
             dtype=jnp.float32) -> KVCache:
        shape = (batch, num_kv_heads, capacity, head_dim)
        # Distinct buffers per layer, so that donation can update each one in place.
        return cls(
            k=tuple(jnp.zeros(shape, dtype) for _ in range(num_layers)),
            v=tuple(jnp.zeros(shape, dtype) for _ in range(num_layers)),
            lengths=jnp.zeros((batch,), jnp.int32),
        )

    @property
    def capacity(self) -> int:
        """S: cache positions per row."""
        return self.k[0].shape[2]

    def with_lengths(self, lengths: jax.Array) -> KVCache:
        return self.replace(lengths=lengths.astype(jnp.int32))


def write_kv(buf: jax.Array, new: jax.Array, positions: jax.Array) -> jax.Array:
    """Scatters new entries into a cache buffer.

    Args:
        buf: [B, K, S, H] cache buffer.
        new: [B, T, K, H] new keys or values.
        positions: int32 [B, T] absolute cache positions; positions >= S are dropped (padding past capacity).

    Returns:
        The updated [B, K, S, H] buffer.
    """
    b = jnp.arange(buf.shape[0])[:, None]
    # Advanced indices on axes 0 and 2 broadcast to [B, T] and come first: the update is [B, T, K, H].
    return buf.at[b, :, positions].set(new.astype(buf.dtype), mode="drop")
