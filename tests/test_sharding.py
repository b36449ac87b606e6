"""Tensor + data parallelism on a simulated 8-device CPU mesh gives the single-device logits.

XLA's device count is fixed at import, so the mesh run happens in a subprocess with
XLA_FLAGS=--xla_force_host_platform_device_count=8.
"""

from __future__ import annotations

import os
import textwrap

import numpy as np
from conftest import run_on_eight_devices

SCRIPT = textwrap.dedent("""
    import sys, numpy as np, jax
    sys.path.insert(0, {tests!r})
    from conftest import make_hf_model, target_from_hf
    from dspark_jax.sharding import make_mesh, shard_params, shard_cache
    assert jax.device_count() == 8, jax.device_count()
    # 8 heads / 4 KV heads / FFN 96 / vocab 128 divide a 4-way model axis; norms stay replicated.
    hf = make_hf_model("qwen3", tied=False, num_attention_heads=8, num_key_value_heads=4)
    t = target_from_hf(hf, {tmp!r})
    ids = np.random.default_rng(0).integers(3, 128, size=(4, 12)).astype(np.int32)
    single = np.asarray(t.logits(ids))
    mesh = make_mesh(data=2, model=4)
    t.params = shard_params(t.params, mesh)
    spec = t.params["layers"]["attn"]["q"][...].sharding.spec  # [num_layers, D, N, H]: heads over `model`
    assert tuple(spec)[:3] == (None, None, "model"), spec
    cache = shard_cache(t.init_cache(4, 16), mesh)
    full, cache, _ = t.forward(ids[:, :8], cache)
    step, cache, _ = t.forward(ids[:, 8:], cache)
    meshed = np.concatenate([np.asarray(full), np.asarray(step)], axis=1)
    np.save({out!r}, np.stack([single, meshed]))
""")


def test_eight_device_mesh_matches_single_device(tmp_path):
    out = tmp_path / "logits.npy"
    code = SCRIPT.format(tests=os.path.dirname(__file__), tmp=str(tmp_path / "m"), out=str(out))
    run_on_eight_devices(code, timeout=600)
    single, meshed = np.load(out)
    np.testing.assert_allclose(meshed, single, atol=1e-5, rtol=0)


KERNEL_SCRIPT = textwrap.dedent("""
    import json, sys
    import jax, jax.numpy as jnp, numpy as np
    sys.path.insert(0, {tests!r})
    from conftest import make_hf_model, target_from_hf
    from test_spec_decode import _drafter
    from dspark_jax import runner as R
    from dspark_jax.sharding import make_mesh
    assert jax.device_count() == 8
    hf = make_hf_model("qwen3", tied=False, num_attention_heads=8, num_key_value_heads=4)
    target = target_from_hf(hf, {tmp!r})
    drafter = _drafter(target, "dspark", 3, seed=1, num_layers=1, markov_rank=16)
    out = {{}}
    for name, mesh in (("single", None), ("mesh", make_mesh(2, 4))):
        r = R.ModelRunner(target, drafter, max_batch=2, num_pages=16, page_size=16, max_pages=4, kernels="pallas",
                          mesh=mesh)
        b = r.empty_batch(2)
        b.lengths[:] = [5, 9]
        b.anchors[:] = [7, 11]
        b.block_tables[0, :1], b.block_tables[1, :1] = 3, 8
        dev = r.device_batch(b)
        draft, q, conf = r.draft(b, dev)
        s = r._static
        args = (r.target_params, r.drafter_params, r.target_kv, r.drafter_kv, dev, draft, q, conf,
                r._put(np.asarray([2, 3], np.int32)))
        kw = dict(target_graph=s["target_graph"], drafter_graph=s["drafter_graph"], capacity=8, mode="lengths",
                  block_size=r.L,
                  hidden_layers=s["hidden_layers"], kernels=s["kernels"])
        if mesh is not None:
            def walk(jaxpr, inside, found):
                for e in jaxpr.eqns:
                    if e.primitive.name == "pallas_call":
                        found.append(inside)
                    for v in e.params.values():
                        for sub in (v if isinstance(v, (tuple, list)) else (v,)):
                            sub = getattr(sub, "jaxpr", sub)
                            if hasattr(sub, "eqns"):
                                walk(sub, inside or e.primitive.name == "shard_map", found)
                return found
            out["pallas_inside_shard_map"] = walk(R.verify_program.trace(*args, **kw).jaxpr.jaxpr, False, [])
            out["draft_pallas_inside_shard_map"] = walk(
                R.draft_program.trace(r.target_params, r.drafter_params, r.draft_head, r.drafter_kv,
                                      dev.block_tables, dev.lengths, dev.anchors, dev.keys, dev.rounds,
                                      dev.temperature, dev.top_k, dev.top_p, drafter_graph=s["drafter_graph"],
                                      tied=False, kernels=s["kernels"]).jaxpr.jaxpr,
                False, [])
            hlo = R.verify_program.lower(*args, **kw).compile().as_text()
            pool = "[" + ",".join(map(str, r.target_kv.k.shape)) + "]"
            out["pool_gathers"] = [ln.strip()[:200] for ln in hlo.splitlines() if "all-gather" in ln and pool in ln]
            out["pool_shards"] = str(r.target_kv.k.sharding.spec)
        res = R.verify_program(*args, **kw)
        out[name] = [np.asarray(x).tolist() for x in res[2:6]]
    json.dump(out, open({out!r}, "w"))
""")


def test_kernels_run_inside_shard_map_and_no_page_pool_is_gathered(tmp_path):
    """Tensor parallelism with the Pallas kernels forced on (interpreted on 8 simulated CPU devices, mesh 2 × 4):
    every pallas_call of the verify and draft programs sits inside a shard_map (checked on the jaxpr), the compiled
    verify program all-gathers no page pool (checked on its HLO), and a verify round gives the single-device
    result."""
    import json

    out = tmp_path / "out.json"
    code = KERNEL_SCRIPT.format(tests=os.path.dirname(__file__), tmp=str(tmp_path / "m"), out=str(out))
    run_on_eight_devices(code, timeout=900)
    res = json.loads(out.read_text())
    assert res["pallas_inside_shard_map"] and all(res["pallas_inside_shard_map"]), res["pallas_inside_shard_map"]
    assert res["draft_pallas_inside_shard_map"] and all(res["draft_pallas_inside_shard_map"])
    assert "model" in res["pool_shards"], res["pool_shards"]
    assert res["pool_gathers"] == [], res["pool_gathers"]
    assert res["mesh"] == res["single"]
