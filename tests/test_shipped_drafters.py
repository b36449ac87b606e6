"""The drafter shipped for SmolLM2-135M-Instruct (dspark_jax/drafters/): loadable by name, small (bf16
safetensors), calibrated, lossless with the real target, and actually useful (τ well above 1 on a chat prompt)."""

from __future__ import annotations

import os

import pytest

import dspark_jax
from dspark_jax.drafter import SHIPPED_DIR, shipped_drafters

NAMES = ["smollm2-135m-instruct/dspark"]
pytestmark = pytest.mark.slow


def _size_mb(path: str) -> float:
    return sum(os.path.getsize(os.path.join(r, f)) for r, _, fs in os.walk(path) for f in fs) / 2**20


def test_shipped_with_config_command_and_log():
    assert set(NAMES) <= set(shipped_drafters())
    for name in NAMES:
        d = os.path.join(SHIPPED_DIR, *name.split("/"))
        assert _size_mb(d) <= 22.0, (name, _size_mb(d))  # the whole tracked tree stays ≤ 30 MiB (test_docs)
        for f in ("drafter_config.json", "model.safetensors", "train_config.json", "metrics.jsonl", "README.md"):
            assert os.path.isfile(os.path.join(d, f)), (name, f)
        assert not os.path.exists(os.path.join(d, "params")), "final weights only: no Orbax training state"


@pytest.mark.parametrize("name", NAMES)
def test_greedy_with_the_shipped_drafter_equals_target_only(smollm2, name):
    drafter = dspark_jax.load_drafter(name, smollm2)
    assert drafter.config.kind == name.split("/")[1]
    if drafter.config.kind == "dspark":
        assert len(drafter.config.calibration) == drafter.config.block_size  # calibrated
    prompts = [smollm2.chat_ids("Write a Python function that reverses a string."),
               smollm2.chat_ids("What is 12 times 7? Explain briefly.")]
    ref = dspark_jax.generate(smollm2, prompts, max_new_tokens=40).tokens
    out = dspark_jax.generate(smollm2, prompts, drafter, max_new_tokens=40)
    assert out.tokens == ref
    assert out.stats["tau"] > 1.1, out.stats  # trained: above the 1 token per round of no speculation
