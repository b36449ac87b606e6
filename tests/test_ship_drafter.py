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


def test_factory_card_from_metrics_json_with_heldout_and_shrink_reports(tmp_path):
    """A factory's output (metrics.json) is carded from its settings, data, steps and held-out c*, with the
    `train heldout` and `train shrink` reports when given; its loss history becomes metrics.jsonl and loss.png."""
    factory, ship = tmp_path / "factory", tmp_path / "ship"
    factory.mkdir()
    ship.mkdir()
    history = [{"step": s, "lr": 1e-3, "loss": 3.0 / s, "acceptance": [0.3, 0.2]} for s in (1, 51, 101)]
    metrics = {
        "settings": {"temperature": 1.0, "greedy_share": 0.2, "batch_sequences": 64, "anchors_per_seq": 16,
                     "seq_len": 512, "lr": 1e-3},
        "backend": "gpu", "elapsed_s": 540.0,
        "data": {"prompts": 9000, "eval_prompts_banned": 1200, "sequences": 18000, "response_tokens": 10_500_000,
                 "tokens_per_s": 61000.0, "greedy": 3600, "heldout": 360},
        "train": {"steps": 101, "seconds": 240.0, "anchor_blocks": 103424, "history": {"dspark": history},
                  "loss_weights": {"dspark": {"ce": 0.1}}},
        "heldout_acceptance": {"dspark": {"t1": [0.52, 0.41], "t0": [0.61, 0.5], "sequences": {"t1": 300, "t0": 60}}},
        "drafters": {"dspark": {"config": {}, "weights": {}, "params": 1}},
    }
    (factory / "metrics.json").write_text(json.dumps(metrics))
    (ship / "drafter_config.json").write_text(json.dumps(
        {"kind": "dspark", "head": "markov", "markov_rank": 32, "num_layers": 2, "block_size": 2, "confidence": True,
         "target_layers": [1, 15, 27], "calibration": [1.0, 1.1], "draft_vocab": list(range(300))}))
    (ship / "model.safetensors").write_bytes(b"\0" * 3_000_000)
    heldout = {"sets": {"t1": "data/t1-text"}, "sequences": 64, "seq_len": 256, "anchors_per_seq": 16,
               "drafters": {"runs/f/dspark-32": {"t1": {"c_star": [0.5, 0.4], "top1": [0.3, 0.2], "slots": [10, 10]}},
                            "runs/f/eagle3": {"t1": {"c_star": [0.45, 0.3], "top1": [0.3, 0.2], "slots": [10, 10]}}}}
    shrink = {"draft_vocab": {"from": 49152, "to": 300}, "markov_rank": {"from": 256, "to": 32},
              "kept_energy": 0.8123, "params": {"from": 40_000_000, "to": 10_000_000}}
    (tmp_path / "heldout.json").write_text(json.dumps(heldout))
    (tmp_path / "shrink.json").write_text(json.dumps(shrink))
    _script().main([str(factory), str(ship), "--command", "bash factory.sh", "--hardware", "one H200",
                    "--heldout", str(tmp_path / "heldout.json"), "--shrink", str(tmp_path / "shrink.json")])
    card = (ship / "README.md").read_text()
    flat = " ".join(card.split())  # prose is reflowed: match it across line breaks
    assert "one run on one H200" in flat and "3.0 MB" in card and "300-token draft vocabulary" in card
    assert "10,500,000 tokens" in flat and "101 steps of 64 windows × 16 anchors" in flat
    assert "| t1 | c_star | 0.520 | 0.410 | 0.465 |" in card  # the factory's own held-out rows
    assert "| runs/f/dspark-32 · t1 | c_star | 0.500 | 0.400 | 0.450 |" in card  # `train heldout`, every drafter
    assert "| runs/f/eagle3 · t1 | c_star | 0.450 | 0.300 | 0.375 |" in card
    assert "from 49,152 to 300 tokens and cut from rank 256 to 32" in flat and "81.2%" in flat
    assert max(len(ln) for ln in card.splitlines()) <= 120
    assert [json.loads(ln)["step"] for ln in open(ship / "metrics.jsonl")] == [1, 51, 101]
    assert (ship / "loss.png").read_bytes().startswith(b"\x89PNG")
