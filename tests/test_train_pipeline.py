"""The training pipeline end to end on a tiny target: YAML configs, the grain data pipeline, overfitting one
batch, exact resume of a killed run, and the sharded step on a simulated 8-device mesh (train/*).

The tiny random llama's embedding is scaled up so its next-token distributions are peaked (LM-like); the
"prepared data" are its own samples written as ArrayRecord shards, exactly as `python -m train prepare` does.
"""

from __future__ import annotations

import glob
import json
import os
import textwrap

import jax
import numpy as np
import pytest
from conftest import make_hf_model, run_on_eight_devices, target_from_hf

import dspark_jax
from train.config import TrainConfig, load_config
from train.data import make_iterator, window_and_anchors
from train.prepare import encode_record, write_shards

CONFIGS = sorted(glob.glob(os.path.join(os.path.dirname(__file__), "..", "configs", "*.yaml")))


def _tiny_target(tmp):
    import torch

    hf = make_hf_model("llama", tied=True)
    with torch.no_grad():
        hf.model.embed_tokens.weight.mul_(8.0)
    return target_from_hf(hf, tmp)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    target = _tiny_target(tmp_path_factory.mktemp("llama"))
    prompts = [list(np.random.default_rng(i).integers(3, 128, size=4 + i % 5)) for i in range(24)]
    res = dspark_jax.generate(target, prompts, max_new_tokens=40, temperature=1.0, seed=1, ignore_eos=True)
    data = tmp_path_factory.mktemp("data")
    recs = [encode_record(p + r, len(p), "chat") for p, r in zip(prompts, res.tokens, strict=True)]
    write_shards(recs, str(data), num_shards=2, seed=0)
    return target, str(data)


def _cfg(data, out, **optim):
    return load_config(None, [
        f"data.path={data}", "data.seq_len=32", "data.anchors_per_seq=4", "data.batch_sequences=4",
        "data.features=false",
        "drafter.kind=dspark", "drafter.block_size=4", "drafter.overrides={num_layers: 1, markov_rank: 8}",
        f"run.out_dir={out}", "run.log_every=1", "run.ckpt_every=3", "run.keep=5", "run.async_checkpoint=false",
        *[f"optim.{k}={v}" for k, v in {"steps": 9, "lr": 3e-3, "warmup": 2, **optim}.items()]])


@pytest.mark.parametrize("path", CONFIGS, ids=os.path.basename)
def test_every_yaml_config_parses(path):
    cfg = load_config(path)
    assert isinstance(cfg, TrainConfig) and cfg.optim.steps > 0


def test_config_rejects_unknown_keys_and_bad_types(tmp_path):
    with pytest.raises(ValueError, match="unknown keys"):
        load_config(None, ["optim.stepz=3"])
    with pytest.raises(ValueError, match="expected int"):
        load_config(None, ["optim.steps=many"])
    assert load_config(None, ["optim.lr=1"]).optim.lr == 1.0
    with pytest.raises(ValueError, match="not found"):
        load_config(str(tmp_path / "missing.yaml"))


def test_window_and_anchors_keep_targets_inside_the_response():
    rng = np.random.default_rng(0)
    for n, p in [(10, 3), (300, 20), (300, 280), (5, 1)]:
        rec = {"tokens": np.arange(n, dtype=np.int32) + 1, "prompt_len": p}
        for _ in range(50):
            ex = window_and_anchors(rec, rng, 64, 8)
            length, a = int(ex["lengths"]), ex["anchors"]
            assert 3 <= length <= 64 and (a >= 1).all() and (a <= length - 2).all()
            start = int(ex["tokens"][0]) - 1  # tokens are 1..n, so the window start is readable
            assert (a + start >= min(p - 1, n - 2)).all()  # anchors in the response (its first token at p)


def test_data_iterator_resumes_exactly(tiny):
    _, data = tiny
    kw = dict(seq_len=32, anchors_per_seq=4, batch_sequences=4, seed=3)
    it = make_iterator(data, **kw)
    for _ in range(5):
        next(it)
    state = it.get_state()
    want = [next(it) for _ in range(4)]
    it2 = make_iterator(data, **kw)
    it2.set_state(state)
    got = [next(it2) for _ in range(4)]
    for w, g in zip(want, got, strict=True):
        for k in w:
            np.testing.assert_array_equal(w[k], g[k])


def test_grain_workers_give_the_in_process_batches_and_resume(tiny):
    """data.worker_count: batches windowed in 2 grain worker processes are the in-process ones, in order, and a
    new worker iterator restored from a saved position continues them."""
    _, data = tiny
    kw = dict(seq_len=32, anchors_per_seq=4, batch_sequences=4, seed=3)
    plain = make_iterator(data, **kw)
    want = [next(plain) for _ in range(6)]
    first = make_iterator(data, worker_count=2, **kw)
    got = [{k: np.array(v) for k, v in next(first).items()} for _ in range(4)]  # copies out of shared memory
    state = first.get_state()
    second = make_iterator(data, worker_count=2, **kw)
    second.set_state(state)
    got += [{k: np.array(v) for k, v in next(second).items()} for _ in range(2)]
    for it in (first, second):
        it.close()
    for w, g in zip(want, got, strict=True):
        for k in w:
            np.testing.assert_array_equal(w[k], g[k])


def test_precomputed_features_give_the_on_the_fly_loss(tiny):
    """train/features.py stores the target's hidden states (bf16); the loss from them matches the loss with a
    target forward inside the step to bf16 precision, batch for batch (same windows and anchors)."""
    from train.distill import make_loss_fn
    from train.features import featurize

    target, data = tiny
    drafter = dspark_jax.init_drafter(target, kind="dspark", block_size=4, num_layers=1, markov_rank=8, seed=2)
    layers = drafter.config.target_layers
    featurize(data, target, layers, progress=False)
    kw = dict(seq_len=32, anchors_per_seq=4, batch_sequences=4, seed=5)
    plain, pre = make_iterator(data, **kw), make_iterator(data, feature_layers=layers, **kw)
    loss = make_loss_fn(target, drafter)
    for _ in range(3):
        a, b = next(plain), next(pre)
        np.testing.assert_array_equal(a["anchors"], b["anchors"])
        la, lb = float(loss(drafter.params, a)[0]), float(loss(drafter.params, b)[0])
        assert abs(la - lb) < 2e-2 * abs(la), (la, lb)


def test_tiny_drafter_overfits_one_batch(tiny):
    from train.distill import make_optimizer, make_train_step

    target, data = tiny
    drafter = dspark_jax.init_drafter(target, kind="dspark", block_size=4, num_layers=1, markov_rank=8)
    batch = next(make_iterator(data, seq_len=32, anchors_per_seq=4, batch_sequences=4, seed=0))
    tx = make_optimizer(3e-3, 150, warmup=5)
    step = make_train_step(target, drafter, tx)
    params = jax.tree.map(np.array, drafter.params)
    params = jax.tree.map(jax.numpy.asarray, params)
    opt = tx.init(params)
    losses = []
    for _ in range(150):
        params, opt, m = step(params, opt, batch)
        losses.append(float(m["loss"]))
    assert losses[-1] < 0.25 * losses[0], (losses[0], losses[-1])


def test_killed_run_resumes_to_the_same_loss_curve(tiny, tmp_path):
    from train.fit import fit

    target, data = tiny
    fit(_cfg(data, tmp_path / "straight"), target=target, progress=False)
    fit(_cfg(data, tmp_path / "killed"), target=target, stop_after=5, progress=False)  # last checkpoint: 3
    fit(_cfg(data, tmp_path / "killed"), target=target, progress=False)
    read = lambda d: [json.loads(ln) for ln in open(d / "metrics.jsonl")]  # noqa: E731
    straight, resumed = read(tmp_path / "straight"), read(tmp_path / "killed")
    assert [r["step"] for r in resumed] == list(range(1, 10))
    np.testing.assert_allclose([r["loss"] for r in resumed], [r["loss"] for r in straight], rtol=1e-6)
    assert straight[-1]["loss"] < straight[0]["loss"]
    loaded = dspark_jax.load_drafter(str(tmp_path / "killed" / "drafter"), target)
    assert loaded.config.block_size == 4


def test_a_carried_run_continues_on_a_new_machine(tiny, tmp_path):
    """run.carry_dir: the bf16 parameters, step, data position and metrics written at each checkpoint let a run
    whose Orbax checkpoints are gone (a new machine) continue: the same batches in order, the next step's loss
    that of the uninterrupted run up to bf16 rounding, the earlier metrics kept."""
    import shutil

    from train.fit import fit, read_carry

    target, data = tiny
    carry = tmp_path / "carry"
    cfg_a = _cfg(data, tmp_path / "a", steps=12)
    cfg_a = load_config(None, [*_overrides(cfg_a), f"run.carry_dir={carry}"])
    fit(cfg_a, target=target, stop_after=6, progress=False)
    carried = read_carry(str(carry))
    assert carried["step"] == 6 and (carried["drafter"] / "drafter_config.json").exists()
    assert sorted(p.name for p in carry.iterdir()) == ["carry.json", "step-6"]  # the old step's files removed
    shutil.copytree(carry, tmp_path / "carry6")
    fit(cfg_a, target=target, progress=False)  # the uninterrupted reference: machine a's Orbax resume to 12
    assert read_carry(str(carry))["step"] == 12
    cfg_b = load_config(None, [*_overrides(cfg_a), f"run.out_dir={tmp_path / 'b'}",
                               f"run.carry_dir={tmp_path / 'carry6'}"])
    fit(cfg_b, target=target, progress=False)  # machine b: no checkpoints, only the carry at step 6
    read = lambda d: [json.loads(ln) for ln in open(d / "metrics.jsonl")]  # noqa: E731
    a, b = read(tmp_path / "a"), read(tmp_path / "b")
    assert [r["step"] for r in b] == list(range(1, 13))
    assert b[:6] == a[:6]
    np.testing.assert_allclose(b[6]["loss"], a[6]["loss"], rtol=2e-2)  # step 7: same batch, bf16 parameters
    assert abs(b[6]["loss"] - a[0]["loss"]) > 10 * abs(b[6]["loss"] - a[6]["loss"])  # not a fresh start
    assert b[-1]["loss"] < b[6]["loss"]  # fresh moments, re-warmed: it keeps learning
    assert read_carry(str(tmp_path / "carry6"))["step"] == 12
    assert dspark_jax.load_drafter(str(tmp_path / "b" / "drafter"), target).config.block_size == 4


def _overrides(cfg) -> list[str]:
    """A config back as dotted overrides (every leaf)."""
    out = []

    def walk(prefix, d):
        for k, v in d.items():
            if isinstance(v, dict) and k not in ("overrides", "loss"):
                walk(f"{prefix}{k}.", v)
            else:
                out.append(f"{prefix}{k}={json.dumps(v)}")
    walk("", cfg.to_dict())
    return out


MESH_SCRIPT = textwrap.dedent("""
    import sys, numpy as np, jax
    sys.path.insert(0, {tests!r})
    from flax import nnx
    from test_train_pipeline import _tiny_target
    import dspark_jax
    from train.data import make_iterator
    from train.distill import make_optimizer, make_train_step
    from train.sharding import make_train_mesh, put_batch, train_shardings
    assert jax.device_count() == 8
    target = _tiny_target({tmp!r})
    drafter = dspark_jax.init_drafter(target, kind={kind!r}, block_size=4, num_layers=1)
    batch = next(make_iterator({data!r}, seq_len=32, anchors_per_seq=2, batch_sequences=8, seed=0))
    tx = make_optimizer(1e-3, 10, warmup=1)
    out = []
    for shape in [(1, 1, 1), (2, 2, 2)]:
        mesh = make_train_mesh(*shape)
        params = jax.tree.map(jax.numpy.array, nnx.to_pure_dict(drafter.params))  # copies: the step donates
        tparams = nnx.to_pure_dict(target.params)
        opt = tx.init(params)
        sh = train_shardings(mesh, params, opt, tparams)
        params, opt, tparams = jax.device_put(params, sh.params), jax.device_put(opt, sh.opt), \\
            jax.device_put(tparams, sh.target)
        step = make_train_step(target, drafter, tx, shardings=sh, target_params=tparams)
        losses = []
        for _ in range(3):
            params, opt, m = step(params, opt, put_batch(batch, sh.batch))
            losses.append(float(m["loss"]))
        if shape[1] > 1:
            assert "fsdp" in str(params["layers"][0]["mlp"]["up"].sharding.spec)
        out.append(losses)
    np.save({out!r}, np.array(out))
""")


@pytest.mark.parametrize("kind", ["dspark", "eagle3"])
def test_sharded_step_on_eight_devices_matches_one(tiny, tmp_path, kind):
    _, data = tiny
    out = tmp_path / "losses.npy"
    code = MESH_SCRIPT.format(tests=os.path.dirname(__file__), tmp=str(tmp_path / "m"), data=data, out=str(out),
                              kind=kind)
    run_on_eight_devices(code, timeout=900)
    single, meshed = np.load(out)
    np.testing.assert_allclose(meshed, single, rtol=2e-5)


def test_qwen3_8b_pod_config_train_step_eval_shape():
    """The pod config's full-size train step (Qwen3-8B bf16 target, 5-layer DSpark drafter) traces without
    allocating or having the devices; its drafter parameters and AdamW state are float32; its shardings divide
    the configured mesh; and what one chip holds of the state fits a v5p chip's HBM with room to spare."""
    import jax.numpy as jnp
    from flax import nnx
    from jax.sharding import AbstractMesh, PartitionSpec

    from dspark_jax.config import ModelConfig
    from dspark_jax.drafter_config import DrafterConfig
    from dspark_jax.drafter_model import DrafterModel
    from dspark_jax.model import Decoder
    from dspark_jax.target import DTYPES
    from train.distill import _loss, init_train_state, make_optimizer
    from train.features import batch_bytes
    from train.losses import LossWeights
    from train.sharding import AXES, per_device_bytes, tree_specs

    cfg = load_config(os.path.join(os.path.dirname(__file__), "..", "configs", "qwen3_8b_tpu_v5p64.yaml"))
    assert cfg.target.dtype == "bfloat16" and not cfg.data.features and cfg.data.worker_count == 8
    n_devices = cfg.mesh.data * cfg.mesh.fsdp * cfg.mesh.tensor
    assert n_devices == 32  # v5p-64: 64 TensorCores = 32 chips (one device each) on 8 hosts of 4
    tcfg = ModelConfig.from_hf(cfg.target.hf_config)
    dcfg = DrafterConfig.for_target(tcfg, kind=cfg.drafter.kind, block_size=cfg.drafter.block_size,
                                    **cfg.drafter.overrides)
    tg, tp = nnx.split(nnx.eval_shape(lambda: Decoder(tcfg, dtype=DTYPES[cfg.target.dtype], rngs=nnx.Rngs(0))))
    dg, dp = nnx.split(nnx.eval_shape(lambda: DrafterModel(dcfg, dtype=jnp.float32, rngs=nnx.Rngs(0))))
    dp, tp = nnx.to_pure_dict(dp), nnx.to_pure_dict(tp)
    tx = make_optimizer(cfg.optim.lr, cfg.optim.steps, cfg.optim.warmup)
    dp, opt = jax.eval_shape(lambda p: init_train_state(p, tx), dp)
    floats = lambda t: {x.dtype for x in jax.tree.leaves(t) if jnp.issubdtype(x.dtype, jnp.floating)}  # noqa: E731
    assert floats(tp) == {jnp.dtype(jnp.bfloat16)}
    assert floats(dp) == {jnp.dtype(jnp.float32)} and floats(opt) == {jnp.dtype(jnp.float32)}
    d = cfg.data
    per_step = d.batch_sequences // cfg.mesh.data // cfg.mesh.fsdp  # rows per data shard; a small probe batch
    S, T, A = per_step, 256, 4  # traced shapes only; the full 256×2048 batch has the same code path
    batch = {"tokens": jax.ShapeDtypeStruct((S, T), jnp.int32), "lengths": jax.ShapeDtypeStruct((S,), jnp.int32),
             "anchors": jax.ShapeDtypeStruct((S, A), jnp.int32)}

    def step(dparams, opt_state, tparams, b):
        (_, m), g = jax.value_and_grad(_loss, has_aux=True)(dparams, tparams, b, drafter_graph=dg, target_graph=tg,
                                                             tied=False, weights=LossWeights())
        updates, opt_state = tx.update(g, opt_state, dparams)
        return updates, opt_state, m

    updates, new_opt, metrics = jax.eval_shape(step, dp, opt, tp, batch)
    assert metrics["acceptance"].shape == (dcfg.block_size,)
    assert jax.tree.structure(updates) == jax.tree.structure(dp)
    assert floats(updates) == {jnp.dtype(jnp.float32)} and floats(new_opt) == {jnp.dtype(jnp.float32)}
    n_target = sum(int(np.prod(x.shape)) for x in jax.tree.leaves(tp))
    assert 8.0e9 < n_target < 8.4e9
    mesh = AbstractMesh((cfg.mesh.data, cfg.mesh.fsdp, cfg.mesh.tensor), AXES)
    shape = dict(mesh.shape)
    for tree in (dp, opt, tp):
        specs = jax.tree.leaves(tree_specs(tree, shape), is_leaf=lambda s: isinstance(s, PartitionSpec))
        for x, spec in zip(jax.tree.leaves(tree), specs, strict=True):
            for dim, ax in zip(x.shape, tuple(spec) + (None,) * (len(x.shape) - len(spec)), strict=True):
                assert ax is None or dim % shape[ax] == 0
    # The big matrices really are split: the drafter's MLP over fsdp, the target's embedding over fsdp.
    assert "fsdp" in tuple(tree_specs(dp, shape)["layers"][0]["mlp"]["up"])
    assert "fsdp" in tuple(tree_specs(tp, shape)["embed"])
    # Per chip: the bf16 target, the f32 drafter and its two f32 AdamW moments, each FSDP-sharded 4 ways.
    held = {name: per_device_bytes(tree, shape) for name, tree in [("target", tp), ("drafter", dp), ("adamw", opt)]}
    print({k: f"{v / 2**30:.2f} GiB" for k, v in held.items()}, f"total {sum(held.values()) / 2**30:.2f} GiB")
    assert held["adamw"] >= 2 * held["drafter"] - 1024  # mu and nu, both f32
    hbm = 95e9  # a v5p chip
    assert sum(held.values()) < 0.25 * hbm  # three quarters left for activations (8 rows × 2048 tokens a chip)
    # What precomputed features would cost on the host (the config's comment): 32 KB a token, 17 GB a batch.
    assert round(batch_bytes(d, dcfg, tcfg) / 1e9) == 17


@pytest.mark.parametrize("kind", ["dspark", "dflash", "eagle3"])
def test_teacher_forced_training_logits_equal_the_inference_draft(tiny, kind):
    """Slot 0 of the training forward (context = positions < n, anchor token x_n at position n) must give the
    distribution `draft_block` samples from at inference, for every anchor of every sequence."""
    import jax.numpy as jnp
    from test_spec_decode import _drafter

    from dspark_jax.drafter import draft_block
    from dspark_jax.drafter_model import TargetHead
    from train.losses import _dspark_logits, _eagle_logits, context_cache

    target, data = tiny
    extra = {"markov_rank": 8} if kind == "dspark" else {}
    d = _drafter(target, kind, 4, seed=4, scramble=0.5, **extra)
    batch = next(make_iterator(data, seq_len=32, anchors_per_seq=3, batch_sequences=2, seed=1))
    tokens, anchors = jnp.asarray(batch["tokens"]), jnp.asarray(batch["anchors"])
    S, A = anchors.shape
    head = TargetHead.from_params(target.params, target.config.tie_word_embeddings)
    _, _, feats = target.forward(tokens, target.init_cache(*tokens.shape), hidden_layers=d.config.target_layers)
    model = d.module()
    cache = context_cache(model, head, tokens, feats, anchors)
    n = anchors.reshape(-1)
    rows = jnp.repeat(tokens, A, axis=0)
    prev = jnp.take_along_axis(rows, n[:, None] + jnp.arange(4)[None], axis=1)
    if kind == "eagle3":
        train_logits = _eagle_logits(model, head, cache, prev)
    else:
        train_logits, _ = _dspark_logits(model, head, cache, n, prev)
    ones = jnp.ones((S * A,), jnp.float32)
    _, q, _ = draft_block(d.graphdef, d.params, head, cache, prev[:, 0], jax.random.split(jax.random.key(0), S * A),
                          ones, jnp.zeros((S * A,), jnp.int32), ones, "reference")
    np.testing.assert_allclose(np.asarray(jax.nn.softmax(train_logits[:, 0])), np.asarray(q[:, 0]), atol=1e-5)


@pytest.mark.parametrize("model_type,tied", [("llama", True), ("qwen3", False)])
def test_target_training_forward_is_the_plain_forward_without_the_verification_kernel(tmp_path, model_type, tied,
                                                                                      monkeypatch):
    """train/distill.py's target_features: the frozen target's prefill inside the train step gives the plain (cached)
    forward's final hidden states and layer features, and — even where "auto" would pick the Pallas verification
    kernel for Decoder.__call__ (a TPU backend on which the kernel had been measured faster, faked here for
    tracing only) — its jaxpr holds no pallas_call."""
    import jax.numpy as jnp
    from flax import nnx

    from dspark_jax import kernels
    from dspark_jax.target import apply
    from train.distill import _loss, target_features
    from train.losses import LossWeights

    target = target_from_hf(make_hf_model(model_type, tied=tied), tmp_path)
    tokens = jnp.asarray(np.random.default_rng(0).integers(3, 128, size=(3, 40)), jnp.int32)
    layers = (0, 2, 1)
    h_plain, _, f_plain = target.forward(tokens, target.init_cache(3, 40), hidden_layers=layers,
                                         compute_logits=False, kernels="reference")
    forward = jax.jit(lambda p, t: target_features(nnx.merge(target.graphdef, p), t, layers))
    h, f = forward(target.params, tokens)
    np.testing.assert_allclose(np.asarray(h), np.asarray(h_plain), rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(np.asarray(f), np.asarray(f_plain), rtol=1e-5, atol=1e-5)

    drafter = dspark_jax.init_drafter(target, kind="dspark", block_size=4, num_layers=1, markov_rank=8)
    batch = {"tokens": tokens, "lengths": jnp.array([40, 30, 12], jnp.int32),
             "anchors": jnp.array([[5, 9], [3, 20], [2, 8]], jnp.int32)}
    loss = lambda dp, tp: _loss(dp, tp, batch, drafter_graph=drafter.graphdef, target_graph=target.graphdef,  # noqa: E731
                                tied=tied, weights=LossWeights())
    monkeypatch.setattr(kernels.jax, "default_backend", lambda: "tpu")
    monkeypatch.setitem(kernels.AUTO_PALLAS, "attention", ("tpu",))
    assert kernels.use_pallas("auto", kernel="attention")
    plain = jax.make_jaxpr(lambda p: apply(target.graphdef, p, tokens, target.init_cache(3, 40)))(target.params)
    assert "pallas_call" in str(plain)  # the check is live: the plain forward would take the kernel here
    train = jax.make_jaxpr(jax.grad(lambda dp, tp: loss(dp, tp)[0]))(drafter.params, target.params)
    assert "pallas_call" not in str(train)
