"""Tensor + data parallelism on a simulated 8-device CPU mesh gives the single-device logits.

XLA's device count is fixed at import, so the mesh run happens in a subprocess with
XLA_FLAGS=--xla_force_host_platform_device_count=8.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import numpy as np

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
    env = {**os.environ, "XLA_FLAGS": "--xla_force_host_platform_device_count=8", "JAX_PLATFORMS": "cpu"}
    proc = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    single, meshed = np.load(out)
    np.testing.assert_allclose(meshed, single, atol=1e-5, rtol=0)
