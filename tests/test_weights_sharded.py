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


@pytest.mark.parametrize("model_type,tied,ranged", [("llama", True, False), ("qwen3", False, True)])
def test_slices_read_back_through_the_table_equal_the_whole_load(tmp_path, model_type, tied, ranged):
    """weights.read_slice: any slice of any parameter in our layout, read from the HF file (memory-mapped, or by
    the ranged reads used for gs://), equals that slice of `build_decoder`'s parameter, and reads only its rows."""
    from flax import nnx

    from dspark_jax.config import ModelConfig
    from dspark_jax.weights import SafetensorsSlices, _sources, build_decoder, read_hf_dir, read_slice

    directory = _save(make_hf_model(model_type, tied=tied), tmp_path / "m", max_shard_size="100KB")
    config, tensors = read_hf_dir(directory)
    cfg = ModelConfig.from_hf(config)
    whole = nnx.traversals.flatten_mapping(nnx.to_pure_dict(nnx.state(build_decoder(cfg, tensors))))
    reader = SafetensorsSlices(directory, ranged=ranged)
    sources = _sources(reader.tensors, cfg)
    rng = np.random.default_rng(0)
    for key, full in whole.items():
        full = np.asarray(full)
        fn, names = sources[".".join(map(str, key))]
        for _ in range(4):
            bounds = []
            for n in full.shape:
                a = int(rng.integers(0, n))
                bounds.append((a, int(rng.integers(a + 1, n + 1))))
            want = full[tuple(slice(a, b) for a, b in bounds)]
            if isinstance(names, list):
                got = np.stack([read_slice(reader, names[i], fn, full.shape[1:], bounds[1:])
                                for i in range(*bounds[0])])
            else:
                got = read_slice(reader, names, fn, full.shape, bounds)
            np.testing.assert_array_equal(got, want, err_msg=str(key))
    # Half the rows of the embedding (HF's first dimension) cost half its bytes.
    reader.bytes_read = 0
    V, D = reader.shape("model.embed_tokens.weight")
    read_slice(reader, "model.embed_tokens.weight", sources["embed"][0], (V, D), [(0, V // 2), (0, D)])
    assert reader.bytes_read == V // 2 * D * 4


def test_load_sharded_equals_build_decoder(tmp_path):
    """On this process's devices (one or more), the global arrays equal the whole-checkpoint load, in bf16 too."""
    import jax.numpy as jnp
    from flax import nnx
    from jax.sharding import NamedSharding, PartitionSpec

    from dspark_jax.config import ModelConfig
    from dspark_jax.weights import build_decoder, load_sharded, read_hf_dir

    directory = _save(make_hf_model("qwen3", tied=False), tmp_path / "m")
    config, tensors = read_hf_dir(directory)
    cfg = ModelConfig.from_hf(config)
    mesh = jax.make_mesh((len(jax.devices()),), ("x",), axis_types=(jax.sharding.AxisType.Auto,))
    for dtype in (jnp.float32, jnp.bfloat16):
        whole = nnx.to_pure_dict(nnx.state(build_decoder(cfg, tensors, dtype)))
        shardings = jax.tree.map(lambda x: NamedSharding(mesh, PartitionSpec()), whole)
        got = load_sharded(directory, cfg, shardings, dtype)
        jax.tree.map(lambda g, w: np.testing.assert_array_equal(np.asarray(g), np.asarray(w)), got, whole)
        assert {x.dtype for x in jax.tree.leaves(got)} == {jnp.dtype(dtype)}
