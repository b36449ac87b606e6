"""Decoder building blocks shared by the target and the drafter: RMSNorm, RoPE, GQA attention, SwiGLU.

Weights are stored in einsum layout (the einsum strings are the documentation):
  q: [D, N, H]   k, v: [D, K, H]   o: [N, H, D]   gate, up: [D, F]   down: [F, D].
A served target on XLA:CPU keeps them output-major instead (`to_out_in`, the layout of Hugging Face's
`Linear.weight`): q: [N, H, D]  k, v: [K, H, D]  o: [D, N, H]  gate, up: [F, D]  down: [D, F] (see `dense`).
Attention math runs in float32 (softmax and scores) whatever the parameter dtype, as transformers does.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
from flax import nnx

from dspark_jax.config import RopeConfig


class RMSNorm(nnx.Module):
    """y = x / rms(x) * scale, computed in float32 and cast back (HF LlamaRMSNorm)."""

    def __init__(self, dim: int, *, eps: float, dtype=jnp.float32):
        self.scale = nnx.Param(jnp.ones((dim,), dtype))
        self.eps = eps

    def __call__(self, x: jax.Array) -> jax.Array:
        x32 = x.astype(jnp.float32)
        y = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + self.eps)
        return self.scale[...] * y.astype(x.dtype)


def rope_inv_freq(rope: RopeConfig, head_dim: int) -> jax.Array:
    """Inverse frequencies [H/2] for the configured RoPE type (default, linear, llama3)."""
    inv = 1.0 / (rope.theta ** (jnp.arange(0, head_dim, 2, dtype=jnp.float32) / head_dim))
    if rope.rope_type == "linear":
        inv = inv / rope.factor
    elif rope.rope_type == "llama3":
        # Llama 3.1 scaling: low frequencies divided by `factor`, high ones kept, a smooth band between.
        old = rope.original_max_position_embeddings
        low_wavelen = old / rope.low_freq_factor
        high_wavelen = old / rope.high_freq_factor
        wavelen = 2 * math.pi / inv
        scaled = jnp.where(wavelen > low_wavelen, inv / rope.factor, inv)
        smooth = (old / wavelen - rope.low_freq_factor) / (rope.high_freq_factor - rope.low_freq_factor)
        smoothed = (1 - smooth) * scaled / rope.factor + smooth * scaled
        is_medium = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
        inv = jnp.where(is_medium, smoothed, scaled)
    return inv


def rope_angles(positions: jax.Array, inv_freq: jax.Array, dtype) -> tuple[jax.Array, jax.Array]:
    """(cos, sin) [B, T, 1, H] of the rotate-half RoPE at int32 positions [B, T]: computed once per pass and
    shared by every layer (`rotate`), rather than once per layer and per q/k."""
    freqs = positions.astype(jnp.float32)[..., None] * inv_freq  # [B, T, H/2]
    emb = jnp.concatenate([freqs, freqs], axis=-1)[:, :, None, :]  # [B, T, 1, H]
    return jnp.cos(emb).astype(dtype), jnp.sin(emb).astype(dtype)


def rotate(x: jax.Array, angles: tuple[jax.Array, jax.Array]) -> jax.Array:
    """Rotate-half RoPE (HF convention) of x [B, T, N, H] by `rope_angles` of its positions."""
    cos, sin = angles
    x1, x2 = jnp.split(x, 2, axis=-1)
    rotated = jnp.concatenate([-x2, x1], axis=-1)
    return x * cos + rotated * sin


def apply_rope(x: jax.Array, positions: jax.Array, inv_freq: jax.Array) -> jax.Array:
    """Rotate-half RoPE (HF convention).

    Args:
        x: [B, T, N, H] queries or keys.
        positions: int32 [B, T] absolute positions.
        inv_freq: [H/2].
    """
    return rotate(x, rope_angles(positions, inv_freq, x.dtype))


def attention(q: jax.Array, k: jax.Array, v: jax.Array, mask: jax.Array) -> jax.Array:
    """Grouped-query attention.

    Args:
        q: [B, T, N, H] queries.
        k, v: [B, K, S, H] keys and values.
        mask: bool [B, T, S], True where query t may read key s.

    Returns:
        [B, T, N, H].
    """
    B, T, N, H = q.shape
    K = k.shape[1]
    qg = q.reshape(B, T, K, N // K, H)
    scores = jnp.einsum("BTKGH,BKSH->BKGTS", qg, k, preferred_element_type=jnp.float32) / math.sqrt(H)
    scores = jnp.where(mask[:, None, None], scores, -jnp.inf)
    probs = jax.nn.softmax(scores, axis=-1)
    # A fully masked row (padding) would be NaN: zero it so it cannot poison anything downstream.
    probs = jnp.where(mask[:, None, None].any(-1, keepdims=True), probs, 0.0)
    out = jnp.einsum("BKGTS,BKSH->BTKGH", probs.astype(v.dtype), v)
    return out.reshape(B, T, N, H)


class Projections(nnx.Module):
    """q, k, v and output projections of one attention layer (optional biases, optional q/k RMSNorm)."""

    def __init__(self, *, dim: int, num_heads: int, num_kv_heads: int, head_dim: int, bias: bool,
                 qk_norm: bool, eps: float, dtype, rngs: nnx.Rngs):
        init = nnx.initializers.normal(0.02)
        self.q = nnx.Param(init(rngs.params(), (dim, num_heads, head_dim), dtype))
        self.k = nnx.Param(init(rngs.params(), (dim, num_kv_heads, head_dim), dtype))
        self.v = nnx.Param(init(rngs.params(), (dim, num_kv_heads, head_dim), dtype))
        self.o = nnx.Param(init(rngs.params(), (num_heads, head_dim, dim), dtype))
        if bias:
            self.q_bias = nnx.Param(jnp.zeros((num_heads, head_dim), dtype))
            self.k_bias = nnx.Param(jnp.zeros((num_kv_heads, head_dim), dtype))
            self.v_bias = nnx.Param(jnp.zeros((num_kv_heads, head_dim), dtype))
            self.o_bias = nnx.Param(jnp.zeros((dim,), dtype))  # Llama's attention_bias covers o_proj too
        self.bias = bias
        self.out_in = False  # weights output-major (`to_out_in`)
        self.q_norm = RMSNorm(head_dim, eps=eps, dtype=dtype) if qk_norm else None
        self.k_norm = RMSNorm(head_dim, eps=eps, dtype=dtype) if qk_norm else None

    def qkv(self, x: jax.Array, kv_x: jax.Array | None = None):
        """[B, T, D] → q [B, T, N, H]; k, v [B, T', K, H] from `kv_x` (defaults to x). No RoPE yet."""
        kv_x = x if kv_x is None else kv_x
        q = _project(x, self.q[...], self.out_in)  # "BTD,DNH->BTNH"
        k = _project(kv_x, self.k[...], self.out_in)  # "BTD,DKH->BTKH"
        v = _project(kv_x, self.v[...], self.out_in)
        if self.bias:
            q, k, v = q + self.q_bias[...], k + self.k_bias[...], v + self.v_bias[...]
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        return q, k, v

    def out(self, a: jax.Array) -> jax.Array:
        w = self.o[...]  # "BTNH,NHD->BTD" as a 2-D product (see _project)
        w = w.reshape(w.shape[0], -1) if self.out_in else w.reshape(-1, w.shape[-1])
        y = dense(a.reshape(*a.shape[:-2], -1), w, self.out_in)
        return y + self.o_bias[...] if self.bias else y

    def to_out_in(self) -> None:
        """Stores the weights output-major (see `dense`); the products are the same."""
        if not self.out_in:
            # The last three axes only: a stacked module (model.stacked_layers) has a leading layer axis.
            for name in ("q", "k", "v"):
                setattr(self, name, nnx.Param(jnp.moveaxis(getattr(self, name)[...], -3, -1)))  # [.., N, H, D]
            self.o = nnx.Param(jnp.moveaxis(self.o[...], -1, -3))  # [.., D, N, H]
            self.out_in = True


def dense(x: jax.Array, w: jax.Array, out_in: bool) -> jax.Array:
    """x [..., I] times a weight w: [I, O] (out_in False, x @ w), or output-major [O, I] (out_in True).

    Output-major, the product runs as w @ xᵀ, both operands contiguous along I, behind an optimization barrier
    (so XLA does not fold the transpose back into the dot), then transposed back (a few rows). On XLA:CPU that
    is what makes a verification pass cheap: a pass over a few tokens costs less, relative to a one-token pass,
    than as x @ W, and a one-token pass costs the same (`scripts/bench_verify_price.py`; "The price of
    verifying" in docs/benchmarks.md). The tied LM head is the same product (model.tied_head)."""
    if not out_in:
        return jnp.matmul(x, w)
    rows = x.reshape(-1, x.shape[-1])
    y = jax.lax.optimization_barrier(jnp.einsum("OI,TI->OT", w, rows))
    return y.T.reshape(*x.shape[:-1], w.shape[0])


def _project(x: jax.Array, w: jax.Array, out_in: bool) -> jax.Array:
    """x [..., D] · w [D, N, H] (output-major: [N, H, D]) → [..., N, H], as a 2-D product over the flattened heads.

    The same contraction as the einsum "...D,DNH->...NH", but XLA:CPU runs a dot whose weight has two output
    dimensions several times slower than the plain matrix product (scripts/bench_verify_price.py). The reshapes
    are free (row-major), and merging N (the "model"-sharded dimension) with H keeps the sharding."""
    heads = w.shape[:-1] if out_in else w.shape[1:]
    w = w.reshape(-1, w.shape[-1]) if out_in else w.reshape(w.shape[0], -1)
    return dense(x, w, out_in).reshape(*x.shape[:-1], *heads)


class SwiGLU(nnx.Module):
    """down(silu(gate(x)) * up(x))."""

    def __init__(self, *, dim: int, ffn: int, bias: bool, dtype, rngs: nnx.Rngs):
        init = nnx.initializers.normal(0.02)
        self.gate = nnx.Param(init(rngs.params(), (dim, ffn), dtype))
        self.up = nnx.Param(init(rngs.params(), (dim, ffn), dtype))
        self.down = nnx.Param(init(rngs.params(), (ffn, dim), dtype))
        self.bias = bias
        self.out_in = False  # weights output-major (`to_out_in`)
        if bias:
            self.gate_bias = nnx.Param(jnp.zeros((ffn,), dtype))
            self.up_bias = nnx.Param(jnp.zeros((ffn,), dtype))
            self.down_bias = nnx.Param(jnp.zeros((dim,), dtype))

    def __call__(self, x: jax.Array) -> jax.Array:
        g = dense(x, self.gate[...], self.out_in)  # "BTD,DF->BTF"
        u = dense(x, self.up[...], self.out_in)
        if self.bias:
            g, u = g + self.gate_bias[...], u + self.up_bias[...]
        y = dense(jax.nn.silu(g) * u, self.down[...], self.out_in)  # "BTF,FD->BTD"
        return y + self.down_bias[...] if self.bias else y

    def to_out_in(self) -> None:
        """Stores the weights output-major (see `dense`); the products are the same."""
        if not self.out_in:
            for name in ("gate", "up", "down"):
                setattr(self, name, nnx.Param(jnp.swapaxes(getattr(self, name)[...], -1, -2)))
            self.out_in = True
