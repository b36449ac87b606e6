"""Sharded Hugging Face checkpoints (`model-0000i-of-0000n.safetensors` + `model.safetensors.index.json`, what
every model above a few GB ships as) load through `load_target` exactly like the single-file save of the same
weights, and match transformers (dspark_jax/weights.py: read_hf_dir)."""

from __future__ import annotations

import glob
import json
import os

import jax
import numpy as np
import pytest
from conftest import hf_logits, make_hf_model, save_word_tokenizer

from dspark_jax.target import load_target

IDS = np.random.default_rng(0).integers(3, 128, size=(2, 11)).astype(np.int32)


def _save(hf, directory, **kw) -> str:
    hf.save_pretrained(directory, safe_serialization=True, **kw)
    save_word_tokenizer(directory)
    return str(directory)


@pytest.mark.parametrize("model_type,tied,bf16", [("llama", True, False), ("qwen3", False, False),
                                                  ("qwen3", False, True)])
def test_sharded_checkpoint_loads_like_the_single_file(tmp_path, model_type, tied, bf16):
    import torch

    hf = make_hf_model(model_type, tied=tied)
    if bf16:  # bf16 shards are widened on read
        hf = hf.to(torch.bfloat16)
    single = _save(hf, tmp_path / "single")
    sharded = _save(hf, tmp_path / "sharded", max_shard_size="100KB")
    shards = sorted(glob.glob(os.path.join(sharded, "model-*-of-*.safetensors")))
    assert len(shards) >= 3, shards
    assert not os.path.exists(os.path.join(sharded, "model.safetensors"))
    with open(os.path.join(sharded, "model.safetensors.index.json")) as f:
        weight_map = json.load(f)["weight_map"]
    assert sorted(set(weight_map.values())) == [os.path.basename(s) for s in shards]  # really split

    a, b = load_target(single), load_target(sharded)
    leaves_a, leaves_b = jax.tree.leaves(a.params), jax.tree.leaves(b.params)
    assert len(leaves_a) == len(leaves_b)
    for x, y in zip(leaves_a, leaves_b, strict=True):
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y))
    logits = np.asarray(b.logits(IDS))
    np.testing.assert_array_equal(np.asarray(a.logits(IDS)), logits)
    oracle = hf
    if bf16:  # the same bf16-rounded weights in a float32 model (hf.float() would keep a bf16-rounded RoPE table)
        oracle = make_hf_model(model_type, tied=tied)
        oracle.load_state_dict({k: v.float() for k, v in hf.state_dict().items()})
    ref = hf_logits(oracle, IDS)
    np.testing.assert_allclose(logits, ref, atol=1e-4, rtol=1e-4)
    assert b.chat_ids("t5 t6") == [5, 6]


def test_a_missing_shard_is_a_clear_error(tmp_path):
    sharded = _save(make_hf_model("qwen3", tied=False), tmp_path / "sharded", max_shard_size="100KB")
    victim = sorted(glob.glob(os.path.join(sharded, "model-*-of-*.safetensors")))[1]
    os.remove(victim)
    with pytest.raises(ValueError, match=os.path.basename(victim)):
        load_target(sharded)
