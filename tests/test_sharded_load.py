"""`load_target(dir, mesh=…)` streams a sharded Hugging Face checkpoint onto an 8-device tensor-parallel mesh:
no device holds more than its share, the host never holds the model, and the logits equal the one-device load.

What is measured, in a subprocess with 8 simulated CPU devices (XLA's device count is fixed at import):
  * device bytes: after loading (and a garbage collection), every live jax array's addressable shards summed
    per device (`jax.live_arrays()`); the bound is 1/8 of the checkpoint + 10 % (the replicated norms fit in
    the 10 %).
  * host peak: `tracemalloc`'s peak over a second load (the first warms imports, compilations and the
    tokenizer's code), minus what was traced before it. tracemalloc counts every Python-heap allocation and
    every numpy buffer (numpy reports its buffers to it); device buffers are allocated by XLA outside it (the
    loader copies each slice into a device-owned buffer, `weights._to_device`, so a CPU device buffer never
    aliases a numpy array). So this is the
    loader's own host working memory plus the Python objects a load makes (tokenizer, traced module); the bound
    is 2 × the largest checkpoint tensor + 10 %. Memory-mapped file pages are not counted (they are the page
    cache's, not the process's heap).
A whole-model host load (the checkpoint read into numpy, then stacked and placed) breaks the host bound (checked
by swapping it in); one that then leaves every tensor on one device breaks the device bound. A load that sliced
on the host but passed through one device first would not be seen here: CPU devices report no peak memory.
"""

from __future__ import annotations

import json
import os
import textwrap

from conftest import run_on_eight_devices

SCRIPT = textwrap.dedent("""
    import gc, glob, json, os, sys, tracemalloc
    import jax, numpy as np
    sys.path.insert(0, {tests!r})
    from conftest import make_hf_model, save_word_tokenizer
    from dspark_jax.sharding import make_mesh, param_shardings, shard_params
    from dspark_jax.target import load_target
    from dspark_jax.weights import SafetensorsSlices
    from flax import nnx
    assert jax.device_count() == 8, jax.device_count()
    d = {tmp!r}
    # A Qwen3 replica whose head counts, FFN width and vocabulary divide 8, with its bytes in its layers (as an
    # 8B model's are): the largest tensor (the embedding, 1 MiB) is a 20th of the model.
    hf = make_hf_model("qwen3", tied=False, vocab_size=1024, hidden_size=256, intermediate_size=512,
                       num_hidden_layers=8, num_attention_heads=8, num_key_value_heads=8, head_dim=32)
    hf.save_pretrained(d, safe_serialization=True, max_shard_size="4MB")
    save_word_tokenizer(d, vocab_size=1024)
    files = glob.glob(os.path.join(d, "model-*-of-*.safetensors"))
    assert len(files) >= 3 and os.path.exists(os.path.join(d, "model.safetensors.index.json")), files
    sizes = [int(np.prod(s)) * dt.itemsize for _, dt, s, _ in SafetensorsSlices(d).tensors.values()]
    mesh = make_mesh(1, 8)
    ids = np.random.default_rng(0).integers(3, 1024, size=(2, 9)).astype(np.int32)
    single = np.array(load_target(d).logits(ids))  # a copy: np.asarray may keep the device buffer alive
    gc.collect()
    t = load_target(d, mesh=mesh)  # warms imports and compilations: the measured load is the next one
    del t
    gc.collect()
    tracemalloc.start()
    before = tracemalloc.get_traced_memory()[0]
    t = load_target(d, mesh=mesh)
    host_peak = tracemalloc.get_traced_memory()[1] - before
    tracemalloc.stop()
    gc.collect()
    buffers = {{}}  # (device, buffer address) → bytes: a global array and its shards' arrays share buffers
    for x in jax.live_arrays():
        for s in x.addressable_shards:
            buffers[s.device, s.data.unsafe_buffer_pointer()] = s.data.nbytes
    per_device = {{dev: 0 for dev in jax.devices()}}
    for (dev, _), n in buffers.items():
        per_device[dev] += n
    pure = nnx.to_pure_dict(t.params)
    want = param_shardings(pure, mesh)
    laid = all(x.sharding == w for x, w in zip(jax.tree.leaves(pure), jax.tree.leaves(want), strict=True))
    again = nnx.to_pure_dict(shard_params(t.params, mesh))  # what the serving runner does: must not copy
    same = all(a is b for a, b in zip(jax.tree.leaves(pure), jax.tree.leaves(again), strict=True))
    meshed = np.array(t.logits(ids))
    # A GGUF target is read whole, then placed by the same rules (weights.build_decoder(mesh=...)): equal arrays,
    # equal layout.
    from dspark_jax.config import ModelConfig
    from dspark_jax.weights import build_decoder, read_hf_dir
    config, tensors = read_hf_dir(d)
    whole = jax.tree.leaves(nnx.state(build_decoder(ModelConfig.from_hf(config), tensors, mesh=mesh)))
    as_gguf = all(x.sharding == y.sharding and np.array_equal(np.asarray(x), np.asarray(y))
                  for x, y in zip(whole, jax.tree.leaves(pure), strict=True))
    # The server's path: create_engine(mesh_shape=...) hands its mesh to load_target (stopped right there).
    import dspark_jax.target as target_module
    from serve.startup import EngineConfig, create_engine
    seen = {{}}
    def spy(spec, dtype, mesh=None):
        seen["mesh"] = None if mesh is None else dict(mesh.shape)
        raise StopIteration
    target_module.load_target = spy
    try:
        create_engine(EngineConfig(target=d, drafter="none", mesh_shape=(1, 8)))
    except StopIteration:
        pass
    json.dump(dict(engine_mesh=seen.get("mesh"),
                   model=sum(sizes), largest=max(sizes), host_peak=host_peak, per_device=list(per_device.values()),
                   laid_out=laid, no_copy=same, as_gguf=as_gguf, shards=len(files),
                   max_diff=float(np.abs(meshed - single).max())), open({out!r}, "w"))
""")


def test_tensor_parallel_load_streams_shards(tmp_path):
    out = tmp_path / "facts.json"
    code = SCRIPT.format(tests=os.path.dirname(__file__), tmp=str(tmp_path / "m"), out=str(out))
    run_on_eight_devices(code, timeout=600)
    facts = json.loads(out.read_text())
    print(facts)  # pytest -s shows the measured numbers
    assert facts["engine_mesh"] == {"data": 1, "model": 8}, facts
    assert facts["laid_out"] and facts["no_copy"] and facts["as_gguf"], facts
    assert max(facts["per_device"]) <= facts["model"] / 8 * 1.1, facts
    assert facts["host_peak"] <= 2 * facts["largest"] * 1.1, facts
    assert facts["max_diff"] <= 1e-5, facts
