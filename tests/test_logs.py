"""Quiet start-up (dspark_jax/logs.py): third-party INFO lines (absl/orbax, jax, httpx, uvicorn) are off unless
the level is debug; our own loggers keep their INFO lines; the progress bar draws only on a terminal.

Oracles: records written through the real loggers into a captured stream; a real Orbax save/load of a tiny
drafter (whose absl INFO lines the debug control shows); and the server's own CLI started on a tiny target
(load target and drafter, compile, profile, uvicorn, one request), whose whole output must hold no third-party
INFO line.
"""

from __future__ import annotations

import io
import logging
import os
import re
import subprocess
import sys
import time

import pytest

from dspark_jax.logs import THIRD_PARTY, configure_logging, progress_bar, third_party_level

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
NOISY = ["absl", "orbax.checkpoint", "jax._src.xla_bridge", "httpx", "uvicorn.access", "uvicorn.error",
         "some.unknown.library"]
OURS = ["dspark_jax.serve", "serve.cli", "train.fit", "__main__"]


@pytest.fixture(autouse=True)
def _restore_logging():
    """configure_logging changes process-wide state; put it back after each test."""
    root = logging.getLogger()
    names = [*THIRD_PARTY, *NOISY, *OURS, "dspark_jax", "serve", "train", "pallas_kernels"]
    saved = (root.level, list(root.handlers), {n: logging.getLogger(n).level for n in names})
    # A server test earlier in the session may have run uvicorn in this process: its dictConfig gives the uvicorn
    # loggers their own handlers (an access formatter that needs 5 arguments) and propagate=False. Start from
    # plain loggers, as a fresh `python -m dspark_jax.serve` does before uvicorn starts, and put them back after.
    own_handlers = {n: (list(lg.handlers), lg.propagate) for n in names if (lg := logging.getLogger(n)).handlers
                    or not lg.propagate}
    for n in own_handlers:
        logging.getLogger(n).handlers[:] = []
        logging.getLogger(n).propagate = True
    yield
    root.setLevel(saved[0])
    root.handlers[:] = saved[1]
    for n, lvl in saved[2].items():
        logging.getLogger(n).setLevel(lvl)
    for n, (handlers, propagate) in own_handlers.items():
        logging.getLogger(n).handlers[:] = handlers
        logging.getLogger(n).propagate = propagate
    logging.captureWarnings(False)


def _emit_all() -> None:
    for name in NOISY + OURS:
        logging.getLogger(name).info("info from %s", name)
        logging.getLogger(name).warning("warning from %s", name)


def test_info_hides_third_party_info_and_keeps_ours_and_all_warnings():
    buf = io.StringIO()
    configure_logging("info", stream=buf)
    _emit_all()
    out = buf.getvalue()
    for name in NOISY:
        assert f"info from {name}" not in out
        assert f"warning from {name}" in out
    for name in OURS:
        assert f"info from {name}" in out and f"warning from {name}" in out


def test_debug_shows_third_party_info():
    buf = io.StringIO()
    configure_logging("debug", stream=buf)
    _emit_all()
    logging.getLogger("dspark_jax.serve").debug("debug from ours")
    out = buf.getvalue()
    for name in NOISY + OURS:
        assert f"info from {name}" in out
    assert "debug from ours" in out


def test_warning_level_and_reconfiguring_do_not_duplicate_lines():
    first, second = io.StringIO(), io.StringIO()
    configure_logging("info", stream=first)
    configure_logging("warning", stream=second)
    _emit_all()
    assert first.getvalue() == ""  # the first handler was replaced, not kept beside the second
    out = second.getvalue()
    assert "info from" not in out
    assert out.count("warning from serve.cli") == 1


def test_levels():
    assert [third_party_level(x) for x in ("debug", "info", "warning", "error")] == \
        ["debug", "warning", "warning", "error"]
    with pytest.raises(ValueError, match="unknown log level 'loud'"):
        configure_logging("loud")


def test_drafter_save_and_load_are_quiet_at_info(tmp_path):
    """Saving (safetensors) and loading a drafter, and loading one in the older Orbax layout, log nothing at INFO;
    at DEBUG, Orbax's own INFO lines show (the control: the capture works)."""
    import orbax.checkpoint as ocp
    from conftest import make_hf_model, target_from_hf
    from flax import nnx

    import dspark_jax

    target = target_from_hf(make_hf_model("llama", tied=True), tmp_path / "t")
    drafter = dspark_jax.init_drafter(target, kind="dspark", block_size=4, num_layers=1, markov_rank=8)
    outs = {}
    for level in ("debug", "info"):
        old = tmp_path / f"orbax-{level}"  # written before the capture: no code path of ours writes this layout
        drafter.save(str(old))
        os.remove(old / "model.safetensors")
        with ocp.StandardCheckpointer() as c:
            c.save(str(old / "params"), nnx.to_pure_dict(drafter.params))
        buf = io.StringIO()
        configure_logging(level, stream=buf)
        drafter.save(str(tmp_path / level))
        dspark_jax.load_drafter(str(tmp_path / level), target)
        dspark_jax.load_drafter(str(old), target)
        outs[level] = buf.getvalue()
    assert re.search(r"INFO absl: .*(checkpoint|Restoring)", outs["debug"]), outs["debug"][:2000]  # control
    assert " INFO " not in outs["info"], outs["info"][:2000]


class _Tty(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_progress_bar_draws_only_on_a_terminal():
    for stream, enabled in ((io.StringIO(), True), (_Tty(), False)):
        with progress_bar("compiling", unit="shape", enabled=enabled, file=stream) as update:
            update(1, 4)
        assert stream.getvalue() == ""
    tty = _Tty()
    with progress_bar("compiling", unit="shape", file=tty) as update:
        update(3, 4)
        assert "compiling" in tty.getvalue() and "3/4" in tty.getvalue()
    with pytest.raises(RuntimeError), progress_bar("profiling", file=_Tty()) as update:
        update(0, 2)
        raise RuntimeError("closed on errors too")


@pytest.fixture(scope="module")
def tiny_chat(tmp_path_factory):
    """A tiny random Llama with a word-level tokenizer and an untrained tiny DSpark drafter (Orbax)."""
    from test_multiprocess_train import _tiny_target_dir

    import dspark_jax

    d = tmp_path_factory.mktemp("tiny_chat")
    target = dspark_jax.load_target(_tiny_target_dir(str(d / "target")))
    dspark_jax.init_drafter(target, kind="dspark", block_size=2, num_layers=1, markov_rank=8).save(str(d / "drafter"))
    return str(d / "target"), str(d / "drafter")


THIRD_PARTY_INFO = re.compile(r"INFO (absl|orbax|jax|httpx|httpcore|uvicorn)|^INFO: ", re.M)


@pytest.mark.slow
def test_server_cli_start_up_prints_no_third_party_info(tiny_chat, tmp_path):
    """`python -m dspark_jax.serve` at its default --log-level info: load target and drafter (Orbax), compile,
    profile, uvicorn, one request, SIGTERM. Before serve/cli.py called configure_logging, this printed jax's
    "Unable to initialize backend 'tpu'", a dozen absl/orbax restore lines and uvicorn's start-up and access lines."""
    import httpx

    target, drafter = tiny_chat
    out, err = open(tmp_path / "stdout", "w+"), open(tmp_path / "stderr", "w+")
    cmd = [sys.executable, "-m", "dspark_jax.serve", "--target", target, "--drafter", drafter, "--scheduler",
           "fixed:2", "--max-batch", "1", "--max-model-len", "48", "--port", "0"]
    proc = subprocess.Popen(cmd, cwd=ROOT, stdout=out, stderr=err, text=True)
    try:
        deadline = time.monotonic() + 900
        while not (url := re.search(r"serving \S+ at (http://\S+)/v1", open(tmp_path / "stdout").read())):
            assert proc.poll() is None, open(tmp_path / "stderr").read()[-3000:]
            assert time.monotonic() < deadline, "the server did not start"
            time.sleep(1)
        body = {"model": "any", "prompt": "t5 t6 t7", "max_tokens": 2}
        model = httpx.get(url[1] + "/v1/models", timeout=60).json()["data"][0]["id"]
        r = httpx.post(url[1] + "/v1/completions", json={**body, "model": model}, timeout=300)
        assert r.status_code == 200, r.text
    finally:
        proc.terminate()
        proc.wait(timeout=120)
    stdout, stderr = open(tmp_path / "stdout").read(), open(tmp_path / "stderr").read()
    assert "compiled" in stdout  # the engine's own start-up lines still print
    assert not THIRD_PARTY_INFO.search(stderr), stderr[-3000:]
    assert not THIRD_PARTY_INFO.search(stdout), stdout[-3000:]
