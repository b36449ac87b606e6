"""Counter-based Gumbel noise: murmur3 of (seed, draft position k, vocab index v) → Gumbel(0, 1).

The fused sampler (`markov_sample.py`) draws one Gumbel variate per (row, position, vocab entry) and takes
`argmax(logits / T + G)` (the Gumbel-max trick, an exact sample of softmax(logits / T)). Materialising G as a
[B, L, V] array would cost more HBM traffic than the sampler itself, so G is a pure function of its
coordinates, evaluated where it is used: inside the kernel, chunk by chunk, and in the plain-jnp reference on
whole rows. Both call these helpers, so kernel and reference see bit-identical noise and draw the same tokens.

Hash: murmur3_32 (Appleby) of the 12-byte message (seed[1], k, v) with 32-bit seed seed[0]. It uses only
uint32 multiply / xor / shift, which Pallas lowers on Triton, Mosaic TPU and the CPU interpreter. It is a
statistical hash, not a cryptographic one: fine for sampling, not for secrets.

Shapes: seeds uint32 [B, 2] (one pair per request, e.g. `jax.random.bits(key, (2,), jnp.uint32)` per row);
row keys uint32 [B] (one per row and position); vocab indices int32 [..., V]; noise f32, broadcast shape.
The row index b is deliberately not hashed: a request's draft depends on its seed, not on its batch slot
(the same contract as `dspark_jax.sampling.sample` with per-row keys).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

# murmur3_32 constants; numpy scalars so they stay literals inside Pallas kernels (no captured constants).
_C1 = np.uint32(0xCC9E2D51)
_C2 = np.uint32(0x1B873593)
_M5 = np.uint32(5)
_N = np.uint32(0xE6546B64)
_F1 = np.uint32(0x85EBCA6B)
_F2 = np.uint32(0xC2B2AE35)
_MESSAGE_BYTES = np.uint32(12)  # three 32-bit words: seed[1], k, v


def _rotl(x: jax.Array, r: int) -> jax.Array:
    return (x << np.uint32(r)) | (x >> np.uint32(32 - r))


def _mix(h: jax.Array, w: jax.Array) -> jax.Array:
    """One murmur3_32 body round: absorb the 32-bit word w into the state h."""
    w = _rotl(w * _C1, 15) * _C2
    return _rotl(h ^ w, 13) * _M5 + _N


def _fmix(h: jax.Array) -> jax.Array:
    """The murmur3_32 finaliser (full avalanche)."""
    h = (h ^ (h >> np.uint32(16))) * _F1
    h = (h ^ (h >> np.uint32(13))) * _F2
    return h ^ (h >> np.uint32(16))


def row_keys(seeds: jax.Array, k) -> jax.Array:
    """Per-row hash state for draft position k: uint32 [B, 2] seeds, k int (or traced int32) → uint32 [B].

    Computed once per (row, position) outside the kernel; the kernel only absorbs the vocab index.
    """
    seeds = jnp.asarray(seeds, jnp.uint32)
    return _mix(_mix(seeds[:, 0], seeds[:, 1]), jnp.asarray(k).astype(jnp.uint32))


def hash_bits(keys: jax.Array, cols: jax.Array) -> jax.Array:
    """uint32 murmur3_32 of (seed[1], k, v) for row keys uint32 [...] and vocab indices int32 [...]."""
    return _fmix(_mix(keys, cols.astype(jnp.uint32)) ^ _MESSAGE_BYTES)


def gumbel(keys: jax.Array, cols: jax.Array) -> jax.Array:
    """Gumbel(0, 1) noise f32 for row keys uint32 [...] and vocab indices int32 [...] (broadcast together).

    The uniform is u = (m + 1/2) / 2^23 with m the top 23 hash bits: every value is exact in f32 and lies in
    [2^-24, 1 - 2^-24], so -log(-log u) is finite (range about [-2.8, 16.6]), the same resolution as
    `jax.random.gumbel`.
    """
    h = hash_bits(keys, cols)
    u = ((h >> np.uint32(9)).astype(jnp.int32).astype(jnp.float32) + 0.5) * np.float32(2.0**-23)
    return -jnp.log(-jnp.log(u))
