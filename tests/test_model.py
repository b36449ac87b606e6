"""The target decoder against Hugging Face transformers (PyTorch) on tiny random Llama and Qwen3 models."""

from __future__ import annotations

import numpy as np
import pytest
from conftest import hf_logits, make_hf_model, rewrite_config, target_from_hf

from dspark_jax.config import ModelConfig
from dspark_jax.target import Target
from dspark_jax.weights import build_decoder, read_hf_dir

CASES = [
    ("llama", True, {}),
    ("llama", False, {}),
    ("qwen3", True, {}),
    ("qwen3", False, {}),
    # Llama 3.1 rope scaling and biased attention, as some Llama-family checkpoints have.
    ("llama", False, {"attention_bias": True, "max_position_embeddings": 512,
                      "rope_parameters": {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0,
                                          "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                                          "original_max_position_embeddings": 64}}),
]
IDS = [f"{m}-{'tied' if t else 'untied'}{'-' + '-'.join(o) if o else ''}" for m, t, o in CASES]


def _ids(B, T, seed=0, vocab=128):
    return np.random.default_rng(seed).integers(3, vocab, size=(B, T)).astype(np.int32)


@pytest.mark.parametrize("model_type,tied,overrides", CASES, ids=IDS)
def test_full_forward_matches_transformers(model_type, tied, overrides, tmp_path):
    hf = make_hf_model(model_type, tied=tied, **overrides)
    target = target_from_hf(hf, tmp_path)
    ids = _ids(2, 80)  # > original_max_position_embeddings so llama3 scaling bands matter
    ours = np.asarray(target.logits(ids))
    ref = hf_logits(hf, ids)
    assert ours.shape == ref.shape == (2, 80, 128)
    np.testing.assert_allclose(ours, ref, atol=1e-4, rtol=0)


@pytest.mark.parametrize("model_type,tied,overrides", CASES[:4], ids=IDS[:4])
def test_incremental_decode_matches_transformers(model_type, tied, overrides, tmp_path):
    hf = make_hf_model(model_type, tied=tied, **overrides)
    target = target_from_hf(hf, tmp_path)
    ids = _ids(2, 24, seed=1)
    ref = hf_logits(hf, ids)
    cache = target.init_cache(2, 32)
    # Prefill 8 tokens, then one token at a time through the cache.
    out, cache, _ = target.forward(ids[:, :8], cache)
    np.testing.assert_allclose(np.asarray(out), ref[:, :8], atol=1e-4, rtol=0)
    for t in range(8, 24):
        out, cache, _ = target.forward(ids[:, t:t + 1], cache)
        np.testing.assert_allclose(np.asarray(out[:, 0]), ref[:, t], atol=1e-4, rtol=0)
    assert np.asarray(cache.lengths).tolist() == [24, 24]


def test_ragged_blocks_match_per_row_reference(tmp_path):
    """Rows advance by different amounts per call (prefill, decode and verification all look like this)."""
    hf = make_hf_model("qwen3", tied=False)
    target = target_from_hf(hf, tmp_path)
    ids = _ids(3, 30, seed=2)
    ref = hf_logits(hf, ids)
    cache = target.init_cache(3, 40)
    steps = [[5, 1, 9], [3, 7, 0], [4, 4, 4], [0, 2, 6]]  # tokens per row per call; padded to the max
    pos = np.zeros(3, int)
    for n in steps:
        T = max(n)
        block = np.zeros((3, T), np.int32)
        for b in range(3):
            block[b, :n[b]] = ids[b, pos[b]:pos[b] + n[b]]
        out, cache, _ = target.forward(block, cache, num_new=np.array(n))
        out = np.asarray(out)
        for b in range(3):
            np.testing.assert_allclose(out[b, :n[b]], ref[b, pos[b]:pos[b] + n[b]], atol=1e-4, rtol=0)
        pos += n
    assert np.asarray(cache.lengths).tolist() == pos.tolist()


def test_rewound_cache_is_overwritten(tmp_path):
    """Verification writes ℓ+1 tokens then rewinds `lengths`; the stale entries must not leak."""
    hf = make_hf_model("llama", tied=True)
    target = target_from_hf(hf, tmp_path)
    ids = _ids(1, 12, seed=3)
    ref = hf_logits(hf, ids)
    cache = target.init_cache(1, 16)
    _, cache, _ = target.forward(ids[:, :6], cache)
    junk = _ids(1, 5, seed=9)
    _, cache, _ = target.forward(junk, cache)  # "draft" tokens, all rejected
    cache = cache.with_lengths(cache.lengths - 5)
    out, cache, _ = target.forward(ids[:, 6:12], cache)
    np.testing.assert_allclose(np.asarray(out), ref[:, 6:12], atol=1e-4, rtol=0)


def test_hidden_states_match_transformers(tmp_path):
    import torch

    hf = make_hf_model("llama", tied=False)
    target = target_from_hf(hf, tmp_path)
    ids = _ids(2, 10, seed=4)
    _, _, hidden = target.forward(ids, target.init_cache(2, 10), hidden_layers=(0, 2))
    with torch.no_grad():
        hs = hf(torch.as_tensor(ids, dtype=torch.long), output_hidden_states=True).hidden_states
    # HF's last hidden_states entry has the final norm applied; layer 0's output is hidden_states[1].
    np.testing.assert_allclose(np.asarray(hidden[..., :64]), hs[1].numpy(), atol=1e-4, rtol=0)
    assert hidden.shape == (2, 10, 128)


def test_old_and_new_rope_config_forms_agree(tmp_path):
    hf = make_hf_model("llama", tied=True, rope_theta=12345.0)
    hf.save_pretrained(tmp_path, safe_serialization=True)
    new_cfg, tensors = read_hf_dir(str(tmp_path))
    assert "rope_parameters" in new_cfg

    def to_old(d):
        theta = d.pop("rope_parameters")["rope_theta"]
        return {**d, "rope_theta": theta}

    rewrite_config(tmp_path, to_old)
    old_cfg, _ = read_hf_dir(str(tmp_path))
    assert ModelConfig.from_hf(old_cfg).rope == ModelConfig.from_hf(new_cfg).rope
    assert ModelConfig.from_hf(old_cfg).rope.theta == 12345.0
    ids = _ids(1, 20)
    ours = Target(build_decoder(ModelConfig.from_hf(old_cfg), tensors)).logits(ids)
    np.testing.assert_allclose(np.asarray(ours), hf_logits(hf, ids), atol=1e-4, rtol=0)


def test_bfloat16_runs_close_to_float32(tmp_path):
    import jax.numpy as jnp

    hf = make_hf_model("qwen3", tied=True)
    ids = _ids(1, 16)
    ref = hf_logits(hf, ids)
    bf = target_from_hf(hf, tmp_path, dtype=jnp.bfloat16)
    out = np.asarray(bf.logits(ids))
    assert out.dtype == np.float32
    assert np.abs(out - ref).max() < 0.1


def test_unknown_architecture_and_bad_weights_are_clear_errors(tmp_path):
    hf = make_hf_model("llama", tied=True)
    hf.save_pretrained(tmp_path, safe_serialization=True)
    cfg, tensors = read_hf_dir(str(tmp_path))
    with pytest.raises(ValueError, match="unsupported architecture 'gpt2'"):
        ModelConfig.from_hf({**cfg, "model_type": "gpt2"})
    mc = ModelConfig.from_hf(cfg)
    with pytest.raises(ValueError, match="lacks"):
        build_decoder(mc, {k: v for k, v in tensors.items() if "mlp.up_proj" not in k})
    with pytest.raises(ValueError, match="unexpected tensor"):
        build_decoder(mc, {**tensors, "model.layers.0.weird.weight": np.zeros(3)})
    bad = dict(tensors)
    bad["model.norm.weight"] = np.zeros(7, np.float32)
    with pytest.raises(ValueError, match="shape"):
        build_decoder(mc, bad)


def test_forward_through_the_pallas_attention_kernel_matches_transformers(tmp_path):
    """kernels="pallas": the ragged paged verification kernel (interpret mode) inside the Decoder, ragged rows."""
    hf = make_hf_model("qwen3", tied=True)
    target = target_from_hf(hf, tmp_path)
    ids = _ids(2, 20, seed=5)
    ref = hf_logits(hf, ids)
    cache = target.init_cache(2, 32)
    out, cache, _ = target.forward(ids[:, :12], cache, num_new=np.array([12, 9]), kernels="pallas")
    np.testing.assert_allclose(np.asarray(out)[0], ref[0, :12], atol=1e-4, rtol=0)
    np.testing.assert_allclose(np.asarray(out)[1, :9], ref[1, :9], atol=1e-4, rtol=0)
    block = np.stack([ids[0, 12:15], ids[1, 9:12]])
    out, _, _ = target.forward(block, cache, kernels="pallas")
    np.testing.assert_allclose(np.asarray(out)[0], ref[0, 12:15], atol=1e-4, rtol=0)
    np.testing.assert_allclose(np.asarray(out)[1], ref[1, 9:12], atol=1e-4, rtol=0)


@pytest.mark.parametrize("shape", [(1, 48), (1, 5, 48), (2, 8, 48), (33, 48), (3, 1, 48)])
def test_tied_head_equals_the_plain_product_at_every_row_count(shape):
    """The tied LM head picks its product's operand order by row count (model.tied_head); every order must give
    h @ embedᵀ in the caller's shape."""
    import jax
    import jax.numpy as jnp

    from dspark_jax.model import tied_head

    rng = np.random.default_rng(0)
    embed = jnp.asarray(rng.standard_normal((300, 48), np.float32))
    h = jnp.asarray(rng.standard_normal(shape, np.float32))
    out = np.asarray(jax.jit(tied_head)(h, embed))
    want = np.asarray(h) @ np.asarray(embed).T
    assert out.shape == want.shape
    np.testing.assert_allclose(out, want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("shape", [(1, 48), (1, 5, 48), (2, 8, 48), (33, 48), (3, 1, 48)])
def test_output_major_dense_equals_the_plain_product_at_every_row_count(shape):
    """layers.dense with an output-major weight [O, I] (the served target's layout on XLA:CPU) is x @ Wᵀ in the
    caller's shape, whatever the number of rows."""
    import jax
    import jax.numpy as jnp

    from dspark_jax.layers import dense

    rng = np.random.default_rng(1)
    w = jnp.asarray(rng.standard_normal((70, 48), np.float32))  # [O, I]
    x = jnp.asarray(rng.standard_normal(shape, np.float32))
    out = np.asarray(jax.jit(dense, static_argnums=2)(x, w, True))
    want = np.asarray(x) @ np.asarray(w).T
    assert out.shape == want.shape
    np.testing.assert_allclose(out, want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("model_type,tied,overrides", CASES, ids=IDS)
def test_serving_layout_matches_transformers(model_type, tied, overrides, tmp_path):
    """The target as the paged round serves it on XLA:CPU (Target.serving_split: dense weights output-major)
    computes the same logits as transformers, biases and q/k norms included, and really is output-major."""
    from flax import nnx

    hf = make_hf_model(model_type, tied=tied, **overrides)
    target = target_from_hf(hf, tmp_path)
    graphdef, params = target.serving_split(True)
    assert target.serving_split(True)[1] is params  # converted once, then kept
    assert target.serving_split(False) == (target.graphdef, target.params)
    served = Target(nnx.merge(graphdef, params), source="served")
    layer, orig = served.module().layers, target.module().layers  # stacked: [num_layers, ...] each
    assert layer.mlp.out_in and layer.attn.out_in and not orig.mlp.out_in
    gate, o = orig.mlp.gate[...].shape, orig.attn.o[...].shape
    assert layer.mlp.gate[...].shape == (gate[0], gate[2], gate[1])
    assert layer.attn.o[...].shape == (o[0], o[3], o[1], o[2])
    ids = _ids(2, 80)
    np.testing.assert_allclose(np.asarray(served.logits(ids)), hf_logits(hf, ids), atol=1e-4, rtol=0)


def test_serving_layout_is_skipped_when_a_second_copy_would_not_fit(tmp_path, monkeypatch):
    """On XLA:CPU the served layout is a second copy of the dense weights; a target that fits in memory only once
    (a large bf16 model) is served in its own layout instead of running out of memory at start-up."""
    import os

    import jax

    if jax.default_backend() != "cpu":
        pytest.skip("the output-major serving layout is XLA:CPU's")
    hf = make_hf_model("llama", tied=True)
    target = target_from_hf(hf, tmp_path)
    assert target.serving_split()[1] is not target.params  # this machine: room for both
    target._served = None
    monkeypatch.setattr(os, "sysconf", lambda name: 1)  # one free page of one byte
    assert target.serving_split() == (target.graphdef, target.params)
