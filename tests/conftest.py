"""Shared fixtures: tiny random Hugging Face models built offline, and the real default target (loaded once)."""

from __future__ import annotations

import json
import os
import sys

# The suite compiles a few hundred small XLA:CPU programs and runs each a few times, so LLVM's optimisation
# passes are most of its time: tests compile with them off (about a third faster; what a test checks —
# equality, distributions, shapes — does not depend on them). Benchmarks, the server smoke run and users
# compile with XLA's defaults. DSPARK_TEST_XLA_DEFAULTS=1 runs the suite with the defaults too.
if os.environ.get("DSPARK_TEST_XLA_DEFAULTS") != "1":
    os.environ["XLA_FLAGS"] = " ".join([os.environ.get("XLA_FLAGS", ""), "--xla_backend_optimization_level=0",
                                        "--xla_llvm_disable_expensive_passes=true"]).strip()

import numpy as np
import pytest

# One persistent XLA compilation cache for the whole run, shared by the xdist workers and the subprocesses tests
# start (servers, notebooks, CLIs): tests build the same programs many times over (every engine, drafter and
# runner traces its own closures), and a program whose HLO, flags and compile options match one compiled before
# is read back instead of compiled. Each run starts empty (a directory per xdist run, removed at the end).
# DSPARK_TEST_COMPILE_CACHE=0 turns it off.
if os.environ.get("DSPARK_TEST_COMPILE_CACHE", "1") != "0" and "JAX_COMPILATION_CACHE_DIR" not in os.environ:
    import tempfile

    _run = os.environ.get("PYTEST_XDIST_TESTRUNUID") or f"pid{os.getpid()}"
    _OWN_CACHE = os.path.join(tempfile.gettempdir(), f"dspark-test-xla-{_run}")
    os.environ["JAX_COMPILATION_CACHE_DIR"] = _OWN_CACHE
    os.environ["JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS"] = "0"
    # A size cap turns on jax's file lock around every read and write: the processes share entries safely.
    os.environ["JAX_COMPILATION_CACHE_MAX_SIZE"] = str(8 << 30)
else:
    _OWN_CACHE = None

from dspark_jax.config import ModelConfig
from dspark_jax.target import Target
from dspark_jax.weights import build_decoder, read_hf_dir


def pytest_sessionfinish(session):
    """The run's compilation cache goes when the run ends: in the xdist controller, or the only process."""
    if _OWN_CACHE and "PYTEST_XDIST_WORKER" not in os.environ:
        import shutil

        shutil.rmtree(_OWN_CACHE, ignore_errors=True)


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


# ---- tiny targets and drafters that accept (shared by the speculative-decoding tests) ---------------------------
def spec_prompts(vocab: int = 128) -> list[list[int]]:
    """The four ragged prompts of the tiny speculative-decoding tests (lengths 5, 17, 2, 9)."""
    return [list(map(int, np.random.default_rng(i).integers(3, vocab, size=n))) for i, n in enumerate([5, 17, 2, 9])]


REFERENCE_PROMPTS = [[5, 17, 3, 99, 42], [7, 7, 120, 8, 30, 61, 2, 90, 15], [64, 11]]
# A short distillation: one layer, one block size (7; the weights serve any L), the target's greedy outputs.
DISTILL_SHAPES = {"dspark": dict(num_layers=1, markov_rank=16), "dflash": dict(num_layers=1), "eagle3": {}}
DISTILL_STEPS, DISTILL_BATCH, DISTILL_LR = 60, 16, 1e-2


def distill_tiny_drafter(target, kind: str, sequences, prompt_lengths):
    """A drafter of `kind` trained briefly on `sequences` (prompt + the target's greedy continuation)."""
    import dspark_jax
    from train.distill import train_drafter

    d0 = dspark_jax.init_drafter(target, kind=kind, block_size=7, seed=0, **DISTILL_SHAPES[kind])
    return train_drafter(target, d0, sequences, steps=DISTILL_STEPS, batch_size=DISTILL_BATCH, seed=0,
                         lr=DISTILL_LR, prompt_lengths=prompt_lengths, progress=False)


def greedy_training_data(target, max_new_tokens: int = 40):
    """Training sequences for `distill_tiny_drafter`: the test prompts (so the tests' own trajectories are in the
    data and drafts get accepted there) plus 48 random ones, each with the target's greedy continuation."""
    import dspark_jax

    prompts = spec_prompts() + REFERENCE_PROMPTS
    prompts += [list(map(int, np.random.default_rng(100 + i).integers(3, 128, size=3 + i % 7))) for i in range(48)]
    res = dspark_jax.generate(target, prompts, max_new_tokens=max_new_tokens, ignore_eos=True)
    return [p + r for p, r in zip(prompts, res.tokens, strict=True)], [len(p) for p in prompts]


class _Lazy(dict):
    def __init__(self, make):
        super().__init__()
        self._make = make

    def __missing__(self, key):
        self[key] = value = self._make(key)
        return value


@pytest.fixture(scope="session")
def tiny_hf_targets(tmp_path_factory):
    """{"llama" (tied), "qwen3" (untied)} → (the tiny transformers model, its Target), built on first use."""

    def make(model_type):
        hf = make_hf_model(model_type, tied=model_type == "llama")
        return hf, target_from_hf(hf, tmp_path_factory.mktemp(f"tiny-{model_type}"))

    return _Lazy(make)


@pytest.fixture(scope="session")
def distilled_drafter(tiny_hf_targets):
    """distilled_drafter(model_type, kind, block_size=7): a drafter trained (once per session) on the tiny
    target's greedy outputs, so greedy speculative tests really accept drafts (random drafters almost never do,
    and with only rejections greedy equality holds trivially)."""
    data = _Lazy(lambda mt: greedy_training_data(tiny_hf_targets[mt][1]))
    trained = _Lazy(lambda key: distill_tiny_drafter(tiny_hf_targets[key[0]][1], key[1], *data[key[0]]))

    def get(model_type: str, kind: str, block_size: int = 7):
        d = trained[model_type, kind]
        return d if block_size == 7 else d.with_config(block_size=block_size)

    return get


def save_word_tokenizer(directory, vocab_size: int = 128) -> None:
    """Saves an offline word-level tokenizer ("t0".."t{V-1}" ↔ ids, split on spaces) with a chat template that
    joins message contents, so that a tiny model directory loads through `load_target` and `chat_ids` works:
    chat_ids("t5 t6") == [5, 6]. eos = "t2", bos = "t1", pad/unk = "t0" (the TINY config's ids)."""
    import transformers
    from tokenizers import Tokenizer, models, pre_tokenizers

    tok = Tokenizer(models.WordLevel({f"t{i}": i for i in range(vocab_size)}, unk_token="t0"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    fast = transformers.PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="t0", pad_token="t0",
                                                bos_token="t1", eos_token="t2")
    fast.chat_template = "{% for m in messages %}{{ m['content'] }} {% endfor %}"
    fast.save_pretrained(str(directory))


def chatml_word_target(tmp_path, seed: int = 0):
    """A tiny random llama Target with a word-level tokenizer whose chat template is ChatML-shaped: a system
    turn, then "t3 <user words> t2", then the assistant opener "t4" (t2 = eos ends every turn), so Magpie's
    pre-query prefix is "t5 t6 t2 t3 " and the end-of-turn token is t2."""
    import transformers

    target = target_from_hf(make_hf_model("llama", tied=True, seed=seed), tmp_path / "model")
    save_word_tokenizer(tmp_path / "tok")
    tok = transformers.AutoTokenizer.from_pretrained(str(tmp_path / "tok"))
    tok.chat_template = "t5 t6 t2 {% for m in messages %}t3 {{ m['content'] }} t2 {% endfor %}t4 "
    target.tokenizer = tok
    return target


def run_on_eight_devices(code: str, timeout: int = 600) -> None:
    """Runs `code` with `python -c` on 8 simulated CPU devices (XLA's device count is fixed at import, so a
    mesh test needs its own process); fails the test with the child's stderr when it exits non-zero."""
    import subprocess
    import sys

    env = {**os.environ, "XLA_FLAGS": "--xla_force_host_platform_device_count=8", "JAX_PLATFORMS": "cpu"}
    proc = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=timeout)
    assert proc.returncode == 0, proc.stderr[-3000:]


def load_script(name: str):
    """scripts/<name>.py imported as a module (the scripts are not a package), for tests that call its main()."""
    import importlib.util
    import pathlib

    path = pathlib.Path(__file__).resolve().parents[1] / "scripts" / f"{name}.py"
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module  # dataclasses look their module up while the file runs
    spec.loader.exec_module(module)
    return module
