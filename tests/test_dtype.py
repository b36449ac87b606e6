"""Dtypes: `--dtype auto|bfloat16|float32` and `--kv-dtype` (dspark_jax/target.py `resolve_dtype`, the runner's
page pools, serve/cli.py, dspark_jax/generate.py, train/config.py) and float32 drafter training under a bf16 target.

- "auto" is bfloat16 when jax's default backend is gpu or tpu and float32 on cpu (the backend query patched);
  the KV cache's "auto" is the compute dtype; any other name is a ValueError naming the choices.
- A bf16 engine holds bf16 weights and bf16 page pools; `kv_dtype="float32"` gives f32 pools under it.
- Losslessness in the served dtype: through the engine, greedy speculative output of a bf16 target equals its
  bf16 target-only greedy output (drafts accepted, so not trivially); the same for f32 pools under bf16.
- Training keeps the drafter's master weights and AdamW state float32 under a bf16 target (traced with
  jax.eval_shape: no step runs).
- Both CLIs parse the flags and reject bad values with an `error:` naming the flag and the choices.
"""

from __future__ import annotations

import importlib
import logging
import sys
import types

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
from conftest import make_hf_model, target_from_hf
from flax import nnx
from test_spec_decode import _drafter

import dspark_jax
from dspark_jax.runner import ModelRunner
from dspark_jax.target import DTYPE_CHOICES, load_target, resolve_dtype
from serve import cli
from serve.startup import create_engine
from serve.types import EngineRequest, SamplingParams

BF16, F32 = jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float32)
MAX_NEW = 16


def _float_dtypes(tree) -> set:
    return {jnp.dtype(x.dtype) for x in jax.tree.leaves(tree) if jnp.issubdtype(x.dtype, jnp.floating)}


def _pool_dtypes(kv) -> set:
    return {jnp.dtype(x.dtype) for x in (*kv.k, *kv.v, *(() if kv.feat is None else (kv.feat,)))}


# ---- resolution ------------------------------------------------------------------------------------------------
def test_auto_is_float32_on_cpu_and_bfloat16_on_gpu_and_tpu(monkeypatch):
    want = {"cpu": "float32", "gpu": "bfloat16", "tpu": "bfloat16"}
    assert resolve_dtype("auto") == want[jax.default_backend()]  # the real backend, unpatched
    for backend, dtype in want.items():
        monkeypatch.setattr(jax, "default_backend", lambda backend=backend: backend)
        assert resolve_dtype("auto") == dtype, backend
        assert resolve_dtype("float32") == "float32" and resolve_dtype("bfloat16") == "bfloat16"  # never overridden
    monkeypatch.setattr(jax, "default_backend", lambda: "gpu")
    assert resolve_dtype("auto", auto="float32") == "float32"  # the KV cache's auto: the compute dtype
    assert resolve_dtype("bfloat16", auto="float32") == "bfloat16"
    for bad in ("fp16", "bf16", "float16", ""):
        with pytest.raises(ValueError, match="choose one of auto, float32, bfloat16"):
            resolve_dtype(bad)
    with pytest.raises(ValueError, match="unknown dtype 'fp16'"):
        load_target("no-such-model", dtype="fp16")  # checked before the spec is looked up


def test_train_config_accepts_auto_and_rejects_other_names():
    from train.config import load_config

    assert load_config(None, ["target.dtype=auto"]).target.dtype == "auto"
    assert load_config(None, []).target.dtype == "float32"
    with pytest.raises(ValueError, match=r"target.dtype: expected one of auto, float32, bfloat16, got 'fp16'"):
        load_config(None, ["target.dtype=fp16"])


# ---- a tiny bf16 target served ----------------------------------------------------------------------------------
def _prompts(n: int, vocab: int = 128) -> list[list[int]]:
    return [[int(x) for x in np.random.default_rng(200 + i).integers(3, vocab, size=2 + (7 * i) % 30)]
            for i in range(n)]


@pytest.fixture(scope="module")
def bf16(tmp_path_factory):
    """The tiny llama of tests/test_engine.py (embedding ×8: peaked, repetitive) loaded in bf16, with an untrained
    DSpark drafter in bf16 (whose block pass proposes the anchor again, which this target often accepts) that
    reads H_ctx[n−1] at its anchor slot, so the runner keeps a pool of context entries too."""
    hf = make_hf_model("llama", tied=True)
    with torch.no_grad():
        hf.model.embed_tokens.weight.mul_(8.0)
    target = target_from_hf(hf, tmp_path_factory.mktemp("llama-bf16"), dtype=jnp.bfloat16)
    drafter = _drafter(target, "dspark", 4, seed=3, num_layers=1, markov_rank=8, anchor_feature=True)
    prompts = _prompts(6)
    ref = dspark_jax.generate(target, prompts, max_new_tokens=MAX_NEW, ignore_eos=True).tokens
    return target, drafter, prompts, ref


def _run_greedy(core, prompts) -> list[list[int]]:
    outs: dict[str, list[int]] = {}
    for i, p in enumerate(prompts):
        core.add_request(EngineRequest(
            request_id=str(i), prompt_ids=p, params=SamplingParams(max_tokens=MAX_NEW, temperature=0.0,
                                                                    ignore_eos=True),
            on_output=lambda o: outs.setdefault(o.request_id, []).extend(o.token_ids)))
    while core.has_work():
        core.step()
    return [outs[str(i)] for i in range(len(prompts))]


def test_bf16_runner_holds_bf16_weights_and_pools_and_kv_dtype_overrides_the_pools(bf16):
    target, drafter, _, _ = bf16
    assert _float_dtypes(target.params) == {BF16} and _float_dtypes(drafter.params) == {BF16}
    kw = dict(max_batch=2, num_pages=8, page_size=8, max_pages=4)
    r = ModelRunner(target, drafter, **kw)  # builds pools and placements; compiles nothing
    assert _float_dtypes(r.target_params) == {BF16} and _float_dtypes(r.drafter_params) == {BF16}
    assert r.kv_dtype == "bfloat16" and _pool_dtypes(r.target_kv) == {BF16} and _pool_dtypes(r.drafter_kv) == {BF16}
    assert r.drafter_kv.feat is not None  # the anchor-feature pool follows the KV dtype too
    r = ModelRunner(target, drafter, **kw, kv_dtype="float32")
    assert _float_dtypes(r.target_params) == {BF16}  # the weights keep the compute dtype
    assert r.kv_dtype == "float32" and _pool_dtypes(r.target_kv) == {F32} and _pool_dtypes(r.drafter_kv) == {F32}
    with pytest.raises(ValueError, match="kv_dtype=float32 under a bfloat16 target: the Pallas attention kernel"):
        ModelRunner(target, drafter, **kw, kv_dtype="float32", kernels="pallas")
    with pytest.raises(ValueError, match="unknown dtype 'fp8'"):
        ModelRunner(target, drafter, **kw, kv_dtype="fp8")


def test_bf16_greedy_speculative_through_the_engine_equals_bf16_target_only(bf16, caplog):
    """The bf16 engine: bf16 weights and pools, the dtypes logged at start-up, and greedy speculative output equal
    to the bf16 target-only greedy output with drafts accepted."""
    target, drafter, prompts, ref = bf16
    with caplog.at_level(logging.INFO, logger="dspark_jax.serve"):
        engine = create_engine(target_obj=target, drafter_obj=drafter, scheduler="fixed:4", dtype="auto",
                               max_batch=2, max_model_len=64, page_size=8, chunk_sizes=(8, 32), progress=False,
                               profile=False)
    try:
        assert "dtype: bfloat16 (weights and activations), KV cache: bfloat16" in caplog.text
        runner = engine.core.runner
        assert _float_dtypes(runner.target_params) == {BF16} and _float_dtypes(runner.drafter_params) == {BF16}
        assert _pool_dtypes(runner.target_kv) == {BF16} and _pool_dtypes(runner.drafter_kv) == {BF16}
        core = engine.core_only()
        assert _run_greedy(core, prompts) == ref
        assert core.metrics()["tokens_per_step"] > 1.2  # drafts were accepted: equality is not trivial
    finally:
        engine.stop()
    with pytest.raises(ValueError, match="dtype=float32 but the given target is bfloat16"):
        create_engine(target_obj=target, drafter_obj=drafter, dtype="float32", progress=False)


def test_f32_pools_under_a_bf16_target_stay_lossless(bf16):
    """kv_dtype float32 under bf16 weights: speculative greedy equals target-only greedy in that configuration
    (its own reference: f32 pools round k and v less than bf16 ones, so the outputs may differ from `ref`)."""
    target, drafter, prompts, _ = bf16
    kw = dict(max_new_tokens=MAX_NEW, ignore_eos=True, kv_dtype="float32", kernels="reference")  # see below
    plain = dspark_jax.generate(target, prompts, **kw)
    spec = dspark_jax.generate(target, prompts, drafter, policy="fixed:4", **kw)
    assert spec.tokens == plain.tokens
    assert spec.stats["tau"] > 1.2, spec.stats
    with pytest.raises(ValueError, match="the Pallas attention kernel reads pages in the queries' dtype"):
        dspark_jax.generate(target, prompts, **{**kw, "kernels": "pallas"})  # one dtype per kernel call


# ---- training: float32 master weights under a bf16 target --------------------------------------------------------
def test_bf16_target_trains_a_float32_drafter_with_float32_optimizer_state(bf16, tmp_path):
    from train.config import load_config
    from train.distill import init_train_state, make_optimizer, make_train_step
    from train.fit import build

    target, _, _, _ = bf16
    cfg = load_config(None, ["target.dtype=bfloat16", "drafter.kind=dspark", "drafter.block_size=4",
                             "drafter.overrides={num_layers: 1, markov_rank: 8}"])
    target, drafter = build(cfg, target)  # fit's drafter
    assert _float_dtypes(target.params) == {BF16} and _float_dtypes(drafter.params) == {F32}
    tx = make_optimizer(1e-3, 10, 2)
    params, opt = jax.eval_shape(lambda p: init_train_state(p, tx), nnx.to_pure_dict(drafter.params))
    assert _float_dtypes(params) == {F32} and _float_dtypes(opt) == {F32}
    # A bf16 drafter (as serving loads one) handed to training is trained as float32 master weights too.
    bf16_params = jax.tree.map(lambda x: x.astype(jnp.bfloat16), nnx.to_pure_dict(drafter.params))
    params, opt = jax.eval_shape(lambda p: init_train_state(p, tx), bf16_params)
    assert _float_dtypes(params) == {F32} and _float_dtypes(opt) == {F32}
    # One step traced: the bf16 target's forward feeds a float32 drafter; the updated state stays float32.
    S, T, A = 2, 32, 4
    batch = {"tokens": jax.ShapeDtypeStruct((S, T), jnp.int32), "lengths": jax.ShapeDtypeStruct((S,), jnp.int32),
             "anchors": jax.ShapeDtypeStruct((S, A), jnp.int32)}
    step = make_train_step(target, drafter, tx)
    new_params, new_opt, metrics = jax.eval_shape(step, params, opt, batch)
    assert _float_dtypes(new_params) == {F32} and _float_dtypes(new_opt) == {F32}
    assert metrics["loss"].dtype == F32
    # A carry (stored bf16) resumes as float32 master weights; serving loads it in the target's dtype.
    drafter.save(str(tmp_path / "carry"), dtype="bfloat16")
    resumed = dspark_jax.load_drafter(str(tmp_path / "carry"), target, dtype=jnp.float32)
    assert _float_dtypes(resumed.params) == {F32}
    assert _float_dtypes(dspark_jax.load_drafter(str(tmp_path / "carry"), target).params) == {BF16}


# ---- the CLIs ----------------------------------------------------------------------------------------------------
def test_serve_cli_parses_dtype_flags_and_passes_them_to_the_engine(capsys, monkeypatch):
    assert cli.DTYPES == DTYPE_CHOICES  # the JAX-free copy of the one list
    args = cli.parse_args([])
    assert (args.dtype, args.kv_dtype) == ("auto", "auto")
    args = cli.parse_args(["--dtype", "bfloat16", "--kv-dtype", "float32"])
    assert (args.dtype, args.kv_dtype) == ("bfloat16", "float32")
    with pytest.raises(SystemExit) as e:
        cli.parse_args(["--help"])
    assert e.value.code == 0 and "--dtype" in capsys.readouterr().out
    for flag in ("--dtype", "--kv-dtype"):
        for bad in ("fp16", "bf16", "float64"):
            with pytest.raises(SystemExit) as e:
                cli.parse_args([flag, bad])
            err = capsys.readouterr().err
            assert e.value.code == 2 and err.count("\n") == 1, err
            assert err.startswith(f"error: argument {flag}: invalid choice: '{bad}'") and "bfloat16" in err, err
    from serve.startup import EngineConfig

    seen = {}

    def create_engine(config, **kw):  # records what main passes, then stops it as a bad model spec would
        seen["config"] = config
        raise ValueError("stop here")

    monkeypatch.setitem(sys.modules, "serve.startup", types.SimpleNamespace(create_engine=create_engine,
                                                                           EngineConfig=EngineConfig))
    assert cli.main(["--dtype", "bfloat16", "--kv-dtype", "float32", "--compile-cache", "none",
                     "--log-level", "warning"]) == 2
    assert (seen["config"].dtype, seen["config"].kv_dtype) == ("bfloat16", "float32")


def test_generate_cli_parses_dtype_flags(capsys):
    gen = importlib.import_module("dspark_jax.generate")  # the module; `dspark_jax.generate` is the function
    args = gen.parse_args(["--prompt", "hi"])
    assert (args.dtype, args.kv_dtype) == ("auto", "auto")  # auto is the default now
    args = gen.parse_args(["--prompt", "hi", "--dtype", "bfloat16", "--kv-dtype", "float32"])
    assert (args.dtype, args.kv_dtype) == ("bfloat16", "float32")
    for flag in ("--dtype", "--kv-dtype"):
        with pytest.raises(SystemExit) as e:
            gen.parse_args(["--prompt", "hi", flag, "half"])
        err = capsys.readouterr().err
        assert e.value.code == 2 and f"error: argument {flag}: invalid choice: 'half'" in err, err
        assert "auto" in err and "bfloat16" in err and "float32" in err
