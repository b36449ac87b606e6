"""Held-out acceptance in `fit` (train/heldout.py): logged every N steps, plotted, and the best step saved.

The held-out set is the tiny target's own T = 1 samples of prompts the training set does not hold.
"""

from __future__ import annotations

import json

import jax
import numpy as np
import pytest
from test_train_pipeline import _cfg, _overrides, tiny  # noqa: F401  (tiny: a module fixture)

import dspark_jax
from train.config import load_config
from train.prepare import encode_record, write_shards


@pytest.fixture(scope="module")
def heldout_dir(tiny, tmp_path_factory):  # noqa: F811
    target, _ = tiny
    prompts = [list(np.random.default_rng(100 + i).integers(3, 128, size=4 + i % 5)) for i in range(6)]
    res = dspark_jax.generate(target, prompts, max_new_tokens=40, temperature=1.0, seed=7, ignore_eos=True)
    out = tmp_path_factory.mktemp("heldout")
    write_shards([encode_record(p + r, len(p), "chat") for p, r in zip(prompts, res.tokens, strict=True)],
                 str(out), num_shards=1, seed=0)
    return str(out)


def _heldout_cfg(data, heldout, out, **optim):
    return load_config(None, [*_overrides(_cfg(data, out, **optim)), "heldout.every=2",
                              f"heldout.sets={{t1: {heldout}}}", "heldout.sequences=5", "heldout.anchors_per_seq=6"])


def test_fit_logs_heldout_acceptance_and_saves_the_best_step(tiny, heldout_dir, tmp_path, monkeypatch):  # noqa: F811
    import orbax.checkpoint as ocp

    from train.fit import fit

    target, data = tiny
    # A learning rate far too high: held-out acceptance rises at first, then collapses, so the best step is not the
    # last one.
    cfg = _heldout_cfg(data, heldout_dir, tmp_path, steps=8, lr=0.1, warmup=1)
    cfg = load_config(None, [*_overrides(cfg), "run.ckpt_every=2", "run.keep=10"])
    fit(cfg, target=target, progress=False)
    recs = [json.loads(ln) for ln in open(tmp_path / "metrics.jsonl")]
    evals = [r for r in recs if "heldout" in r]
    assert [r["step"] for r in evals] == [2, 4, 6, 8]
    for r in evals:
        res = r["heldout"]["t1"]
        assert len(res["c_star"]) == len(res["top1"]) == 4 and all(0 <= x <= 1 for x in res["c_star"] + res["top1"])
        assert res["slots"][0] > 0
        assert r["heldout_summary"] == pytest.approx(np.mean(res["c_star"]), abs=1e-5)
    summaries = [r["heldout_summary"] for r in evals]
    best_step = evals[int(np.argmax(summaries))]["step"]
    assert best_step != 8, summaries  # the premise: otherwise "saves the last step" would pass too
    assert json.loads((tmp_path / "best.json").read_text())["step"] == best_step
    assert (tmp_path / "heldout.png").stat().st_size > 1000

    # The saved drafter holds the best step's parameters (its checkpoint), and drafter-last the last step's.
    saved = dspark_jax.load_drafter(str(tmp_path / "drafter"), target)
    last = dspark_jax.load_drafter(str(tmp_path / "drafter-last"), target)
    mngr = ocp.CheckpointManager(tmp_path / "checkpoints")
    from flax import nnx

    for step, drafter in ((best_step, saved), (8, last)):
        ckpt = mngr.restore(step, args=ocp.args.Composite(params=ocp.args.StandardRestore()))["params"]
        mine, theirs = _flat(nnx.to_pure_dict(drafter.params)), _flat(ckpt)
        assert mine.keys() == theirs.keys()
        for k in mine:
            np.testing.assert_array_equal(mine[k], theirs[k], err_msg=f"step {step}: {k}")
    # ... and re-measured by `python -m train heldout`, it gives the logged best value.
    from dspark_jax import target as target_module
    from train.__main__ import main

    monkeypatch.setattr(target_module, "load_target", lambda spec: target)  # a tiny model has no tokenizer
    assert main(["heldout", "--drafters", str(tmp_path / "drafter"), "--sets", f"t1={heldout_dir}", "--target",
                 target.source, "--sequences", "5", "--anchors", "6", "--seq-len", "32", "--batch", "4",
                 "--out", str(tmp_path / "again.json")]) == 0
    again = json.loads((tmp_path / "again.json").read_text())["drafters"][str(tmp_path / "drafter")]
    assert np.mean(again["t1"]["c_star"]) == pytest.approx(max(summaries), abs=1e-5)


def _flat(tree) -> dict:
    """{"a.0.b": array} (Orbax restores list indices as string keys)."""
    return {".".join(str(getattr(k, "key", getattr(k, "idx", k))) for k in path): np.asarray(x)
            for path, x in jax.tree_util.tree_flatten_with_path(tree)[0]}


def test_heldout_config_errors():
    with pytest.raises(ValueError, match="needs heldout.sets"):
        load_config(None, ["heldout.every=5"])
    with pytest.raises(ValueError, match="best_set"):
        load_config(None, ["heldout.every=5", "heldout.sets={a: x}", "heldout.best_set=b"])
    with pytest.raises(ValueError, match="best_measure"):
        load_config(None, ["heldout.every=5", "heldout.sets={a: x}", "heldout.best_measure=tau"])
