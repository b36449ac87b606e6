"""Sizing a draft vocabulary by the target's T = 1 mass (train/vocab.py): the summed distributions against the
Hugging Face model's own softmax, and the size search against a hand-made table."""

from __future__ import annotations

import numpy as np
import pytest
from conftest import make_hf_model, target_from_hf

from train.vocab import outside_mass, select_by_mass, target_mass


def test_target_mass_sums_the_hf_softmax_over_response_positions(tmp_path):
    import torch

    hf = make_hf_model("llama", tied=True)
    target = target_from_hf(hf, tmp_path)
    rng = np.random.default_rng(0)
    records = [{"tokens": rng.integers(3, 120, size=n).astype(np.int32), "prompt_len": p}
               for n, p in ((12, 4), (20, 9), (7, 1), (30, 25), (9, 3))]
    mass, positions = target_mass(target, records, batch=2, progress=False)
    want, count = np.zeros(target.config.vocab_size), 0
    with torch.no_grad():
        for r in records:
            p = torch.softmax(hf(torch.tensor(r["tokens"][None]).long()).logits[0].double(), -1).numpy()
            rows = p[r["prompt_len"] - 1 : len(r["tokens"]) - 1]  # the positions predicting response tokens
            want += rows.sum(0)
            count += len(rows)
    assert positions == count
    np.testing.assert_allclose(mass, want, atol=2e-4 * count)
    assert mass.sum() == pytest.approx(count, rel=1e-4)


def test_select_by_mass_takes_the_smallest_size_under_the_bound():
    # Five tokens; ranked on the fit half as 3, 0, 4, 1, 2 (token 2 always kept); held-out mass over 10 positions.
    fit = np.array([5.0, 1.0, 0.0, 9.0, 2.0])
    held = np.array([3.0, 0.5, 0.1, 6.0, 0.4])
    ids, out = select_by_mass(fit, held, 10, max_outside=0.06, multiple=2, always=(2,))
    assert ids == (0, 2, 3, 4) and out == pytest.approx(0.05)  # {2, 3}: 0.39 outside; {2, 3, 0, 4}: 0.05
    ids, out = select_by_mass(fit, held, 10, max_outside=0.5, multiple=1)
    assert ids == (3,) and out == pytest.approx(0.4)
    assert outside_mass((0, 1, 2, 3, 4), held, 10) == pytest.approx(0.0)
    with pytest.raises(ValueError, match="max_outside"):
        select_by_mass(fit, held, 10, max_outside=0.0)
