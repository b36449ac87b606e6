"""The target decoder (Llama and Qwen3 families) in Flax NNX, with one forward for every phase.

`Decoder.__call__(tokens [B, T], cache, num_new [B])` serves prefill (T = prompt length), decode (T = 1)
and speculative verification (T = ℓ+1, padded to a capacity bucket): row b's tokens sit at positions
cache.lengths[b] + t, only the first num_new[b] of them are real, and each query attends causally to its
own row's cache. It can also return the hidden states of chosen layers, concatenated — what the
drafter's KV injection reads (paper eq. 2).

The layers are one `DecoderLayer` whose parameters are stacked on a leading layer axis (`layers.attn.q` is
[num_layers, D, N, H]) and every forward runs them under `lax.scan` (`scan_layers`), as MaxText and gemma do: a
compiled program holds one layer body, so its size and compile time do not grow with depth.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from dspark_jax import kernels as kernels_lib
from dspark_jax.config import ModelConfig
from dspark_jax.kv_cache import KVCache, write_kv
from dspark_jax.layers import Projections, RMSNorm, SwiGLU, apply_rope, attention, rope_inv_freq


def stacked_layers(num_layers: int, make, rngs: nnx.Rngs):
    """`num_layers` copies of the module `make(rngs)` returns, as one module whose parameters carry a leading
    layer axis (each layer initialised from its own split of `rngs`)."""

    @nnx.split_rngs(splits=num_layers)
    @nnx.vmap(in_axes=(0,), out_axes=0)
    def build(r):
        return make(r)

    return build(rngs)


def scan_layers(layers: nnx.Module, body, carry, xs=None):
    """`lax.scan` of `body(layer, carry, x) -> (carry, y)` over a stacked module (`stacked_layers`): layer i is
    the module over slice i of every parameter; `xs` (a pytree with the same leading axis, or None) is sliced
    alongside. The layer index is `carry`'s business where the body needs it."""
    graphdef, state = nnx.split(layers)

    def step(c, sx):
        s, x = sx
        return body(nnx.merge(graphdef, s), c, x)

    return jax.lax.scan(step, carry, (state, xs))


def hidden_slots(num_layers: int, hidden_layers: tuple[int, ...]) -> jax.Array:
    """int32 [num_layers]: where layer i's output goes in the saved-hidden buffer (its index in
    `hidden_layers`), or len(hidden_layers) — one past the buffer, a dropped write — for layers not asked for."""
    slots = [len(hidden_layers)] * num_layers
    for j, i in enumerate(hidden_layers):
        if not 0 <= i < num_layers:
            raise ValueError(f"hidden layer {i} out of range for a {num_layers}-layer target")
        slots[i] = j
    return jnp.asarray(slots, jnp.int32)


def concat_saved(saved: jax.Array) -> jax.Array:
    """The saved-hidden buffer [m, ..., D] → float32 [..., m·D], layers in `hidden_layers` order."""
    return jnp.concatenate(list(saved), -1).astype(jnp.float32)


def tied_head(h: jax.Array, embed: jax.Array) -> jax.Array:
    """h [..., D] @ embed[V, D]ᵀ → float32 [..., V], the tied LM head.

    A few rows at a time (a verification pass: T = ℓ+1 tokens) run as embed @ hᵀ, with the [V, D] table as the
    left operand, then transposed back: on XLA:CPU that product is faster than h @ embedᵀ at 2–16 rows
    (scripts/bench_verify_price.py). The barrier keeps XLA from folding the transpose back into the dot. One
    row (a decode step) keeps h @ embedᵀ, which is faster there. Same products, same sums: equal up to the
    order of the float additions."""
    rows = h.reshape(-1, h.shape[-1])
    if rows.shape[0] == 1 or rows.shape[0] > 32:
        return jnp.einsum("...D,VD->...V", h, embed, preferred_element_type=jnp.float32)
    out = jax.lax.optimization_barrier(jnp.einsum("VD,ND->VN", embed, rows, preferred_element_type=jnp.float32))
    return out.T.reshape(*h.shape[:-1], embed.shape[0])


class DecoderLayer(nnx.Module):
    """Pre-norm block: x + attn(norm(x)), then x + mlp(norm(x))."""

    def __init__(self, cfg: ModelConfig, *, dtype, rngs: nnx.Rngs):
        D = cfg.hidden_size
        self.attn_norm = RMSNorm(D, eps=cfg.rms_norm_eps, dtype=dtype)
        self.attn = Projections(dim=D, num_heads=cfg.num_heads, num_kv_heads=cfg.num_kv_heads,
                                head_dim=cfg.head_dim, bias=cfg.attention_bias, qk_norm=cfg.qk_norm,
                                eps=cfg.rms_norm_eps, dtype=dtype, rngs=rngs)
        self.mlp_norm = RMSNorm(D, eps=cfg.rms_norm_eps, dtype=dtype)
        self.mlp = SwiGLU(dim=D, ffn=cfg.intermediate_size, bias=cfg.mlp_bias, dtype=dtype, rngs=rngs)

    def block(self, x, rope, attend):
        """The layer body every target forward shares (this dense cache's `__call__`, the paged pools'
        `paged.target_forward_flat`): q, k, v from norm(x), `rope` applied to q and k, then
        `attend(q, k, v) → (a, state)` (which writes the cache it owns and returns it as `state`), x + out(a),
        then x + mlp(norm(x)). Returns (x, state)."""
        q, k, v = self.attn.qkv(self.attn_norm(x))
        a, state = attend(rope(q), rope(k), v)
        x = x + self.attn.out(a)
        return x + self.mlp(self.mlp_norm(x)), state

    def __call__(self, x, positions, inv_freq, k_buf, v_buf, mask, kernels="auto"):
        """x [B, T, D]; positions [B, T]; k_buf, v_buf [B, K, S, H]; mask [B, T, S] → (x, k_buf, v_buf)."""

        def attend(q, k, v):
            kb, vb = write_kv(k_buf, k, positions), write_kv(v_buf, v, positions)
            if kernels_lib.KernelConfig.parse(kernels).pallas("attention"):  # mask is implied
                return kernels_lib.cached_attention(q, kb, vb, positions), (kb, vb)
            return attention(q, kb, vb, mask), (kb, vb)

        x, (k_buf, v_buf) = self.block(x, lambda t: apply_rope(t, positions, inv_freq), attend)
        return x, k_buf, v_buf


class Decoder(nnx.Module):
    """Embedding → N decoder layers → final RMSNorm → LM head (tied or untied)."""

    def __init__(self, cfg: ModelConfig, *, dtype=jnp.float32, rngs: nnx.Rngs):
        self.cfg = cfg
        self.dtype = dtype
        self.embed = nnx.Param(nnx.initializers.normal(0.02)(rngs.params(), (cfg.vocab_size, cfg.hidden_size),
                                                               dtype))
        self.layers = stacked_layers(cfg.num_layers, lambda r: DecoderLayer(cfg, dtype=dtype, rngs=r), rngs)
        self.final_norm = RMSNorm(cfg.hidden_size, eps=cfg.rms_norm_eps, dtype=dtype)
        if not cfg.tie_word_embeddings:
            self.lm_head = nnx.Param(nnx.initializers.normal(0.02)(rngs.params(),
                                                                   (cfg.hidden_size, cfg.vocab_size), dtype))

    def init_cache(self, batch: int, capacity: int) -> KVCache:
        c = self.cfg
        return KVCache.init(num_layers=c.num_layers, batch=batch, num_kv_heads=c.num_kv_heads,
                            capacity=capacity, head_dim=c.head_dim, dtype=self.dtype)

    def embed_tokens(self, tokens: jax.Array) -> jax.Array:
        """int32 [B, T] → [B, T, D]."""
        return jnp.take(self.embed[...], tokens, axis=0)

    def head(self, h: jax.Array) -> jax.Array:
        """Final-normed hidden states [..., D] → float32 logits [..., V]. The drafter borrows this, frozen."""
        if not self.cfg.tie_word_embeddings:
            return jnp.einsum("...D,DV->...V", h, self.lm_head[...], preferred_element_type=jnp.float32)
        return tied_head(h, self.embed[...])

    def __call__(self, tokens: jax.Array, cache: KVCache, num_new: jax.Array | None = None,
                 hidden_layers: tuple[int, ...] = (), compute_logits: bool = True, kernels: str = "auto"):
        """One forward over a block of new tokens per row.

        Args:
            tokens: int32 [B, T]; row b's real tokens are the first num_new[b].
            cache: KVCache with capacity ≥ lengths + T for every row (writes past capacity are dropped).
            num_new: int32 [B], defaults to T for every row.
            hidden_layers: indices of layers whose outputs to return (0-based; layer i's output is HF's
                `hidden_states[i + 1]`).
            compute_logits: False skips the LM head (prefill of a long prompt only needs the last position).
            kernels: attention through the Pallas kernel or the jnp path (see dspark_jax.kernels).

        Returns:
            (logits float32 [B, T, V] or final-normed hidden [B, T, D] when compute_logits is False,
             new cache with lengths advanced by num_new, hidden float32 [B, T, len(hidden_layers)·D] or None).
        """
        B, T = tokens.shape
        if num_new is None:
            num_new = jnp.full((B,), T, jnp.int32)
        positions = cache.lengths[:, None] + jnp.arange(T, dtype=jnp.int32)[None]  # [B, T]
        S = cache.capacity
        mask = jnp.arange(S)[None, None, :] <= positions[:, :, None]  # [B, T, S] causal over own row
        inv_freq = rope_inv_freq(self.cfg.rope, self.cfg.head_dim)

        x = self.embed_tokens(tokens)
        slots = hidden_slots(self.cfg.num_layers, tuple(hidden_layers))
        saved = jnp.zeros((len(hidden_layers), *x.shape), x.dtype)

        def body(layer, carry, kv):
            x, saved, i = carry
            x, k, v = layer(x, positions, inv_freq, kv[0], kv[1], mask, kernels)
            if hidden_layers:
                saved = saved.at[slots[i]].set(x, mode="drop")
            return (x, saved, i + 1), (k, v)

        (x, saved, _), (ks, vs) = scan_layers(self.layers, body, (x, saved, 0),
                                              (jnp.stack(cache.k), jnp.stack(cache.v)))
        hidden = concat_saved(saved) if hidden_layers else None
        new_cache = KVCache(k=tuple(ks), v=tuple(vs), lengths=cache.lengths + num_new.astype(jnp.int32))
        h = self.final_norm(x)
        return (self.head(h) if compute_logits else h), new_cache, hidden
