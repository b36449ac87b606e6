"""The drafter factory (train/factory.py, scripts/drafter_factory.py) end to end on a tiny random target on the
CPU: prompts, data, DSpark + EAGLE-3 trained on shared batches, held-out c*, flat files within the
device run's limits, reassembled into drafters that load and decode losslessly (greedy speculative output ==
target-only), and the byte-part split/join the target travels in."""

from __future__ import annotations

import json
import os
import pathlib

import pytest

import dspark_jax
from train import factory

ROOT = pathlib.Path(__file__).resolve().parents[1]


def _script():
    from conftest import load_script

    return load_script("drafter_factory")


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    """A tiny llama HF directory whose tokenizer (word level) has a ChatML-shaped template."""
    import transformers
    from conftest import make_hf_model, save_word_tokenizer

    d = tmp_path_factory.mktemp("factory-model")
    make_hf_model("llama", tied=True).save_pretrained(d, safe_serialization=True)
    save_word_tokenizer(d)
    tok = transformers.AutoTokenizer.from_pretrained(str(d))
    tok.chat_template = "t5 t6 t2 {% for m in messages %}t3 {{ m['content'] }} t2 {% endfor %}t4 "
    tok.save_pretrained(str(d))
    return d


def test_factory_end_to_end(model_dir, tmp_path, monkeypatch):
    out, dest = tmp_path / "out", tmp_path / "drafters"
    script = _script()
    evaluate, seen = factory.heldout_acceptance, {}

    def heldout_after_the_drafters_are_out(*args, **kwargs):
        # a run cut off during the held-out evaluation still returns its drafters, metrics and log
        seen["files"] = sorted(os.listdir(out))
        seen["metrics"] = json.loads((out / factory.METRICS_FILE).read_text())
        return evaluate(*args, **kwargs)

    monkeypatch.setattr(factory, "heldout_acceptance", heldout_after_the_drafters_are_out)
    sets = tmp_path / "eval_sets"
    sets.mkdir()
    (sets / "tiny.jsonl").write_text(json.dumps({"turns": ["t40 t41 t42 t43 t44 t45 t46 t47"]}) + "\n")
    script.main(["eval-prompts", "--source", str(sets), "--out", str(tmp_path / "eval.json.gz")])
    script.main(["run", "--target", str(model_dir), "--dtype", "float32", "--out", str(out), "--minutes", "2",
                 "--eval-prompts", str(tmp_path / "eval.json.gz"),
                 "--kinds", "dspark", "eagle3", "--magpie", "12", "--docstrings", "40",
                 "--max-query-tokens", "16", "--max-prompt-tokens", "48", "--gen-tokens", "1500",
                 "--gen-batch", "16", "--max-new-tokens", "24", "--seq-len", "64", "--batch-sequences", "4",
                 "--anchors-per-seq", "4", "--train-steps", "12", "--dspark-layers", "1", "--dflash-layers", "1",
                 "--markov-rank", "8", "--written-markov-rank", "4", "--heldout-share", "0.25", "--lr", "0.01"])
    assert seen["metrics"]["heldout_acceptance"] is None and set(seen["metrics"]["drafters"]) == {"dspark", "eagle3"}
    assert factory.LOG_FILE in seen["files"] and "train:" in (out / factory.LOG_FILE).read_text()
    files = sorted(os.listdir(out))
    assert files == seen["files"]
    assert len(files) <= factory.MAX_FILES and factory.METRICS_FILE in files and factory.LOG_FILE in files
    assert all((out / f).is_file() and (out / f).stat().st_size <= factory.MAX_FILE_BYTES for f in files)
    metrics = json.loads((out / factory.METRICS_FILE).read_text())
    assert metrics["data"]["response_tokens"] > 0 and metrics["train"]["steps"] == 12
    assert metrics["data"]["eval_prompts_banned"] == 1
    # DSpark trained at rank 8, written (and evaluated) cut to 4
    assert metrics["drafters"]["dspark"]["config"]["markov_rank"] == 4
    assert metrics["train"]["cut"]["dspark"]["markov_rank"] == {"from": 8, "to": 4}
    assert 0 < metrics["train"]["cut"]["dspark"]["kept_energy"] <= 1
    # its Markov head started from the training responses' bigram PMI
    assert metrics["train"]["markov_init"]["dspark"]["bigrams"] > 100
    for kind in ("dspark", "eagle3"):
        held = metrics["heldout_acceptance"][kind]
        assert len(held["t1"]) == 7 and all(0 <= c <= 1 for c in held["t1"])
        assert len(metrics["train"]["history"][kind]) >= 1
    script.main(["assemble", str(out), str(dest)])

    from dspark_jax.target import load_target

    target = load_target(str(model_dir))
    prompts = [[5, 6, 2, 3, 40, 41, 42]]
    plain = dspark_jax.generate(target, prompts, max_new_tokens=12, ignore_eos=True).tokens
    for kind in ("dspark", "eagle3"):
        d = dspark_jax.load_drafter(str(dest / kind), target)
        assert d.config.kind == kind
        spec = dspark_jax.generate(target, prompts, drafter=d, max_new_tokens=12, ignore_eos=True).tokens
        assert spec == plain, kind


def test_run_without_evaluation_prompts_stops(tmp_path, capsys):
    """No evaluation prompts to filter against stops the run before the target loads; the opt-out says so."""
    script = _script()
    args = ["run", "--target", "no-such-target", "--out", str(tmp_path / "out"),
            "--eval-prompts", str(tmp_path / "missing")]
    with pytest.raises(SystemExit, match="no evaluation prompts"):
        script.main(args)
    with pytest.raises(Exception) as err:  # the opt-out goes on to load the (missing) target
        script.main(args + ["--no-eval-filter"])
    assert not isinstance(err.value, SystemExit) or "no evaluation prompts" not in str(err.value)
    assert "WARNING: --no-eval-filter" in capsys.readouterr().out


def test_split_and_join_parts(tmp_path):
    blob = os.urandom(100_003)
    (tmp_path / "model.gguf").write_bytes(blob)
    info = factory.split_file(str(tmp_path / "model.gguf"), str(tmp_path / "parts"), part_bytes=40_000)
    assert info["parts"] == ["model.gguf.part0", "model.gguf.part1", "model.gguf.part2"]
    parts = [str(tmp_path / "parts" / p) for p in info["parts"]]
    joined = factory.join_parts(parts, str(tmp_path / "joined.gguf"), info["sha256"])
    assert pathlib.Path(joined).read_bytes() == blob
    with pytest.raises(ValueError, match="checksum"):
        factory.join_parts(parts[::-1], str(tmp_path / "bad.gguf"), info["sha256"])
    assert not (tmp_path / "bad.gguf").exists()


def test_planned_files_fit_the_smollm2_shapes():
    """The default drafters of SmolLM2's shape (full vocabulary) fit one run's 8 files of ≤ 16 MiB; with DFlash
    too they fit at Markov rank 128, and at the default 256 the planner says they do not."""
    from dspark_jax.config import ModelConfig

    cfg = ModelConfig.from_hf(dict(model_type="llama", vocab_size=49152, hidden_size=576, intermediate_size=1536,
                                   num_hidden_layers=30, num_attention_heads=9, num_key_value_heads=3,
                                   rms_norm_eps=1e-5, rope_theta=100000.0, tie_word_embeddings=True,
                                   max_position_embeddings=8192, eos_token_id=2, bos_token_id=1))

    class Shape:
        config = cfg

    def files(**kw):
        s = factory.FactorySettings(**kw)
        return factory.planned_files(factory.written_configs(factory.drafter_configs(Shape, s), s))

    assert sum(files().values()) == factory.MAX_FILES, files()  # DSpark at rank 256 takes five
    # trained at a higher rank, DSpark is written cut to written_markov_rank: the same files
    assert files(markov_rank=1024) == files()
    assert sum(files(kinds=("dspark", "eagle3", "dflash"), written_markov_rank=128).values()) <= factory.MAX_FILES
    assert sum(files(kinds=("dspark", "eagle3", "dflash")).values()) > factory.MAX_FILES


def test_settings_are_checked():
    with pytest.raises(ValueError, match="kinds"):
        factory.FactorySettings(kinds=("medusa",))
    with pytest.raises(ValueError, match="written_markov_rank"):
        factory.FactorySettings(markov_rank=64, written_markov_rank=128)
    with pytest.raises(ValueError, match="leave time"):
        factory.FactorySettings(prompt_share=0.5, data_share=0.3, train_share=0.3)


def test_budget_takes_an_overrun_from_later_phases(monkeypatch):
    now = [100.0]
    monkeypatch.setattr(factory.time, "monotonic", lambda: now[0])
    s = factory.FactorySettings(minutes=10, prompt_share=0.1, data_share=0.3, train_share=0.5)
    b = factory.Budget(s)
    assert b.deadline("prompts") == pytest.approx(100 + 60)  # 10% of 600 s
    now[0] = 100 + 240  # prompts overran by 180 s: 360 s left for data, train, rest (0.3 : 0.5 : 0.1)
    assert b.deadline("data") == pytest.approx(340 + 360 * 0.3 / 0.9)
    now[0] = 100 + 700  # past the end: every later phase gets nothing, not a negative time
    assert b.deadline("train") == pytest.approx(800)


def test_schedule_is_fitted_to_the_time_left():
    # 10 s left at 0.1 s a step: 95 more (5% margin) after the 11 done; never past the cap, never below done
    assert factory.fitted_steps(11, 0.1, 10.0, cap=20_000) == 11 + 95
    assert factory.fitted_steps(11, 0.001, 100.0, cap=2_000) == 2_000
    assert factory.fitted_steps(11, 0.1, -3.0, cap=2_000) == 11
    assert factory.fitted_steps(11, 0.1, 10.0, cap=5) == 11


def test_settable_learning_rate_follows_the_schedule_without_recompiling():
    """The factory's optimizer takes each step's rate from the host: the updates equal make_optimizer's at the same
    schedule, and setting the rate keeps the jitted step's signature (one compile)."""
    import jax
    import jax.numpy as jnp
    import numpy as np

    from train.distill import make_optimizer, make_settable_optimizer, schedule_values, set_learning_rate

    steps, params = 12, {"w": jnp.arange(6.0).reshape(2, 3)}
    lrs = schedule_values(3e-2, steps)
    ref_tx, tx = make_optimizer(3e-2, steps), make_settable_optimizer()
    traces = []

    @jax.jit
    def update(tx_state, p, g):
        traces.append(1)
        u, tx_state = tx.update(g, tx_state, p)
        return jax.tree.map(jnp.add, p, u), tx_state

    ref_p, ref_s, p, st = params, ref_tx.init(params), params, tx.init(params)
    for i in range(steps):
        g = {"w": jnp.sin(ref_p["w"] * (i + 1))}
        u, ref_s = ref_tx.update(g, ref_s, ref_p)
        ref_p = jax.tree.map(jnp.add, ref_p, u)
        p, st = update(set_learning_rate(st, lrs[i]), p, {"w": jnp.sin(p["w"] * (i + 1))})
    assert lrs[0] == 0 and lrs.max() == np.float32(3e-2)
    np.testing.assert_allclose(p["w"], ref_p["w"], rtol=1e-6, atol=1e-7)
    assert len(traces) == 1


def test_gpu_factory_script_stages_parts_and_refuses_a_missing_one(tmp_path):
    """scripts/gpu_factory.sh: `stage N` copies the carried part N to the stage folder; `run` stops before any
    work when a part is neither carried nor staged (a stage run whose machine lapsed)."""
    import subprocess

    carried, stage = tmp_path / "in", tmp_path / "stage"
    carried.mkdir()
    info = factory.split_file(_write(tmp_path / "t.gguf", 10_000), str(carried), part_bytes=4_000)
    (carried / "t.gguf.parts.json").write_text(json.dumps(info))
    env = {**os.environ, "FACTORY_IN": str(carried), "FACTORY_STAGE": str(stage), "OUT": str(tmp_path / "out")}
    script = str(ROOT / "scripts" / "gpu_factory.sh")
    ok = subprocess.run([script, "stage", "0"], env=env, capture_output=True, text=True)
    assert ok.returncode == 0 and (stage / "t.gguf.part0").read_bytes() == (carried / "t.gguf.part0").read_bytes()
    (carried / "t.gguf.part1").unlink()  # neither carried nor staged
    bad = subprocess.run([script, "run"], env=env, capture_output=True, text=True)
    assert bad.returncode == 1 and "part t.gguf.part1 is neither carried nor staged" in bad.stderr
    assert subprocess.run([script, "stage", "5"], env=env, capture_output=True, text=True).returncode == 1


def _write(path, n: int) -> str:
    path.write_bytes(os.urandom(n))
    return str(path)
