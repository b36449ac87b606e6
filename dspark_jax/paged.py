"""Paged KV caches and the flat (ragged) forward that serving runs on them.

Layout (the ragged verification kernel's, pallas_kernels/ragged_verify_attention.py, per layer): k, v
[num_layers, P, K, page_size, H] — per layer a pool of P pages shared by all requests, the layers stacked as
the target's stacked parameters are (model.stacked_layers), so the forward scans over both. Request slot b
owns the pages block_tables[b, :] in order, so its cache position p lives at
(block_tables[b, p // page_size], p % page_size).
The host allocates pages (serve/pages.py); the device only reads tables. Page id P (one past the pool) is the
"no page" sentinel: writes there are dropped.

The flat forward runs the target over T query tokens of R requests packed back to back (padded to a
capacity bucket): token t belongs to request slot[t] at absolute position pos[t]; request r's tokens are rows
query_start[r] .. query_start[r+1]−1 and context_lens[r] = its cached tokens including these. Projections and
MLPs cost ∝ T (the bucket), not R × the longest block: that is what lets the scheduler trade draft tokens for
batch slots. Attention goes through dspark_jax.kernels (Pallas kernel on GPU/TPU, the jnp reference here).

The drafter's injected context (KV injection) is paged the same way, in its own pool, under the same block
tables: context entry p of a request is written at the same (page, offset) as the target's position p. EAGLE-3's
entry p is [embedding(x_{p+1}); f_p] (so entries 0..n−2 exist at n committed tokens), and its fused features f_p
are kept in the feature pool, where the next pass and the first draft step read f_{n−1} (`closing_write_flat`).
A block drafter with `context_tokens` pairs its entries the same way (f_p + RMSNorm(embedding(x_{p+1}))·W); its
block pass makes entry n−1 from the pool's f_{n−1} and the anchor.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import struct

from dspark_jax import kernels as kernels_lib
from dspark_jax.drafter_model import DrafterModel, TargetHead
from dspark_jax.layers import rope_angles, rope_inv_freq, rotate
from dspark_jax.model import Decoder, concat_saved, hidden_slots, scan_layers


@struct.dataclass
class PagedKV:
    """k, v: [num_layers, P, K, page_size, H]; feat: the drafter's context entries H_ctx [P, 1, page_size, D]
    when its anchor slot reads H_ctx[n−1] (`anchor_feature`), else None; ids: the token id at every cached
    position, int32 [P, page_size] (the target's pool: `target_forward_flat` writes them; the penalties read a
    request's history from them, dspark_jax/penalties.py), else None."""

    k: jax.Array
    v: jax.Array
    feat: jax.Array | None = None
    ids: jax.Array | None = None

    @classmethod
    def init(cls, *, num_layers: int, num_pages: int, num_kv_heads: int, page_size: int, head_dim: int,
             dtype=jnp.float32, sharding=None, feature_dim: int = 0, feature_sharding=None,
             token_ids: bool = False) -> PagedKV:
        """Zero pools; with `sharding` (dspark_jax/sharding.py's `paged_sharding`) each device allocates only
        its own shard, so a pool larger than one device's memory can be built on a mesh. `feature_dim` > 0 adds
        the pool of context entries (`feat`), `token_ids` the pool of token ids (`ids`), both placed by
        `feature_sharding`."""
        shape = (num_layers, num_pages, num_kv_heads, page_size, head_dim)
        feat = (jnp.zeros((num_pages, 1, page_size, feature_dim), dtype, device=feature_sharding)
                if feature_dim else None)
        ids = jnp.zeros((num_pages, page_size), jnp.int32, device=feature_sharding) if token_ids else None
        return cls(k=jnp.zeros(shape, dtype, device=sharding), v=jnp.zeros(shape, dtype, device=sharding), feat=feat,
                   ids=ids)

    @property
    def num_pages(self) -> int:
        return self.k.shape[1]

    @property
    def page_size(self) -> int:
        return self.k.shape[3]


def page_slots(block_tables, slot, pos, valid, num_pages: int, page_size: int):
    """(page id, offset) of each token [T]; invalid tokens get the dropped page id `num_pages`."""
    page = block_tables[slot, pos // page_size]
    return jnp.where(valid, page, num_pages), pos % page_size


def write_pages(pages: jax.Array, new: jax.Array, page, offset, layer=None) -> jax.Array:
    """pages [P, K, page_size, H] ← new [T, K, H] at (page [T], offset [T]); page ≥ P is dropped. With `layer`
    (a traced index), pages is a stacked pool [num_layers, P, K, page_size, H] written in place at that layer."""
    if layer is None:
        return pages.at[page, :, offset].set(new.astype(pages.dtype), mode="drop")
    return pages.at[layer, page, :, offset].set(new.astype(pages.dtype), mode="drop")


def _gather_pages(pages: jax.Array, ids, layer):
    """pages[ids] of a pool [P, ...], or pages[layer, ids] of a stacked pool: one gather either way, so a layer's
    pool is never sliced out (a copy of the whole pool) to read a few pages of it."""
    return pages[ids] if layer is None else pages[layer, ids]


_HIGHEST = jax.lax.Precision.HIGHEST


def _chunk_pages(page_size: int, chunk_tokens: int) -> int:
    """Pages per loop iteration of `paged_attention_partial` (at least one page)."""
    return max(1, chunk_tokens // page_size)


def paged_attention_partial(q, k_pages, v_pages, block_tables, context_lens, q_pos=None, *,
                            chunk_tokens: int = 128, num_queries=None, query_groups: int = 4, layer=None):
    """Online-softmax attention of dense query blocks over each request's *used* pages (the CPU path).

    A `lax.while_loop` walks the page tables in chunks of `chunk_tokens` positions up to the longest context
    of the batch, so the cost follows the live context lengths, not `max_model_len`, and one compiled program
    serves every length. Keys at positions ≥ context_lens[r] are masked in the scores *and* their values are
    zeroed, so whatever a page held before (another request's values, even NaN) cannot leak into the output.

    Layout: the (request, kv head) pair is the batch of every product and a kv head's Q·G queries are its rows,
    and the gathered pages are contracted as they lie ([R, C, K, page, H], no transposed copy). On XLA:CPU this
    is faster than contracting [R, Q, K, G, H] queries against transposed pages at every shape tried (1–16
    requests × 1–8 queries, context 64–512); 128 positions a step mask fewer positions at short contexts than
    256 and cost little loop overhead at long ones.

    Args:
        q: [R, Q, N, H] queries of request r.
        k_pages, v_pages: [P, K, page_size, H], or stacked pools [num_layers, P, K, page_size, H] read at `layer`.
        block_tables: int32 [R, M]; context_lens: int32 [R] (keys 0..context_lens[r]−1 exist).
        q_pos: int32 [R, Q] absolute query positions for a causal mask (key pos ≤ query pos), or None
            (every existing key visible: the drafter's context).
        chunk_tokens: positions gathered per iteration.
        num_queries: int32 scalar (traced): only queries 0..num_queries−1 of each request are needed, or None
            (all Q). The Q queries are split into `query_groups` groups of ⌈Q/groups⌉ and, inside each chunk
            of gathered pages, a loop runs over the groups that hold a needed query only, so the scores and
            softmax work (most of the cost here) follow the longest real block of the pass, not the static Q:
            a verification pass whose rows draft ℓ ≤ 1 costs two queries per row, not L + 1. The pages are
            gathered once per chunk either way. Queries past num_queries get no key (zeros out of
            `finish_attention`).

    Returns:
        (acc [R, K, Q·G, H] f32 unnormalised, running max m [R, K, Q·G], denominator l [R, K, Q·G]) with query
        (t, g) of kv head k at row t·G + g; `finish_attention` turns them into outputs, `merge_block_keys` adds a
        dense block of extra keys first.
    """
    R, Q, N, H = q.shape
    P, K, page_size, _ = k_pages.shape[-4:]
    block_tables, context_lens = jnp.asarray(block_tables), jnp.asarray(context_lens)
    M = block_tables.shape[1]
    G = N // K
    chunk_pages = _chunk_pages(page_size, chunk_tokens)
    S = chunk_pages * page_size
    q_rows = _query_rows(q, K)
    q_pos_rows = None if q_pos is None else jnp.repeat(q_pos, G, axis=1)  # [R, Q·G]
    num_chunks = (jnp.max(context_lens) + S - 1) // S

    groups = 1 if num_queries is None else max(1, min(query_groups, Q))
    QB = -(-Q // groups)  # queries per group; Q is padded to groups · QB
    Qp = groups * QB
    if Qp > Q:
        q_rows = jnp.pad(q_rows.reshape(R, K, Q, G, H), ((0, 0), (0, 0), (0, Qp - Q), (0, 0), (0, 0)))
        q_rows = q_rows.reshape(R, K, Qp * G, H)
        if q_pos_rows is not None:
            q_pos_rows = jnp.pad(q_pos_rows, ((0, 0), (0, (Qp - Q) * G)), constant_values=-1)

    def scores_update(state, q_group, q_pos_group, exists, kpos, k, v):
        """One group's queries q_group [R, K, m, H] against one chunk of keys: the online-softmax step."""
        m = q_group.shape[2]
        s = jnp.einsum("RKMH,RCKPH->RKMCP", q_group, k, precision=_HIGHEST).reshape(R, K, m, S)
        visible = exists[:, None, :]  # [R, 1 | m, S]; a key that does not exist stays hidden whatever it holds
        if q_pos_group is not None:
            visible = visible & (kpos[None, None, :] <= q_pos_group[:, :, None])
        s = jnp.where(visible[:, None], s, -jnp.inf)
        return _online_update(state, s, lambda p: jnp.einsum(
            "RKMCP,RCKPH->RKMH", p.reshape(R, K, m, chunk_pages, page_size), v, precision=_HIGHEST))

    def body(c, state):
        idx = jnp.clip(c * chunk_pages + jnp.arange(chunk_pages), 0, M - 1)
        pages = jnp.clip(block_tables[:, idx], 0, P - 1)  # [R, chunk_pages]
        kpos = c * S + jnp.arange(S)  # [S]
        exists = kpos[None] < context_lens[:, None]  # [R, S]
        k = _gather_pages(k_pages, pages, layer).astype(jnp.float32)  # [R, chunk_pages, K, page_size, H]
        v = _gather_pages(v_pages, pages, layer).astype(jnp.float32)
        v = jnp.where(exists.reshape(R, chunk_pages, 1, page_size, 1), v, 0.0)
        if groups == 1:
            return scores_update(state, q_rows, q_pos_rows, exists, kpos, k, v)

        def group(g, state):  # rows g·QB·G .. (g+1)·QB·G − 1 of the query-major layout are group g's queries
            at, size = g * QB * G, QB * G

            def cut(x):
                return jax.lax.dynamic_slice_in_dim(x, at, size, axis=2)

            q_pos_group = None if q_pos_rows is None else jax.lax.dynamic_slice_in_dim(q_pos_rows, at, size, axis=1)
            new = scores_update(tuple(cut(x) for x in state), cut(q_rows), q_pos_group, exists, kpos, k, v)
            return tuple(jax.lax.dynamic_update_slice_in_dim(x, n, at, axis=2)
                         for x, n in zip(state, new, strict=True))

        return jax.lax.fori_loop(0, (jnp.minimum(num_queries, Q) + QB - 1) // QB, group, state)

    init = (jnp.zeros((R, K, Qp * G, H), jnp.float32), jnp.full((R, K, Qp * G), -jnp.inf, jnp.float32),
            jnp.zeros((R, K, Qp * G), jnp.float32))
    state = jax.lax.fori_loop(0, num_chunks, body, init)
    return state if Qp == Q else tuple(x[:, :, : Q * G] for x in state)


def _query_rows(q, K: int):
    """q [R, Q, N, H] → [R, K, Q·G, H] f32 scaled by 1/√H: kv head k's queries as rows t·G + g."""
    R, Q, N, H = q.shape
    G = N // K
    q_rows = q.reshape(R, Q, K, G, H).transpose(0, 2, 1, 3, 4).reshape(R, K, Q * G, H)
    return q_rows.astype(jnp.float32) / jnp.sqrt(jnp.float32(H))


def _online_update(state, s, weighted_values):
    """One online-softmax step: scores s [R, K, M, S] (−inf = hidden); `weighted_values(p)` = p · v [R, K, M, H]."""
    acc, m, l = state
    m_new = jnp.maximum(m, jnp.max(s, axis=-1))
    m_safe = jnp.where(jnp.isfinite(m_new), m_new, 0.0)
    p = jnp.exp(s - m_safe[..., None])  # hidden keys: exp(−inf) = 0
    scale = jnp.exp(jnp.where(jnp.isfinite(m), m - m_safe, -jnp.inf))
    l = l * scale + jnp.sum(p, axis=-1)
    acc = acc * scale[..., None] + weighted_values(p)
    return acc, m_new, l


def merge_block_keys(state, q, k, v, mask):
    """Adds a dense block of keys to an online-softmax state: q [R, Q, N, H], k, v [R, T, K, H],
    mask bool [R, Q, T] (True = visible). Used by the drafter, whose block also attends to itself."""
    K = k.shape[2]
    G = q.shape[2] // K
    q_rows = _query_rows(q, K)
    s = jnp.einsum("RKMH,RTKH->RKMT", q_rows, k.astype(jnp.float32), precision=_HIGHEST)
    s = jnp.where(jnp.repeat(mask, G, axis=1)[:, None], s, -jnp.inf)
    return _online_update(state, s, lambda p: jnp.einsum("RKMT,RTKH->RKMH", p, v.astype(jnp.float32),
                                                         precision=_HIGHEST))


def finish_attention(state, dtype, num_queries: int) -> jax.Array:
    """Online-softmax state of `num_queries` queries per request → outputs [R, Q, N, H]; a query that saw no
    key gets zeros."""
    acc, _, l = state
    R, K, M, H = acc.shape
    Q = num_queries
    o = acc / jnp.where(l > 0, l, 1.0)[..., None]
    return o.reshape(R, K, Q, M // Q, H).transpose(0, 2, 1, 3, 4).reshape(R, Q, K * (M // Q), H).astype(dtype)


def batched_ragged_attention(q, k_pages, v_pages, block_tables, context_lens, query_start, *, max_q_len: int,
                             chunk_tokens: int = 128, layer=None):
    """Plain-jnp ragged paged attention (the CPU path; the Pallas kernel serves GPU/TPU and
    `ragged_verify_attention_reference` stays the oracle). Same contract as the kernel:
    q [T, N, H], pages [P, K, page_size, H], block_tables [R, M], context_lens [R], query_start [R+1] → [T, N, H]
    (stacked pools [num_layers, P, K, page_size, H] are read at `layer`, see `paged_attention_partial`).

    Each request's ≤ max_q_len queries are gathered into a dense [R, Q, N, H] block; attention then walks only
    the pages in use (`paged_attention_partial`), causally by absolute position, and computes only the query
    groups up to the pass's longest real block (max_q_len is the static bound, not the cost).
    """
    T, N, H = q.shape
    Q = max_q_len
    context_lens, query_start = jnp.asarray(context_lens), jnp.asarray(query_start)
    i = jnp.arange(Q, dtype=jnp.int32)
    q_len = query_start[1:] - query_start[:-1]  # [R]
    rows = query_start[:-1, None] + i  # [R, Q]
    valid = i[None] < q_len[:, None]
    q_blocks = q[jnp.clip(rows, 0, T - 1)]  # [R, Q, N, H]
    pos = (context_lens - q_len)[:, None] + i  # absolute position of each query [R, Q]
    state = paged_attention_partial(q_blocks, k_pages, v_pages, block_tables, context_lens, pos,
                                    chunk_tokens=chunk_tokens, num_queries=jnp.max(q_len), layer=layer)
    o = finish_attention(state, jnp.float32, Q)
    o = jnp.where(valid[:, :, None, None], o, 0.0).reshape(-1, N, H)
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
        (final-normed hidden [T, D], new kv (with the tokens' ids where it keeps them), hidden [T, m·D] f32
        or None).
    """
    cfg = model.cfg
    page, offset = page_slots(block_tables, slot, pos, valid, kv.num_pages, kv.page_size)
    kernels = kernels_lib.KernelConfig.parse(kernels)
    use_kernel = kernels.pallas("attention")
    x = model.embed_tokens(tokens[None])  # [1, T, D]
    angles = rope_angles(pos[None], rope_inv_freq(cfg.rope, cfg.head_dim), x.dtype)
    slots = hidden_slots(cfg.num_layers, tuple(hidden_layers))
    saved = jnp.zeros((len(hidden_layers), *x.shape[1:]), x.dtype)

    def body(layer, carry, _):
        x, k_pool, v_pool, saved, i = carry

        def attend(q, k, v):
            # The pools ride in the carry and are written in place at layer i (the round's programs donate them).
            k_written = write_pages(k_pool, k[0], page, offset, i)
            v_written = write_pages(v_pool, v[0], page, offset, i)
            if use_kernel:
                a = kernels_lib.ragged_attention(q[0], k_written, v_written, block_tables, context_lens,
                                                 query_start, max_q_len=max_q_len, use_kernel=True, layer=i,
                                                 mesh=kernels.mesh)
            else:
                a = batched_ragged_attention(q[0], k_written, v_written, block_tables, context_lens,
                                             query_start, max_q_len=max_q_len, layer=i)
            return a[None], (k_written, v_written)

        x, (k_pool, v_pool) = layer.block(x, lambda t: rotate(t, angles), attend)
        if hidden_layers:
            saved = saved.at[slots[i]].set(x[0], mode="drop")
        return (x, k_pool, v_pool, saved, i + 1), None

    (x, k_pool, v_pool, saved, _), _ = scan_layers(model.layers, body, (x, kv.k, kv.v, saved, 0))
    hidden = concat_saved(saved) if hidden_layers else None
    ids = None if kv.ids is None else kv.ids.at[page, offset].set(tokens.astype(jnp.int32), mode="drop")
    return model.final_norm(x)[0], PagedKV(k=k_pool, v=v_pool, ids=ids), hidden


def drafter_write_flat(model: DrafterModel, kv: PagedKV, feats, slot, pos, valid, block_tables, *, tokens=None,
                       first=None, embed=None) -> PagedKV:
    """The drafter's context entries for the flat tokens of a pass (prefill chunk or verification), written at
    their pages.

    dspark / dflash: entry p = RMSNorm(fc(feats_p)) → K/V of every drafter layer at position p (and into the
    feature pool with `anchor_feature`). Entries that pair with the next token (eagle3, `context_tokens`) are
    closed one token late (`closing_write_flat`), which also needs the tokens [T], which rows are each
    request's first of the pass (`first` [T]) and the target's embedding `embed` [V, D].

    feats [T, m·D]: the target features of the flat tokens."""
    if model.cfg.kind == "eagle3" or model.cfg.context_tokens:
        return closing_write_flat(model, kv, embed, feats, tokens, slot, pos, valid, first, block_tables)
    page, offset = page_slots(block_tables, slot, pos, valid, kv.num_pages, kv.page_size)
    h = model.project_features(feats[None])  # [1, T, D]
    feat = write_pages(kv.feat, h[0][:, None], page, offset) if model.cfg.anchor_feature else kv.feat
    return _write_entries(model, kv, h, pos, page, offset, feat)


def _write_entries(model: DrafterModel, kv: PagedKV, h, pos, page, offset, feat) -> PagedKV:
    """Context entries h [1, T, D] at positions pos [T] → every drafter layer's K/V, written at (page, offset)
    [T] (DrafterModel._write_entries, paged); `feat` is the feature pool to keep."""
    inv_freq = rope_inv_freq(model.cfg.rope, model.cfg.head_dim)
    k_pool, v_pool = kv.k, kv.v
    for i, layer in enumerate(model.layers):  # a drafter's few layers, unrolled
        k, v = layer.context_kv(h, pos[None], inv_freq)
        k_pool, v_pool = write_pages(k_pool, k[0], page, offset, i), write_pages(v_pool, v[0], page, offset, i)
    return PagedKV(k=k_pool, v=v_pool, feat=feat)


def closing_write_flat(model: DrafterModel, kv: PagedKV, embed, feats, tokens, slot, pos, valid, first,
                       block_tables) -> PagedKV:
    """Context entries that pair a feature with the next token, for the flat tokens of a pass
    (DrafterModel.write_prompt / write_context, paged): EAGLE-3's entry p is [embedding(x_{p+1}); f_p], a
    block drafter's with `context_tokens` f_p + RMSNorm(embedding(x_{p+1}))·W (`DrafterModel.context_entry`).

    Token t (x at pos[t]) therefore closes entry pos[t]−1, whose feature is the previous flat token's (same
    request) or, for a request's first token of the pass (`first`), f_{pos−1} read back from the feature pool,
    where every pass stores its tokens' features f_p at p. So after a pass over positions n..n+ℓ with m
    accepted, entries 0..n+m−1 hold, and the pool's f_{n+m} is what the next draft reads: EAGLE-3's first step,
    the block pass's entry n+m with the anchor. Entries past the accepted ones are rewritten by the next pass
    before anything reads them.

    embed [V, D]; feats [T, m·D]; tokens, slot, pos [T]; valid, first bool [T]."""
    fused = model.project_features(feats[None])[0]  # [T, D]
    prev_pos = jnp.maximum(pos - 1, 0)
    prev_page, prev_off = page_slots(block_tables, slot, prev_pos, valid, kv.num_pages, kv.page_size)
    stored = kv.feat[jnp.clip(prev_page, 0, kv.num_pages - 1), 0, prev_off].astype(fused.dtype)  # f_{pos−1}
    prev = jnp.where(first[:, None], stored, jnp.roll(fused, 1, axis=0))
    page, offset = page_slots(block_tables, slot, pos, valid, kv.num_pages, kv.page_size)
    feat = write_pages(kv.feat, fused[:, None], page, offset)
    head = TargetHead(embed=embed, lm_head=None)
    if model.cfg.kind == "eagle3":  # one layer
        x = model.eagle_input(head, tokens[None], prev[None])
        h = x if model.concat else model.layers[0].attn_norm(x)
    else:
        h = model.context_entry(head, tokens[None], prev[None])
    entry_page, entry_off = page_slots(block_tables, slot, prev_pos, valid & (pos > 0), kv.num_pages, kv.page_size)
    return _write_entries(model, kv, h, prev_pos, entry_page, entry_off, feat)


def last_context_entry(kv: PagedKV, block_tables, lengths) -> jax.Array:
    """H_ctx[n−1] of each row [B, D] from the entry pool (rows with no context read a harmless entry)."""
    pos = jnp.maximum(lengths - 1, 0)
    page = block_tables[jnp.arange(lengths.shape[0]), pos // kv.page_size]
    return kv.feat[page, 0, pos % kv.page_size]


def _layer_paged(layer, xn, residual, angles, kv: PagedKV, block_tables, context_lens, index: int, block_keys, *,
                 chunk_tokens: int = 128):
    """One drafter layer whose queries read the injected context from pages and a dense block of keys.

    xn [B, T, D'] the layer's (normed) attention input; residual [B, T, D] the stream its output adds to;
    context entries 0..context_lens[b]−1 of row b at layer `index` of the pools; block_keys(k, v) → (keys,
    values [B, J, K, H], mask bool [B, T, J]) from this pass's own k, v [B, T, K, H] (RoPE applied).
    Returns (the layer's output [B, T, D], (k, v))."""
    q, k, v = layer.attn.qkv(xn)
    q, k = rotate(q, angles), rotate(k, angles)
    state = paged_attention_partial(q, kv.k, kv.v, block_tables, context_lens, None, chunk_tokens=chunk_tokens,
                                    layer=index)
    a = finish_attention(merge_block_keys(state, q, *block_keys(k, v)), residual.dtype, q.shape[1])
    y = residual + layer.attn.out(a)
    return y + layer.mlp(layer.mlp_norm(y)), (k, v)


def drafter_block_hidden_paged(model: DrafterModel, head, kv: PagedKV, block_tables, lengths, anchor, *,
                               chunk_tokens: int = 128):
    """The drafter's parallel block pass (DrafterModel.block_hidden) reading its injected context from pages.

    anchor [B] sits at position lengths [B] (= committed tokens n); context entries 0..n−1 of row b live in
    block_tables[b]'s pages (with `context_tokens`, 0..n−2: entry n−1 pairs with the anchor and is made here,
    as `DrafterModel.close_last_entry` does). Each block query attends to the whole context (online softmax over
    used pages only) and bidirectionally to the block. Returns h [B, L, D].
    """
    cfg = model.cfg
    last = last_context_entry(kv, block_tables, lengths) if cfg.keeps_last_feature else None  # H_ctx[n−1]
    x, positions = model.block_inputs(head, anchor, lengths, last)
    B, n_in = positions.shape
    inv_freq = rope_inv_freq(cfg.rope, cfg.head_dim)
    angles = rope_angles(positions, inv_freq, x.dtype)
    block_mask = jnp.ones((B, n_in, n_in), bool)
    context_lens = lengths
    if cfg.context_tokens:  # entry n−1 pairs with the anchor: the pages hold 0..n−2, this pass makes n−1
        context_lens = jnp.maximum(lengths - 1, 0)
        entry = model.context_entry(head, anchor[:, None], last[:, None])  # [B, 1, D]
        block_mask = jnp.ones((B, n_in, n_in + 1), bool)
    for i, layer in enumerate(model.layers):
        entry_kv = layer.context_kv(entry, context_lens[:, None], inv_freq) if cfg.context_tokens else None

        def block_keys(k, v, entry_kv=entry_kv):  # the block's own keys, after entry n−1's where it is made here
            if entry_kv is None:
                return k, v, block_mask
            ek, ev = entry_kv
            return jnp.concatenate([ek.astype(k.dtype), k], 1), jnp.concatenate([ev.astype(v.dtype), v], 1), block_mask

        x, _ = _layer_paged(layer, layer.attn_norm(x), x, angles, kv, block_tables, context_lens, i, block_keys,
                            chunk_tokens=chunk_tokens)
    return model.block_output(x)


def eagle_step_paged(model: DrafterModel, head: TargetHead, kv: PagedKV, block_tables, lengths, *,
                     chunk_tokens: int = 128):
    """EAGLE-3's draft step (DrafterModel.eagle_step) over the paged context of rows with `lengths` [B] = n
    committed tokens: context entries 0..n−2 (`closing_write_flat`), step k at position n−1+k.

    Returns (step, extra0) for `drafter.draft_eagle`: step(token [B], feature [B, D], k, extra) → (pre-norm
    output [B, D], final-normed h [B, D], extra), where extra = (k, v) [B, L, K, H] of the steps drafted so far;
    step k attends to the context, to steps 0..k−1 and to itself."""
    cfg = model.cfg
    L, B = cfg.block_size, lengths.shape[0]
    context_lens = jnp.maximum(lengths - 1, 0)
    inv_freq = rope_inv_freq(cfg.rope, cfg.head_dim)
    layer = model.layers[0]

    def step(token, feature, k, extra):
        drafted_k, drafted_v = extra
        x = model.eagle_input(head, token[:, None], feature[:, None])  # [B, 1, D] ([B, 1, 2D] concat)
        angles = rope_angles((context_lens + k)[:, None], inv_freq, x.dtype)
        seen = jnp.broadcast_to((jnp.arange(L) <= k)[None, None], (B, 1, L))

        def block_keys(new_k, new_v):  # this step's key joins the drafted ones at slot k
            nonlocal drafted_k, drafted_v
            drafted_k = jax.lax.dynamic_update_index_in_dim(drafted_k, new_k[:, 0].astype(drafted_k.dtype), k, 1)
            drafted_v = jax.lax.dynamic_update_index_in_dim(drafted_v, new_v[:, 0].astype(drafted_v.dtype), k, 1)
            return drafted_k, drafted_v, seen

        xn, residual = (x, feature[:, None].astype(x.dtype)) if model.concat else (layer.attn_norm(x), x)
        y, _ = _layer_paged(layer, xn, residual, angles, kv, block_tables, context_lens, 0, block_keys,
                            chunk_tokens=chunk_tokens)
        return y[:, 0], model.final_norm(y)[:, 0], (drafted_k, drafted_v)

    shape = (B, L, cfg.num_kv_heads, cfg.head_dim)
    return step, (jnp.zeros(shape, kv.k.dtype), jnp.zeros(shape, kv.k.dtype))


__all__ = ["PagedKV", "batched_ragged_attention", "drafter_block_hidden_paged", "drafter_write_flat",
           "eagle_step_paged", "closing_write_flat", "finish_attention", "last_context_entry", "merge_block_keys",
           "page_slots", "paged_attention_partial", "target_forward_flat", "write_pages"]
