"""Speculative decoding on the real SmolLM2-135M-Instruct: greedy output equals target-only greedy output.

The drafter is the shipped, trained DSpark (dspark_jax/drafters/), run at block sizes other than the 7 it
was trained with too (EAGLE-3 and DFlash ship no weights; their losslessness is tested on tiny targets,
tests/test_spec_decode.py): an untrained drafter is (almost) never accepted on a real model, and with only
rejections greedy equality holds trivially, so every case also asserts that drafts were accepted.
"""

from __future__ import annotations

import pytest

import dspark_jax

pytestmark = pytest.mark.slow

PROMPTS = ["What is the capital of France?", "Write a Python function that reverses a list.",
           "Explain photosynthesis in one sentence."]


@pytest.fixture(scope="module")
def prompts_and_reference(smollm2):
    prompts = [smollm2.chat_ids(p) for p in PROMPTS]
    ref = dspark_jax.generate(smollm2, prompts, max_new_tokens=32, ignore_eos=True)
    return prompts, ref


@pytest.mark.parametrize("kind,L", [("dspark", 7), ("dspark", 16), ("dspark", 4)])
def test_smollm2_greedy_speculative_equals_target_only(smollm2, prompts_and_reference, kind, L):
    prompts, ref = prompts_and_reference
    drafter = dspark_jax.load_drafter(f"smollm2-135m-instruct/{kind}", smollm2)
    if L != drafter.config.block_size:  # the calibration temperatures are per position of the trained block
        drafter = drafter.with_config(block_size=L, calibration=(), calibration_offsets=())
    out = dspark_jax.generate(smollm2, prompts, drafter, max_new_tokens=32, ignore_eos=True)
    assert out.tokens == ref.tokens
    assert sum(out.stats["acceptance_accepts"]) > 0 and out.stats["tau"] > 1.1, (kind, L, out.stats)


@pytest.mark.parametrize("scheduler", ["fixed:3", "dspark"])
def test_smollm2_engine_compiles_nothing_after_warm_up(smollm2, prompts_and_reference, scheduler):
    """The serving engine on the real model and shipped drafter: after start-up, serving (chained rounds feeding
    device outputs back, plain steps, probes) triggers no XLA compilation of the round's programs. Counted in
    compilations, not traces: a program compiled again for an argument's placement was a 7 s stall in the first
    round of every engine (one user saw ~2 tokens/s). Sizes no other test uses, so nothing is shared."""
    from dspark_jax.runner import COMPILES, PROGRAMS
    from serve.startup import create_engine
    from serve.types import EngineRequest, SamplingParams

    prompts, ref = prompts_and_reference
    drafter = dspark_jax.load_drafter("smollm2-135m-instruct/dspark", smollm2)
    engine = create_engine(target_obj=smollm2, drafter_obj=drafter, scheduler=scheduler, max_batch=1,
                           max_model_len=200, page_size=8, progress=False)
    try:
        core = engine.core_only()
        compiled = {k: COMPILES[k] for k in PROGRAMS}
        out: list[int] = []
        core.add_request(EngineRequest(request_id="r", prompt_ids=prompts[0],
                                       on_output=lambda o: out.extend(o.token_ids),
                                       params=SamplingParams(max_tokens=32, temperature=0.0,
                                                              ignore_eos=True)))
        while core.has_work():
            core.step()
        assert out == ref.tokens[0]
        assert core.stats["chained_steps_total"] > 0
        assert {k: COMPILES[k] for k in PROGRAMS} == compiled
    finally:
        engine.stop()
