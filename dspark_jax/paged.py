"""Paged KV caches and the flat (ragged) forward that serving runs on them.

Layout (the ragged verification kernel's, pallas_kernels/ragged_verify_attention.py): per layer
k, v [P, K, page_size, H] — a pool of P pages shared by all requests. Request slot b owns the pages
block_tables[b, :] in order, so its cache position p lives at (block_tables[b, p // page_size], p % page_size).
The host allocates pages (serve/pages.py); the device only reads tables. Page id P (one past the pool) is the
"no page" sentinel: writes there are dropped.

The flat forward runs the target over T query tokens of R requests packed back to back (padded to a
capacity bucket): token t belongs to request slot[t] at absolute position pos[t]; request r's tokens are rows
query_start[r] .. query_start[r+1]−1 and context_lens[r] = its cached tokens including these. Projections and
MLPs cost ∝ T (the bucket), not R × the longest block: that is what lets the scheduler trade draft tokens for
batch slots. Attention goes through dspark_jax.kernels (Pallas kernel on GPU/TPU, the jnp reference here).

The drafter's injected context (KV injection) is paged the same way, in its own pool, under the same block
tables: context entry p of a request is written at the same (page, offset) as the target's position p.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import struct

from dspark_jax import kernels as kernels_lib
from dspark_jax.drafter_model import DrafterCache, DrafterModel
from dspark_jax.layers import apply_rope, rope_inv_freq
from dspark_jax.model import Decoder


@struct.dataclass
class PagedKV:
    """k, v: tuples over layers of [P, K, page_size, H]."""

    k: tuple[jax.Array, ...]
    v: tuple[jax.Array, ...]

    @classmethod
    def init(cls, *, num_layers: int, num_pages: int, num_kv_heads: int, page_size: int, head_dim: int,
             dtype=jnp.float32) -> PagedKV:
        shape = (num_pages, num_kv_heads, page_size, head_dim)
        return cls(k=tuple(jnp.zeros(shape, dtype) for _ in range(num_layers)),
                   v=tuple(jnp.zeros(shape, dtype) for _ in range(num_layers)))

    @property
    def num_pages(self) -> int:
        return self.k[0].shape[0]

    @property
    def page_size(self) -> int:
        return self.k[0].shape[2]


def page_slots(block_tables, slot, pos, valid, num_pages: int, page_size: int):
    """(page id, offset) of each token [T]; invalid tokens get the dropped page id `num_pages`."""
    page = block_tables[slot, pos // page_size]
    return jnp.where(valid, page, num_pages), pos % page_size


def write_pages(pages: jax.Array, new: jax.Array, page, offset) -> jax.Array:
    """pages [P, K, page_size, H] ← new [T, K, H] at (page [T], offset [T]); page ≥ P is dropped."""
    return pages.at[page, :, offset].set(new.astype(pages.dtype), mode="drop")


def gather_contiguous(pages: jax.Array, block_tables: jax.Array) -> jax.Array:
    """A contiguous view [B, K, S, H] (S = max_pages · page_size) of each slot's pages (drafter attention)."""
    P, K, ps, H = pages.shape
    B, M = block_tables.shape
    g = pages[jnp.clip(block_tables, 0, P - 1)]  # [B, M, K, ps, H]
    return g.transpose(0, 2, 1, 3, 4).reshape(B, K, M * ps, H)


def batched_ragged_attention(q, k_pages, v_pages, block_tables, context_lens, query_start, *, max_q_len: int):
    """Plain-jnp ragged paged attention, vectorised over requests (the CPU path; the Pallas kernel serves
    GPU/TPU and `ragged_verify_attention_reference` stays the oracle). Same contract as the kernel:
    q [T, N, H], pages [P, K, page_size, H], block_tables [R, M], context_lens [R], query_start [R+1] → [T, N, H].

    Each request's ≤ max_q_len queries are gathered into a dense [R, Q, N, H] block and its pages into
    [R, K, S, H] (S = M · page_size), so one batched einsum per layer replaces a loop over requests.
    """
    T, N, H = q.shape
    P, K, ps, _ = k_pages.shape
    R, M = block_tables.shape
    G, Q = N // K, max_q_len
    i = jnp.arange(Q, dtype=jnp.int32)
    q_len = query_start[1:] - query_start[:-1]  # [R]
    rows = query_start[:-1, None] + i  # [R, Q]
    valid = i[None] < q_len[:, None]
    qr = q[jnp.clip(rows, 0, T - 1)].reshape(R, Q, K, G, H)
    pages = jnp.clip(block_tables, 0, P - 1)
    k = k_pages[pages].transpose(0, 2, 1, 3, 4).reshape(R, K, M * ps, H)
    v = v_pages[pages].transpose(0, 2, 1, 3, 4).reshape(R, K, M * ps, H)
    precision = jax.lax.Precision.HIGHEST if q.dtype == jnp.float32 else None
    s = jnp.einsum("RQKGH,RKSH->RQKGS", qr, k, preferred_element_type=jnp.float32, precision=precision)
    s = s / jnp.sqrt(jnp.float32(H))
    pos = (context_lens - q_len)[:, None] + i  # absolute position of each query [R, Q]
    visible = jnp.arange(M * ps)[None, None, :] <= pos[:, :, None]  # [R, Q, S]
    s = jnp.where(visible[:, :, None, None, :], s, -jnp.inf)
    p = jax.nn.softmax(s, axis=-1)
    p = jnp.where(valid[:, :, None, None, None], p, 0.0)  # padding queries (and their NaN rows) → 0
    o = jnp.einsum("RQKGS,RKSH->RQKGH", p, v.astype(jnp.float32), precision=precision).reshape(R * Q, N, H)
    dest = jnp.where(valid, rows, T).reshape(-1)  # T = dropped
    return jnp.zeros((T, N, H), jnp.float32).at[dest].set(o, mode="drop").astype(q.dtype)


def target_forward_flat(model: Decoder, kv: PagedKV, tokens, slot, pos, valid, block_tables, context_lens,
                        query_start, *, max_q_len: int, hidden_layers: tuple[int, ...] = (),
                        kernels: str = "auto"):
    """The target over a flat bucket of tokens (module docstring).

    Args:
        model: the merged target Decoder.
        kv: its paged cache.
        tokens, slot, pos: int32 [T]; valid: bool [T] (False for padding rows past query_start[R]).
        block_tables: int32 [R, max_pages]; context_lens: int32 [R]; query_start: int32 [R+1].
        max_q_len: static bound on any request's tokens in this pass (L+1 for verification, the chunk for
            prefill): the jnp attention's working set.
        hidden_layers: layers whose outputs to return for the drafter (concatenated).

    Returns:
        (final-normed hidden [T, D], new kv, hidden [T, m·D] f32 or None).
    """
    cfg = model.cfg
    page, off = page_slots(block_tables, slot, pos, valid, kv.num_pages, kv.page_size)
    inv_freq = rope_inv_freq(cfg.rope, cfg.head_dim)
    use_kernel = kernels_lib.use_pallas(kernels_lib.KernelConfig.parse(kernels).attention)
    x = model.embed_tokens(tokens[None])  # [1, T, D]
    ks, vs, saved = [], [], {}
    for i, layer in enumerate(model.layers):
        q, k, v = layer.attn.qkv(layer.attn_norm(x))
        q, k = apply_rope(q, pos[None], inv_freq), apply_rope(k, pos[None], inv_freq)
        k_pages, v_pages = write_pages(kv.k[i], k[0], page, off), write_pages(kv.v[i], v[0], page, off)
        if use_kernel:
            a = kernels_lib.ragged_attention(q[0], k_pages, v_pages, block_tables, context_lens, query_start,
                                             max_q_len=max_q_len, use_kernel=True)
        else:
            a = batched_ragged_attention(q[0], k_pages, v_pages, block_tables, context_lens, query_start,
                                         max_q_len=max_q_len)
        x = x + layer.attn.out(a[None])
        x = x + layer.mlp(layer.mlp_norm(x))
        ks.append(k_pages)
        vs.append(v_pages)
        if i in hidden_layers:
            saved[i] = x[0]
    hidden = jnp.concatenate([saved[i] for i in hidden_layers], -1).astype(jnp.float32) if hidden_layers \
        else None
    return model.final_norm(x)[0], PagedKV(k=tuple(ks), v=tuple(vs)), hidden


def drafter_write_flat(model: DrafterModel, kv: PagedKV, feats, slot, pos, valid, block_tables) -> PagedKV:
    """Context entries RMSNorm(fc(feats)) → K/V of every drafter layer, written at the tokens' positions.

    feats [T, m·D]: the target features of the flat tokens (dspark / dflash drafters)."""
    if model.cfg.kind == "eagle3":
        raise ValueError("the paged serving path supports block drafters (dspark, dflash), not eagle3")
    page, off = page_slots(block_tables, slot, pos, valid, kv.num_pages, kv.page_size)
    h = model.project_features(feats[None])  # [1, T, D]
    inv_freq = rope_inv_freq(model.cfg.rope, model.cfg.head_dim)
    ks, vs = [], []
    for i, layer in enumerate(model.layers):
        k, v = layer.context_kv(h, pos[None], inv_freq)
        ks.append(write_pages(kv.k[i], k[0], page, off))
        vs.append(write_pages(kv.v[i], v[0], page, off))
    return PagedKV(k=tuple(ks), v=tuple(vs))


def drafter_cache_view(kv: PagedKV, block_tables, lengths, hidden_size: int) -> DrafterCache:
    """The contiguous DrafterCache that `draft_block` reads, gathered from the pages of each slot."""
    B = block_tables.shape[0]
    return DrafterCache(k=tuple(gather_contiguous(k, block_tables) for k in kv.k),
                        v=tuple(gather_contiguous(v, block_tables) for v in kv.v),
                        lengths=lengths.astype(jnp.int32),
                        last_feature=jnp.zeros((B, hidden_size), kv.k[0].dtype))


__all__ = ["PagedKV", "batched_ragged_attention", "drafter_cache_view", "drafter_write_flat", "gather_contiguous",
           "page_slots", "target_forward_flat", "write_pages"]
