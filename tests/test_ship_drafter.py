"""scripts/ship_drafter.py: the drafter card written from a run's record, with the held-out section when the run
logged held-out acceptance and without it when it did not."""

from __future__ import annotations

import json


def _script():
    from conftest import load_script

    return load_script("ship_drafter")


def _run(tmp_path, heldout: bool):
    run, ship, data = tmp_path / "run", tmp_path / "ship", tmp_path / "data"
    for d in (run, ship, data):
        d.mkdir()
    recs = [{"step": s, "loss": 3.0 / s, "ce": 4.0, "tv": 1.0, "top1": 0.1, "acceptance": [0.3, 0.2],
             "elapsed_s": 6.0 * s} for s in (10, 20, 30)]
    if heldout:
        recs += [{"step": s, "heldout": {"t1": {"c_star": [0.2 + s / 1000, 0.1], "top1": [0.05, 0.04]}}}
                 for s in (10, 20, 30)]
        (run / "best.json").write_text(json.dumps({"step": 20, "value": 0.16}))
    (run / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in recs))
    (run / "train_config.json").write_text("{}")
    (ship / "drafter_config.json").write_text(json.dumps(
        {"kind": "dspark", "head": "markov", "markov_rank": 8, "num_layers": 1, "block_size": 2, "confidence": True,
         "target_layers": [0], "calibration": None}))
    (ship / "model.safetensors").write_bytes(b"\0" * 2_000_000)
    (data / "metadata.json").write_text(json.dumps(
        {"examples": {"chat": 3}, "tokens_total": 30, "response_tokens_total": 20,
         "sampling": {"temperature": 1.0, "top_p": 1.0}}))
    _script().main([str(run), str(ship), "--command", "python -m train fit ...", "--data", str(data)])
    return ship


def test_card_carries_the_heldout_curve_and_the_saved_step(tmp_path):
    ship = _run(tmp_path, heldout=True)
    card = (ship / "README.md").read_text()
    assert (ship / "heldout.png").read_bytes().startswith(b"\x89PNG")
    assert "the shipped weights are step 20" in card and "evaluated 3 times" in card
    assert "| t1 | c_star | 0.220 | 0.100 | 0.160 |" in card  # step 20's row, not the last step's
    assert "2.0 MB" in card and "30 steps in 3.0 min" in card


def test_card_without_heldout_lines_has_no_heldout_section(tmp_path):
    ship = _run(tmp_path, heldout=False)
    assert "Held-out acceptance" not in (ship / "README.md").read_text()
    assert not (ship / "heldout.png").exists()
