"""Speculative decoding on the real SmolLM2-135M-Instruct: greedy output equals target-only greedy output."""

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


@pytest.mark.parametrize("kind,L", [("dspark", 7), ("dspark", 16), ("dflash", 4), ("eagle3", 7)])
def test_smollm2_greedy_speculative_equals_target_only(smollm2, prompts_and_reference, kind, L):
    prompts, ref = prompts_and_reference
    kw = {"num_layers": 1} if kind != "eagle3" else {}
    if kind == "dspark":
        kw["markov_rank"] = 32
    drafter = dspark_jax.init_drafter(smollm2, kind=kind, block_size=L, **kw)
    out = dspark_jax.generate(smollm2, prompts, drafter, max_new_tokens=32, ignore_eos=True)
    assert out.tokens == ref.tokens
