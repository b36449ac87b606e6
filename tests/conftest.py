"""Shared fixtures: tiny random Hugging Face models built offline, and the real default target (loaded once)."""

from __future__ import annotations

import json
import os

import numpy as np
import pytest

from dspark_jax.config import ModelConfig
from dspark_jax.target import Target
from dspark_jax.weights import build_decoder, read_hf_dir

TINY = dict(vocab_size=128, hidden_size=64, intermediate_size=96, num_hidden_layers=3, num_attention_heads=4,
            num_key_value_heads=2, max_position_embeddings=256, rms_norm_eps=1e-5, bos_token_id=1,
            eos_token_id=2, pad_token_id=0)


def make_hf_model(model_type: str, *, tied: bool, seed: int = 0, **overrides):
    """A tiny randomly initialised transformers model (torch, f32), every weight perturbed so norms aren't 1."""
    import torch
    import transformers

    kw = {**TINY, "tie_word_embeddings": tied, **overrides}
    if model_type == "qwen3":
        kw.setdefault("head_dim", 24)  # deliberately != hidden / heads
        cfg = transformers.Qwen3Config(**kw)
    else:
        cfg = transformers.LlamaConfig(**kw)
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(cfg).float().eval()
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.05 * torch.randn_like(p))
    return model


def target_from_hf(model, tmp_path, dtype=None) -> Target:
    """Saves an HF model as safetensors and loads it through our declarative table."""
    import jax.numpy as jnp

    model.save_pretrained(tmp_path, safe_serialization=True)
    config, tensors = read_hf_dir(str(tmp_path))
    return Target(build_decoder(ModelConfig.from_hf(config), tensors, dtype or jnp.float32), source=str(tmp_path))


def hf_logits(model, ids: np.ndarray) -> np.ndarray:
    import torch

    with torch.no_grad():
        return model(torch.as_tensor(ids, dtype=torch.long)).logits.float().numpy()


@pytest.fixture(scope="session")
def smollm2():
    """The real SmolLM2-135M-Instruct target (fetched on first use), loaded once per test session."""
    from dspark_jax import load_target

    return load_target("smollm2-135m-instruct")


def rewrite_config(directory, fn):
    path = os.path.join(directory, "config.json")
    with open(path) as f:
        d = json.load(f)
    d = fn(d)
    with open(path, "w") as f:
        json.dump(d, f)


@pytest.fixture(autouse=True, scope="module")
def _release_compiled_programs():
    """Drops JAX's compiled executables after each test module. A full run compiles thousands of programs;
    late in such runs XLA:CPU segfaulted while compiling (in different tests each time), which fits running out
    of memory mappings (vm.max_map_count) rather than any one test's logic."""
    yield
    import jax

    jax.clear_caches()
