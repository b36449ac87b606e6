"""The CPU attention path of the paged engine (dspark_jax/paged.batched_ragged_attention) against the ragged
kernel's plain-jnp oracle, on ragged batches with idle requests, shuffled pages and GQA."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest

from dspark_jax.paged import batched_ragged_attention
from pallas_kernels.ragged_verify_attention import ragged_verify_attention_reference


@pytest.mark.parametrize("q_lens,ctx_extra,Q", [([3, 0, 8, 1], [5, 0, 17, 40], 8), ([32], [0], 32),
                                                 ([1, 1, 1], [0, 9, 63], 1), ([2, 0, 1, 2], [5, 0, 17, 40], 8),
                                                 ([5, 1], [3, 20], 7), ([0, 0], [4, 0], 8)])
def test_batched_path_equals_the_reference(q_lens, ctx_extra, Q):
    """Blocks shorter than the static bound Q run only the query groups they need (Q = 8: groups of 2; Q = 7:
    groups of 2 over a padded 8), so these cases fail if a needed group were skipped."""
    rng = np.random.default_rng(0)
    R, N, K, H, ps, M = len(q_lens), 6, 2, 16, 8, 9
    P = R * M + 3
    T = max(sum(q_lens), 1) + 5  # padding rows at the end
    q = jnp.asarray(rng.normal(size=(T, N, H)), jnp.float32)
    kp = jnp.asarray(rng.normal(size=(P, K, ps, H)), jnp.float32)
    vp = jnp.asarray(rng.normal(size=(P, K, ps, H)), jnp.float32)
    tables = jnp.asarray(rng.permutation(P)[: R * M].reshape(R, M), jnp.int32)
    ctx = jnp.asarray(np.array(q_lens) + np.array(ctx_extra), jnp.int32)
    qs = jnp.asarray(np.concatenate([[0], np.cumsum(q_lens)]), jnp.int32)
    got = batched_ragged_attention(q, kp, vp, tables, ctx, qs, max_q_len=Q)
    want = ragged_verify_attention_reference(q, kp, vp, tables, ctx, qs, max_q_len=Q)
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), atol=2e-5)
    assert not np.isnan(np.asarray(got)).any()
    np.testing.assert_array_equal(np.asarray(got)[sum(q_lens):], 0.0)


def test_poisoned_positions_beyond_the_context_cannot_leak():
    """The engine's jnp path: K/V slots past each request's context (NaN, huge values: what a freed page may
    hold) change nothing, because values are zeroed as well as scores masked."""
    from test_pallas_ragged_attention import make_inputs

    ps = 16
    args = make_inputs((2, 3, 1), (10, 17, 5), T=8, N=4, K=2, H=16, page_size=ps)
    q, kp, vp, bt, ctx, qs = args
    clean = ragged_verify_attention_reference(*args)
    kp2, vp2 = np.array(kp), np.array(vp)
    for r in range(len(ctx)):
        for pos in range(int(ctx[r]), -(-int(ctx[r]) // ps) * ps):
            kp2[bt[r, pos // ps], :, pos % ps] = 1e30
            vp2[bt[r, pos // ps], :, pos % ps] = np.nan
    unused = sorted(set(range(kp.shape[0])) - set(bt[bt >= 0].tolist()))
    kp2[unused], vp2[unused] = np.nan, np.nan
    out = batched_ragged_attention(q, jnp.asarray(kp2), jnp.asarray(vp2), bt, ctx, qs, max_q_len=3, chunk_tokens=16)
    np.testing.assert_allclose(out, clean, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("options", [{}, dict(anchor_feature=True), dict(anchor_feature=True, anchor_mode="residual"),
                                     dict(anchor_feature=True, anchor_mode="fused"), dict(context_tokens=True),
                                     dict(context_tokens=True, anchor_feature=True)])
def test_paged_block_pass_equals_the_dense_one(tmp_path, options):
    """The engine's drafting pass over pages (context written flat into shuffled pages in two passes, as a
    chunked prefill does, then `drafter_block_hidden_paged`) equals `DrafterModel.block_hidden` over the
    prompt's dense cache (the path tests/test_train_anchors.py ties to training), rows of different lengths.
    With `anchor_feature` the anchor slot reads H_ctx[n−1] from the entry pool, so an off-by-one there fails;
    with `context_tokens` each entry is closed by the next token (the second pass's first ones from the pool)
    and entry n−1 by the anchor."""
    import jax
    from conftest import make_hf_model, target_from_hf
    from flax import nnx

    import dspark_jax
    from dspark_jax.drafter_model import TargetHead
    from dspark_jax.paged import PagedKV, drafter_block_hidden_paged, drafter_write_flat

    target = target_from_hf(make_hf_model("llama", tied=True), tmp_path)
    d = dspark_jax.init_drafter(target, kind="dspark", block_size=4, num_layers=2, seed=1, markov_rank=8, **options)
    flat = nnx.traversals.flatten_mapping(nnx.to_pure_dict(d.params))
    key = jax.random.key(5)
    for i, (k, v) in enumerate(sorted(flat.items())):
        flat[k] = v + 0.05 * jax.random.normal(jax.random.fold_in(key, i), v.shape, v.dtype)
    nnx.replace_by_pure_dict(d.params, nnx.traversals.unflatten_mapping(flat))
    model, head, cfg = d.module(), TargetHead.from_params(target.params, True), d.config
    rng = np.random.default_rng(0)
    B, T, ps, M = 3, 30, 4, 8
    tokens = jnp.asarray(rng.integers(3, 128, size=(B, T)), jnp.int32)
    n = jnp.asarray([29, 7, 16], jnp.int32)  # committed lengths; the anchor sits at position n
    _, _, feats = target.forward(tokens, target.init_cache(B, T), hidden_layers=cfg.target_layers,
                                 compute_logits=False)
    anchor = tokens[jnp.arange(B), n]
    dense = model.block_hidden(head, model.write_prompt(model.init_cache(B, T), head, tokens, feats, n), anchor, n)
    P = B * M + 2
    tables = jnp.asarray(rng.permutation(P)[: B * M].reshape(B, M), jnp.int32)
    kv = PagedKV.init(num_layers=cfg.num_layers, num_pages=P, num_kv_heads=cfg.num_kv_heads, page_size=ps,
                      head_dim=cfg.head_dim, feature_dim=cfg.hidden_size if cfg.keeps_last_feature else 0)
    if cfg.context_tokens:  # a pass's entries are garbage until closed: poison the pools
        kv = PagedKV(k=kv.k + 7.0, v=kv.v - 7.0, feat=kv.feat)
    slot = jnp.repeat(jnp.arange(B, dtype=jnp.int32), T)
    pos = jnp.tile(jnp.arange(T, dtype=jnp.int32), B)
    flat_feats, flat_tokens = feats.reshape(B * T, -1), tokens.reshape(-1)
    for lo, hi in ((0, 11), (11, T)):  # two passes over each row's committed tokens
        sel = np.flatnonzero((np.asarray(pos) >= lo) & (np.asarray(pos) < hi))
        kv = drafter_write_flat(model, kv, flat_feats[sel], slot[sel], pos[sel], (pos < n[slot])[sel], tables,
                                tokens=flat_tokens[sel], first=pos[sel] == lo, embed=head.embed)
    paged = drafter_block_hidden_paged(model, head, kv, tables, n, anchor)
    np.testing.assert_allclose(np.asarray(paged), np.asarray(dense), atol=2e-5)
    assert (kv.feat is not None) == cfg.keeps_last_feature


@pytest.mark.parametrize("eagle_layer", ["fused", "concat"])
def test_paged_eagle_draft_equals_the_dense_one(tmp_path, eagle_layer):
    """EAGLE-3 over pages: its context written flat into shuffled pages in two passes (the second pass's first
    token of each row reads f_{p−1} back from the feature pool, as a verification pass does), then the L
    autoregressive steps of `eagle_step_paged`, equal the dense draft (`drafter._draft_eagle` over
    `write_prompt`'s cache): the same tokens and draft probabilities at T = 1, rows of different lengths."""
    import jax
    from conftest import make_hf_model, target_from_hf
    from test_spec_decode import _drafter

    from dspark_jax.drafter import _draft_eagle, draft_eagle
    from dspark_jax.drafter_model import TargetHead
    from dspark_jax.keys import row_key_data
    from dspark_jax.paged import PagedKV, drafter_write_flat, eagle_step_paged, last_context_entry

    target = target_from_hf(make_hf_model("llama", tied=True), tmp_path)
    d = _drafter(target, "eagle3", 4, seed=1, scramble=0.05, eagle_layer=eagle_layer)
    model, head, cfg = d.module(), TargetHead.from_params(target.params, True), d.config
    rng = np.random.default_rng(0)
    B, T, ps, M = 3, 30, 4, 8
    tokens = jnp.asarray(rng.integers(3, 128, size=(B, T)), jnp.int32)
    n = jnp.asarray([29, 7, 16], jnp.int32)  # committed lengths; the anchor sits at position n
    anchor = tokens[jnp.arange(B), n]
    _, _, feats = target.forward(tokens, target.init_cache(B, T), hidden_layers=cfg.target_layers,
                                 compute_logits=False)
    ones = jnp.ones((B,), jnp.float32)
    sampling = (ones, jnp.zeros((B,), jnp.int32), ones)  # T = 1, no filtering
    keys = jax.vmap(jax.random.wrap_key_data)(jnp.asarray(row_key_data(3, B)))
    dense = _draft_eagle(model, head, model.write_prompt(model.init_cache(B, T), head, tokens, feats, n), anchor,
                         keys, *sampling)
    P = B * M + 2
    tables = jnp.asarray(rng.permutation(P)[: B * M].reshape(B, M), jnp.int32)
    kv = PagedKV.init(num_layers=1, num_pages=P, num_kv_heads=cfg.num_kv_heads, page_size=ps,
                      head_dim=cfg.head_dim, feature_dim=cfg.hidden_size)
    slot = jnp.repeat(jnp.arange(B, dtype=jnp.int32), T)
    pos = jnp.tile(jnp.arange(T, dtype=jnp.int32), B)
    split = jnp.asarray([5, 3, 9], jnp.int32)[slot]  # the first pass covers positions < split, the second the rest
    for first_pass in (True, False):
        valid = (pos < n[slot]) & ((pos < split) if first_pass else (pos >= split))
        first = pos == (0 if first_pass else split)
        kv = drafter_write_flat(model, kv, feats.reshape(B * T, -1), slot, pos, valid, tables,
                                tokens=tokens.reshape(-1), first=first, embed=head.embed)
    step, extra = eagle_step_paged(model, head, kv, tables, n)
    paged = draft_eagle(model, head, step, anchor, last_context_entry(kv, tables, n), extra, keys, *sampling)
    np.testing.assert_array_equal(np.asarray(paged[0]), np.asarray(dense[0]))
    np.testing.assert_allclose(np.asarray(paged[1]), np.asarray(dense[1]), atol=2e-5)
