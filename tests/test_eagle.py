"""EAGLE-3 through the paged round (dspark_jax/runner.py): its L autoregressive draft steps over its own paged
context, served by the engine as any drafter is. The drafting maths against the dense reference is
tests/test_paged.py; `generate`'s greedy equality and distribution tests for every kind are
tests/test_spec_decode.py."""

from __future__ import annotations

import pytest
from conftest import spec_prompts
from test_engine import check_engine_samples_follow
from test_spec_decode import _drafter, _exact_joint, small_vocab_target  # noqa: F401, F811 (a fixture)

import dspark_jax
from dspark_jax.runner import COMPILES, PROGRAMS, ModelRunner
from serve.engine import EngineCore
from serve.startup import create_engine
from serve.types import EngineRequest, SamplingParams

MAX_NEW = 16


def _engine(target, drafter, scheduler, **kw):
    kw = {"max_batch": 2, "max_model_len": 64, "page_size": 8, "chunk_sizes": (8,), "progress": False, **kw}
    return create_engine(target_obj=target, drafter_obj=drafter, scheduler=scheduler, **kw).core_only()


def _run(core, prompts, **params) -> list[list[int]]:
    outs: dict[str, list[int]] = {}
    for i, p in enumerate(prompts):
        core.add_request(EngineRequest(
            request_id=str(i), prompt_ids=p, params=SamplingParams(max_tokens=MAX_NEW, ignore_eos=True, **params),
            on_output=lambda o: outs.setdefault(o.request_id, []).extend(o.token_ids)))
    while core.has_work():
        core.step()
    return [outs[str(i)] for i in range(len(prompts))]


def test_engine_serves_an_eagle3_drafter_greedily_as_target_only(tiny_hf_targets, distilled_drafter):
    """A distilled EAGLE-3 drafter in the engine (4 ragged prompts, 2 slots: continuous batching, prompts
    prefilled in chunks of 8 so the feature pool carries f_{p−1} across chunks): the target-only greedy tokens,
    drafts accepted, and nothing traced or compiled after warm-up."""
    target = tiny_hf_targets["llama"][1]
    prompts = spec_prompts()
    ref = dspark_jax.generate(target, prompts, max_new_tokens=MAX_NEW, ignore_eos=True).tokens
    core = _engine(target, distilled_drafter("llama", "eagle3", 4), "fixed:4")
    warm = dict(core.runner.traces)
    assert warm and all(v == 1 for v in warm.values())
    compiled = {k: COMPILES[k] for k in PROGRAMS}
    assert _run(core, prompts, temperature=0.0) == ref
    assert dict(core.runner.traces) == warm
    assert {k: COMPILES[k] for k in PROGRAMS} == compiled
    assert core.metrics()["tokens_per_step"] > 1.2  # drafts were accepted: the speculative path ran


def test_dspark_scheduler_refuses_eagle3_which_has_no_confidence(tiny_hf_targets):
    target = tiny_hf_targets["llama"][1]
    runner = ModelRunner(target, _drafter(target, "eagle3", 3), max_batch=2, num_pages=32, page_size=8, max_pages=16)
    with pytest.raises(ValueError, match="confidence"):
        EngineCore(runner, scheduler="dspark", max_model_len=64)


def test_sampled_eagle3_outputs_through_the_engine_follow_the_target(small_vocab_target):  # noqa: F811
    """T = 1 through the engine with a poor random EAGLE-3 drafter (recovery exercised): the first 3 tokens
    follow the exact target distribution (chi-square, as tests/test_engine.py does for DSpark)."""
    target = small_vocab_target
    prompt = [3, 5, 2, 7, 4, 6, 1, 3, 5]  # 9 tokens: two prefill chunks of 8
    joint = _exact_joint(target, prompt, 1.0, 0, 1.0).reshape(-1)
    core = _engine(target, _drafter(target, "eagle3", 3, seed=1, scramble=0.3), "fixed:3", max_batch=32,
                   max_model_len=16, page_size=4)
    check_engine_samples_follow(core, prompt, joint)


@pytest.mark.parametrize("kind", ["dspark", "dflash", "eagle3"])
def test_generate_calls_on_round_for_every_drafter_kind(tiny_hf_targets, kind):
    """`on_round(live, lengths, num_accepted, confidence)` after every round, whatever the drafter."""
    target = tiny_hf_targets["llama"][1]
    L = 3
    calls = []
    out = dspark_jax.generate(target, spec_prompts(), _drafter(target, kind, L), max_new_tokens=8, ignore_eos=True,
                              on_round=lambda *a: calls.append(a))
    assert len(calls) == out.stats["rounds"] > 0
    live, lengths, accepted, conf = calls[0]
    assert live.shape == lengths.shape == accepted.shape == (4,) and conf.shape == (4, L)
    assert live.all() and (lengths == L).all() and (accepted <= lengths).all()
