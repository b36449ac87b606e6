"""`python -m train eval` (train/evaluate.py, which produces the README's τ table) on a tiny target, against an
independent count.

The count: every round the runner dispatches is recorded (a pass-through wrapper), and the rounds are replayed with a
stop rule written here (a row is live until it has delivered max_new_tokens or an EOS; the prefill gives the
first token). τ = Σ emitted / Σ live request-rounds, conditional acceptance at position k = #(m > k) / #(m ≥ k)
over live request-rounds (every draft token is verified under the fixed policy), and macro τ = the mean of the
three domains' τ. The random tiny target is near-uniform, so at temperature 1 drafts are often accepted.
"""

from __future__ import annotations

import json
import os

import numpy as np
import pytest
from conftest import make_hf_model, save_word_tokenizer

import dspark_jax
import dspark_jax.runner as runner
from dspark_jax.target import load_target
from train import evaluate

EOS = 2
# Three short prompts per domain (< 16 tokens: one padded prompt shape, so one compile per batch size).
PROMPTS = {d: [" ".join(f"t{t}" for t in np.random.default_rng(10 * i + j).integers(3, 128, size=3 + 4 * j))
               for j in range(3)] for i, d in enumerate(("chat", "code", "math"))}


class Recorder:
    """Wraps the runner's prefill and round dispatch (dspark_jax/runner.py); one entry per `generate` call.
    Rounds dispatched after a row stopped are recorded too: the replay ignores finished rows."""

    def __init__(self, monkeypatch):
        self.calls = []
        init, dispatch = runner.ModelRunner.__init__, runner.ModelRunner.dispatch
        prefill_pass = runner.ModelRunner._prefill_pass  # under `prefill` and `prefill_many` alike

        def init_(obj, *a, **k):
            init(obj, *a, **k)
            self.calls.append({"first": [], "rounds": []})

        def prefill_(obj, chunks, starts, *a, **k):
            out = prefill_pass(obj, chunks, starts, *a, **k)
            assert not any(starts), "one chunk per prompt here"
            self.calls[-1]["first"].extend(np.asarray(out[0])[: len(chunks)].tolist())
            return out

        def dispatch_(obj, *a, **k):
            out = dispatch(obj, *a, **k)
            self.calls[-1]["rounds"].append({"emitted": np.asarray(out.emitted),
                                             "num_emitted": np.asarray(out.num_emitted),
                                             "m": np.asarray(out.num_accepted), "conf": np.asarray(out.confidence)})
            return out

        monkeypatch.setattr(runner.ModelRunner, "__init__", init_)
        monkeypatch.setattr(runner.ModelRunner, "_prefill_pass", prefill_)
        monkeypatch.setattr(runner.ModelRunner, "dispatch", dispatch_)


def independent_count(calls, max_new_tokens: int, L: int) -> dict:
    """τ, row-rounds, per-position attempts/accepts and the live rows' (m, conf) over recorded calls."""
    emitted = rounds = 0
    attempts, accepts = np.zeros(L, int), np.zeros(L, int)
    ms, confs = [], []
    for call in calls:
        delivered = [1] * len(call["first"])
        done = [int(t) == EOS or max_new_tokens <= 1 for t in call["first"]]
        for r in call["rounds"]:
            for b in range(len(done)):
                if done[b]:
                    continue
                m, n = int(r["m"][b]), int(r["num_emitted"][b])
                assert n == m + 1, (m, n)  # accepted + one recovered or bonus token
                emitted += n
                rounds += 1
                attempts[: min(m + 1, L)] += 1
                accepts[:m] += 1
                ms.append(m)
                confs.append(r["conf"][b])
                for t in r["emitted"][b, :n]:
                    delivered[b] += 1
                    if int(t) == EOS or delivered[b] >= max_new_tokens:
                        done[b] = True
                        break
        assert all(done), "generate stopped while a row was still live"
    return {"tau": emitted / rounds, "row_rounds": rounds, "attempts": attempts, "accepts": accepts,
            "m": np.array(ms), "conf": np.array(confs)}


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    """The tiny llama saved with a word-level tokenizer and chat template (loads through load_target)."""
    d = tmp_path_factory.mktemp("tiny-llama-tok")
    make_hf_model("llama", tied=True).save_pretrained(d, safe_serialization=True)
    save_word_tokenizer(d)
    return str(d)


def test_run_rounds_counts_match_an_independent_replay(tiny_dir, monkeypatch):
    target = load_target(tiny_dir)
    drafter = dspark_jax.init_drafter(target, kind="dspark", block_size=4, num_layers=1, markov_rank=8)
    rec = Recorder(monkeypatch)
    # 3 prompts in batches of 2: sums over uneven batches; EOS is live (ignore_eos=False).
    stats, z, m = evaluate.run_rounds(target, drafter, PROMPTS["chat"], max_new_tokens=12, temperature=1.0,
                                      batch_size=2, seed=0)
    assert len(rec.calls) == 2
    ref = independent_count(rec.calls, 12, 4)
    assert stats["row_rounds"] == ref["row_rounds"]
    assert stats["tau"] == pytest.approx(ref["tau"], rel=1e-12)
    assert stats["acceptance_attempts"] == ref["attempts"].tolist()
    np.testing.assert_allclose(stats["conditional_acceptance"], ref["accepts"] / np.maximum(ref["attempts"], 1))
    np.testing.assert_array_equal(m, ref["m"])
    c = np.clip(ref["conf"], 1e-7, 1 - 1e-7)
    np.testing.assert_allclose(z, np.log(c) - np.log1p(-c), rtol=1e-5, atol=1e-5)
    assert ref["accepts"][0] > 0 and stats["tau"] > 1.0  # acceptances happened: the count is not trivial


def test_eval_cli_tau_table_equals_the_independent_count(tiny_dir, tmp_path, monkeypatch):
    """`python -m train eval` (in-process) with two saved drafters, two prompts per domain in one batch:
    eval.json's per-domain τ, macro τ, ratios and acceptance curves equal the replayed counts; plots written."""
    from train.__main__ import main

    target = load_target(tiny_dir)
    dirs = []
    for kind in ("dspark", "dflash"):
        extra = {"markov_rank": 8} if kind == "dspark" else {}
        d = dspark_jax.init_drafter(target, kind=kind, block_size=3, num_layers=1, seed=1, **extra)
        d.save(str(tmp_path / kind))
        dirs.append(str(tmp_path / kind))
    asked = []

    def load_prompts(split, domain, n, seed=0):
        asked.append((split, domain, n))
        return PROMPTS[domain][:n]

    monkeypatch.setattr(evaluate.datasets, "load_prompts", load_prompts)
    rec = Recorder(monkeypatch)
    out = tmp_path / "eval"
    assert main(["eval", "--drafters", *dirs, "--target", tiny_dir, "--prompts", "2", "--max-new-tokens", "10",
                 "--batch-size", "2", "--out", str(out)]) == 0
    assert sorted(asked) == [("eval", d, 2) for d in ("chat", "code", "math")]
    with open(out / "eval.json") as f:
        result = json.load(f)
    assert os.path.getsize(out / "tau.png") > 0 and os.path.getsize(out / "acceptance.png") > 0
    assert len(rec.calls) == 2 * 3  # drafters × domains, one batch each
    macro = {}
    for i, name in enumerate(("dspark", "dflash")):
        per = result["drafters"][name]["per_domain"]
        taus = []
        for j, domain in enumerate(("chat", "code", "math")):
            ref = independent_count(rec.calls[i * 3 + j : i * 3 + j + 1], 10, 3)
            assert per[domain]["row_rounds"] == ref["row_rounds"], (name, domain)
            assert per[domain]["tau"] == pytest.approx(ref["tau"], rel=1e-12), (name, domain)
            np.testing.assert_allclose(per[domain]["conditional_acceptance"],
                                       ref["accepts"] / np.maximum(ref["attempts"], 1))
            taus.append(ref["tau"])
        macro[name] = float(np.mean(taus))
        assert result["drafters"][name]["macro_tau"] == pytest.approx(macro[name], rel=1e-12)
        assert result["drafters"][name]["kind"] == name and result["drafters"][name]["block_size"] == 3
    assert result["macro_tau_ratios"]["dspark/dflash"] == pytest.approx(macro["dspark"] / macro["dflash"])
    assert min(macro.values()) > 1.0  # drafts were accepted
