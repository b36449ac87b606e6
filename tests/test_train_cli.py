"""`python -m train`: --help on every subcommand, and bad input gives one `error:` line and exit code 2."""

from __future__ import annotations

import subprocess
import sys

import pytest

from train.__main__ import main


@pytest.mark.parametrize("sub", [[], ["prepare"], ["features"], ["fit"], ["calibrate"], ["eval"], ["heldout"],
                                 ["vocab"]])
def test_help(sub, capsys):
    with pytest.raises(SystemExit) as e:
        main([*sub, "--help"])
    assert e.value.code == 0
    assert "usage:" in capsys.readouterr().out


def test_bad_config_and_missing_data_are_clear_errors(tmp_path, capsys):
    assert main(["fit", "--config", str(tmp_path / "nope.yaml")]) == 2
    assert "config file not found" in capsys.readouterr().err
    assert main(["fit", "--set", "optim.stepz=1"]) == 2
    assert "unknown keys" in capsys.readouterr().err
    bad = tmp_path / "bad.yaml"
    bad.write_text("optim: {steps: [1, 2}\n")
    assert main(["fit", "--config", str(bad)]) == 2
    assert "not valid YAML" in capsys.readouterr().err
    assert main(["heldout", "--drafters", "x", "--sets", "no-equals-sign"]) == 2
    assert "NAME=DIR" in capsys.readouterr().err


def test_module_entry_point_runs():
    out = subprocess.run([sys.executable, "-m", "train", "--help"], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0 and "prepare" in out.stdout and "calibrate" in out.stdout
