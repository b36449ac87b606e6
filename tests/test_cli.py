"""Tests for the `python -m dspark_jax.generate` entry point, run as a subprocess the way a user runs it.

Contract: `--help` documents every flag; any bad model spec or parameter is one `error: ...` line on stderr,
exit code 2, never a traceback; `--json` prints one parseable JSON object on stdout.
Parameter errors are checked against a tiny random Llama carrying the real tokenizer (fast to load), so
they exercise the whole CLI path without loading the 135M weights.
"""

import argparse
import json
import subprocess
import sys

import numpy as np
import pytest
from conftest import TINY, make_hf_model

from dspark_jax.gguf_file import load_tokenizer
from dspark_jax.hub import DEFAULT_TARGET, resolve_target


def run_cli(*args: str, timeout: float = 300) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "dspark_jax.generate", *args], capture_output=True,
                          text=True, timeout=timeout, check=False)  # fmt: skip


def assert_one_line_error(proc: subprocess.CompletedProcess, *fragments: str) -> str:
    """Exit 2, nothing on stdout, exactly one `error: ...` line on stderr containing every fragment."""
    assert "Traceback" not in proc.stderr, proc.stderr
    assert proc.returncode == 2, (proc.returncode, proc.stderr)
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), proc.stderr
    for fragment in fragments:
        assert fragment in lines[0], lines[0]
    assert proc.stdout.strip() == "", proc.stdout
    return lines[0]


def cli_parser() -> argparse.ArgumentParser:
    """The parser `dspark_jax.generate.parse_args` builds, caught as it parses (it is not module-level)."""
    import importlib

    cli = importlib.import_module("dspark_jax.generate")  # the module; `dspark_jax.generate` is the function
    caught = []

    def grab(self, args=None, namespace=None):
        caught.append(self)
        raise SystemExit(0)

    original = argparse.ArgumentParser.parse_args
    argparse.ArgumentParser.parse_args = grab
    try:
        with pytest.raises(SystemExit):
            cli.parse_args([])
    finally:
        argparse.ArgumentParser.parse_args = original
    return caught[0]


def test_help_mentions_every_flag():
    proc = run_cli("--help", timeout=120)
    assert proc.returncode == 0, proc.stderr
    flags = {s for a in cli_parser()._actions for s in a.option_strings if s.startswith("--")}
    # The documented interface; the parser may grow, never shrink.
    assert {"--prompt", "--target", "--drafter", "--max-tokens", "--temperature", "--top-k", "--top-p",
            "--seed", "--dtype", "--json"} <= flags  # fmt: skip
    for flag in flags:
        assert flag in proc.stdout, flag
    assert all(a.help for a in cli_parser()._actions), "every flag needs help text"
    assert DEFAULT_TARGET in proc.stdout


# --- bad model specs: rejected before any weights are read ----------------------------------------------


def test_nonexistent_path(tmp_path):
    missing = str(tmp_path / "no" / "such" / "model")
    assert_one_line_error(run_cli("--prompt", "hi", "--target", missing), "neither a known model name")


def test_wrong_file_type(tmp_path):
    path = tmp_path / "weights.txt"
    path.write_text("not a model\n")
    assert_one_line_error(run_cli("--prompt", "hi", "--target", str(path)), "unsupported file type", ".txt")


def test_fake_gguf(tmp_path):
    path = tmp_path / "model.gguf"
    path.write_bytes(b"nope")
    assert_one_line_error(run_cli("--prompt", "hi", "--target", str(path)), "not a GGUF file", "b'nope'")


def test_unsupported_architecture_hf_dir(tmp_path):
    from safetensors.numpy import save_file

    (tmp_path / "config.json").write_text(json.dumps({"model_type": "gpt2", "vocab_size": 8, "n_embd": 4}))
    save_file({"wte.weight": np.zeros((8, 4), np.float32)}, str(tmp_path / "model.safetensors"))
    # The architecture error comes from ModelConfig.from_hf (config parsing), wrapped by load_target.
    line = assert_one_line_error(run_cli("--prompt", "hi", "--target", str(tmp_path)),
                                 "unsupported architecture 'gpt2'", "llama, qwen3")  # fmt: skip
    assert line.startswith("error: cannot load ")


def test_unsupported_architecture_reported_before_weights(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "gpt2"}))
    assert_one_line_error(run_cli("--prompt", "hi", "--target", str(tmp_path)), "'gpt2'")


def test_corrupt_safetensors(tmp_path):
    import transformers

    transformers.LlamaConfig(**TINY).save_pretrained(tmp_path)  # a valid config, whatever is read first
    (tmp_path / "model.safetensors").write_bytes(b"")
    assert_one_line_error(run_cli("--prompt", "hi", "--target", str(tmp_path)), "model.safetensors")


# --- bad sampling parameters -----------------------------------------------------------------------------


@pytest.fixture(scope="module")
def tiny_chat_dir(tmp_path_factory):
    """A tiny random Llama (vocab of SmolLM2) saved with SmolLM2's tokenizer and chat template."""
    directory = tmp_path_factory.mktemp("tiny_chat")
    tokenizer = load_tokenizer(*resolve_target(DEFAULT_TARGET))
    model = make_hf_model("llama", tied=True, vocab_size=len(tokenizer), eos_token_id=2)
    model.save_pretrained(directory, safe_serialization=True)
    tokenizer.save_pretrained(directory)
    return str(directory)


def test_tiny_target_runs(tiny_chat_dir):
    """The control for the parameter tests below: the same target with valid parameters succeeds."""
    proc = run_cli("--prompt", "hi", "--target", tiny_chat_dir, "--max-tokens", "3", "--json")
    assert proc.returncode == 0, proc.stderr
    assert 1 <= len(json.loads(proc.stdout)["tokens"]) <= 3


@pytest.mark.parametrize("flag, value, fragment", [
    ("--temperature", "-1", "temperature must be"),
    ("--top-p", "0", "top_p must be in (0, 1]"),
    ("--max-tokens", "0", "--max-tokens must be >= 1"),
])  # fmt: skip
def test_bad_sampling_parameter(tiny_chat_dir, flag, value, fragment):
    proc = run_cli("--prompt", "hi", "--target", tiny_chat_dir, flag, value)
    assert_one_line_error(proc, fragment)


# --- the real model ---------------------------------------------------------------------------------------


@pytest.mark.slow
def test_json_output_default_model():
    proc = run_cli("--prompt", "What is the capital of France?", "--json", "--max-tokens", "8")
    assert proc.returncode == 0, proc.stderr
    out = json.loads(proc.stdout)  # stdout is exactly one JSON object: no streamed text, no progress
    assert 1 <= len(out["tokens"]) <= 8
    assert all(isinstance(t, int) for t in out["tokens"] + out["prompt_ids"])
    assert isinstance(out["text"], str)
    assert {"prefill_s", "decode_s", "load_s"} <= set(out["timings"])
    assert all(v >= 0 for v in out["timings"].values())


def test_compile_cache_defaults_to_the_dspark_jax_cache_and_turns_off(tmp_path, monkeypatch):
    import jax

    from serve.cli import enable_compile_cache, main, parse_args

    assert parse_args([]).compile_cache is None
    assert parse_args(["--compile-cache", "none"]).compile_cache == "none"
    monkeypatch.setenv("DSPARK_JAX_CACHE", str(tmp_path))
    before = jax.config.jax_compilation_cache_dir
    try:
        assert enable_compile_cache() == str(tmp_path / "xla")
        assert jax.config.jax_compilation_cache_dir == str(tmp_path / "xla") and (tmp_path / "xla").is_dir()
    finally:
        jax.config.update("jax_compilation_cache_dir", before)
    (tmp_path / "file").write_text("")  # a directory that cannot be made: a clear error, status 2
    assert main(["--compile-cache", str(tmp_path / "file" / "xla")]) == 2
