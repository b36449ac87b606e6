"""The drafter's heads against naive references, and full-size shapes without allocating."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import make_hf_model, target_from_hf
from flax import nnx

import dspark_jax
from dspark_jax.config import ModelConfig
from dspark_jax.drafter import draft_block
from dspark_jax.drafter_config import DrafterConfig
from dspark_jax.drafter_model import DrafterModel, TargetHead
from dspark_jax.keys import row_keys
from dspark_jax.model import Decoder


@pytest.fixture(scope="module")
def target(tmp_path_factory):
    return target_from_hf(make_hf_model("qwen3", tied=False), tmp_path_factory.mktemp("q"))


def _randomised(target, kind="dspark", L=5, seed=0, **kw):
    d = dspark_jax.init_drafter(target, kind=kind, block_size=L, seed=seed, num_layers=2, markov_rank=8, **kw)
    flat = nnx.traversals.flatten_mapping(nnx.to_pure_dict(d.params))
    key = jax.random.key(seed)
    for i, (k, v) in enumerate(sorted(flat.items())):
        flat[k] = v + 0.5 * jax.random.normal(jax.random.fold_in(key, i), v.shape, v.dtype)
    nnx.replace_by_pure_dict(d.params, nnx.traversals.unflatten_mapping(flat))
    return d


def _context(target, drafter, B=3, T=6):
    """A drafter cache filled from a real target prefill of random prompts."""
    from dspark_jax.decoding import prefill
    from dspark_jax.drafter import drafter_prefill

    ids = np.random.default_rng(0).integers(3, 128, size=(B, T)).astype(np.int32)
    lens = np.array([T, T - 2, 3], np.int32)[:B]
    _, _, feats = prefill(target.graphdef, target.params, jnp.asarray(ids), target.init_cache(B, 32),
                          jnp.asarray(lens), hidden_layers=drafter.config.target_layers)
    dcache = drafter_prefill(drafter.graphdef, drafter.params, target.params, drafter.init_cache(B, 32), feats,
                             jnp.asarray(ids), jnp.asarray(lens), tied=False)
    anchor = jnp.asarray(ids[np.arange(B), lens - 1])
    return dcache, anchor


def _greedy_params(B):
    return jnp.zeros((B,)), jnp.zeros((B,), jnp.int32), jnp.ones((B,))


def test_markov_sampler_at_temperature_zero_equals_numpy_argmax_loop(target):
    d = _randomised(target)
    dcache, anchor = _context(target, d)
    head = TargetHead.from_params(target.params, tied=False)
    B = anchor.shape[0]
    tok, probs, conf = draft_block(d.graphdef, d.params, head, dcache, anchor, row_keys(0, B), *_greedy_params(B))
    # Reference: the backbone once, then a plain numpy loop over positions.
    m = d.module()
    h = np.asarray(m.block_hidden(head, dcache, anchor, dcache.lengths))
    U = np.asarray(head.logits(jnp.asarray(h)))
    w1, w2 = np.asarray(m.markov_w1[...]), np.asarray(m.markov_w2[...])
    cw, cb = np.asarray(m.conf_w[...]), float(m.conf_b[...])
    prev = np.asarray(anchor)
    for k in range(d.config.block_size):
        e = w1[prev]
        x = np.argmax(U[:, k] + e @ w2, axis=-1)
        np.testing.assert_array_equal(np.asarray(tok[:, k]), x)
        c = 1 / (1 + np.exp(-(np.concatenate([h[:, k], e], -1) @ cw + cb)))
        np.testing.assert_allclose(np.asarray(conf[:, k]), c, rtol=1e-5, atol=1e-6)
        np.testing.assert_array_equal(np.asarray(probs[:, k]).argmax(-1), x)
        prev = x


def test_rank_zero_markov_head_leaves_backbone_logits_unchanged(target):
    d = dspark_jax.init_drafter(target, kind="dspark", block_size=4, num_layers=2, markov_rank=0, seed=3)
    dcache, anchor = _context(target, d)
    head = TargetHead.from_params(target.params, tied=False)
    B = anchor.shape[0]
    tok, _, _ = draft_block(d.graphdef, d.params, head, dcache, anchor, row_keys(0, B), *_greedy_params(B))
    h = d.module().block_hidden(head, dcache, anchor, dcache.lengths)
    np.testing.assert_array_equal(np.asarray(tok), np.asarray(head.logits(h)).argmax(-1))


def test_rnn_head_matches_naive_recurrence(target):
    d = _randomised(target, head="rnn")
    dcache, anchor = _context(target, d)
    head = TargetHead.from_params(target.params, tied=False)
    B = anchor.shape[0]
    tok, _, _ = draft_block(d.graphdef, d.params, head, dcache, anchor, row_keys(0, B), *_greedy_params(B))
    m = d.module()
    h = np.asarray(m.block_hidden(head, dcache, anchor, dcache.lengths))
    U = np.asarray(head.logits(jnp.asarray(h)))
    w1, w2, wr = (np.asarray(m.markov_w1[...]), np.asarray(m.markov_w2[...]), np.asarray(m.rnn[...]))
    R = w1.shape[1]
    sig = lambda z: 1 / (1 + np.exp(-z))  # noqa: E731
    s, prev = np.zeros((B, R)), np.asarray(anchor)
    for k in range(d.config.block_size):
        z = np.concatenate([s, w1[prev], h[:, k]], -1) @ wr  # eq. 6, gate | candidate | output
        g, c, o = z[:, :R], z[:, R:2 * R], z[:, 2 * R:]
        s = sig(g) * s + (1 - sig(g)) * np.tanh(c)
        x = np.argmax(U[:, k] + np.tanh(o) @ w2, -1)
        np.testing.assert_array_equal(np.asarray(tok[:, k]), x)
        prev = x


def test_calibration_temperatures_scale_confidence_logits(target):
    d = _randomised(target, L=3)
    dcache, anchor = _context(target, d)
    head = TargetHead.from_params(target.params, tied=False)
    B = anchor.shape[0]
    _, _, raw = draft_block(d.graphdef, d.params, head, dcache, anchor, row_keys(0, B), *_greedy_params(B))
    cal = d.with_config(calibration=(1.0, 2.0, 0.5))
    _, _, scaled = draft_block(cal.graphdef, cal.params, head, dcache, anchor, row_keys(0, B), *_greedy_params(B))
    logit = np.log(np.asarray(raw)) - np.log1p(-np.asarray(raw))
    expect = 1 / (1 + np.exp(-logit / np.array([1.0, 2.0, 0.5])))
    np.testing.assert_allclose(np.asarray(scaled), expect, rtol=1e-4, atol=1e-6)
    # With logit offsets (train/calibrate.py's sequential_calibration): c_k = σ(z_k / T_k + b_k).
    off = d.with_config(calibration=(1.0, 2.0, 0.5), calibration_offsets=(0.5, -1.0, 0.25))
    _, _, shifted = draft_block(off.graphdef, off.params, head, dcache, anchor, row_keys(0, B), *_greedy_params(B))
    expect = 1 / (1 + np.exp(-(logit / np.array([1.0, 2.0, 0.5]) + np.array([0.5, -1.0, 0.25]))))
    np.testing.assert_allclose(np.asarray(shifted), expect, rtol=1e-4, atol=1e-6)
    with pytest.raises(ValueError, match="calibration_offsets"):
        d.with_config(calibration=(), calibration_offsets=(0.5, -1.0, 0.25))


def test_config_errors_are_clear(target):
    with pytest.raises(ValueError, match="unknown drafter kind"):
        dspark_jax.init_drafter(target, kind="medusa")
    with pytest.raises(ValueError, match="out of range"):
        dspark_jax.init_drafter(target, target_layers=(0, 99))
    with pytest.raises(ValueError, match="one layer"):
        dspark_jax.init_drafter(target, kind="eagle3", num_layers=2)


QWEN3_8B = dict(model_type="qwen3", vocab_size=151936, hidden_size=4096, intermediate_size=12288,
                num_hidden_layers=36, num_attention_heads=32, num_key_value_heads=8, head_dim=128,
                rms_norm_eps=1e-6, rope_theta=1000000.0, max_position_embeddings=40960,
                tie_word_embeddings=False, eos_token_id=151645)


def test_full_size_qwen3_8b_with_dspark_drafter_eval_shape():
    """Shapes of a full Qwen3-8B target + DSpark drafter, and of one speculative round's draft and verification
    programs over paged caches (dspark_jax/runner.py), without allocating."""
    from dspark_jax.paged import PagedKV
    from dspark_jax.policy import Policy
    from dspark_jax.runner import DeviceBatch, Static, draft_program, verify_program

    cfg = ModelConfig.from_hf(QWEN3_8B)
    tgt = nnx.eval_shape(lambda: Decoder(cfg, dtype=jnp.bfloat16, rngs=nnx.Rngs(0)))
    dcfg = DrafterConfig.for_target(cfg, kind="dspark")
    drf = nnx.eval_shape(lambda: DrafterModel(dcfg, dtype=jnp.bfloat16, rngs=nnx.Rngs(0)))
    tg, tp = nnx.split(tgt)
    dg, dp = nnx.split(drf)
    n_target = sum(int(np.prod(x.shape)) for x in jax.tree.leaves(tp))
    assert 8.0e9 < n_target < 8.4e9  # Qwen3-8B: 8.19B parameters
    B, S, L, ps = 4, 1024, dcfg.block_size, 16
    M = S // ps
    sds = jax.ShapeDtypeStruct
    pool = dict(num_pages=B * M, page_size=ps, dtype=jnp.bfloat16)
    tkv = jax.eval_shape(lambda: PagedKV.init(num_layers=36, num_kv_heads=8, head_dim=128, **pool))
    dkv = jax.eval_shape(lambda: PagedKV.init(num_layers=dcfg.num_layers, num_kv_heads=dcfg.num_kv_heads,
                                              head_dim=dcfg.head_dim, **pool))
    i32, f32 = (lambda *s: sds(s, jnp.int32)), (lambda *s: sds(s, jnp.float32))
    batch = DeviceBatch(active=sds((B,), bool), lengths=i32(B), anchors=i32(B), block_tables=i32(B, M),
                        temperature=f32(B), top_k=i32(B), top_p=f32(B), min_p=f32(B), bias_ids=i32(B, 64),
                        bias=f32(B, 64), ban_until=i32(B), keys=sds((B, 2), jnp.uint32),
                        rounds=i32(B), logprobs=sds((B,), bool))
    draft, q, conf = jax.eval_shape(
        lambda tp_, dp_, dkv_, b: draft_program(tp_, dp_, None, dkv_, b.block_tables, b.lengths, b.anchors,
                                                b.keys, b.rounds, b.temperature, b.top_k, b.top_p,
                                                drafter_graph=Static(dg), tied=False, kernels="reference"),
        tp, dp, dkv, batch)
    assert draft.shape == (B, L) and q.shape == (B, L, cfg.vocab_size) and conf.shape == (B, L)
    out = jax.eval_shape(
        lambda tp_, dp_, tkv_, dkv_, b, d, q_, c: verify_program(
            tp_, dp_, tkv_, dkv_, b, d, q_, c, jnp.int32(0), target_graph=Static(tg), drafter_graph=Static(dg),
            capacity=B * (L + 1),
            mode="policy", block_size=L, hidden_layers=dcfg.target_layers, kernels="reference",
            policy=Policy(kind="dspark-sync")),
        tp, dp, tkv, dkv, batch, draft, q, conf)
    assert out[2].shape == (B, L + 1) and out[5].shape == (B,)
    assert out[0].k.shape == (36, B * M, 8, ps, 128)
