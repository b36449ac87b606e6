"""Sequential temperature scaling (train/calibrate.py) on synthetic rounds whose true temperatures are known,
hand-checked survival labels and products, and the PNG writers of train/calibrate.py and train/plots.py."""

from __future__ import annotations

import numpy as np
import pytest

from train import calibrate, plots

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"
T_STAR = (1.6, 2.0, 0.8, 1.3, 1.5)  # mostly overconfident raw head, one underconfident position


def synthetic_rounds(seed: int, n: int, t_star) -> tuple[np.ndarray, np.ndarray]:
    """Raw logits z [N, L] and num_accepted [N] drawn from the true c_k = σ(z_k / T*_k).

    Verification is a sequence of Bernoulli(c_k) draws that stops at the first rejection, so
    num_accepted = number of leading successes.
    """
    rng = np.random.default_rng(seed)
    z = rng.normal(2.0, 2.0, size=(n, len(t_star)))
    accepted = rng.random(z.shape) < 1.0 / (1.0 + np.exp(-z / np.asarray(t_star)))
    return z, np.cumprod(accepted, axis=1).sum(axis=1)


@pytest.fixture(scope="module")
def fitted():
    z, m = synthetic_rounds(0, 20_000, T_STAR)
    return calibrate.sequential_temperature_scaling(z, m)


def test_survival_labels_hand_example():
    labels = calibrate.survival_labels(np.array([0, 2, 3, 1]), 3)
    np.testing.assert_array_equal(labels, [[0, 0, 0], [1, 1, 0], [1, 1, 1], [1, 0, 0]])


def test_predicted_survival_hand_example():
    # σ(0) = 1/2, σ(ln 3) = 3/4, σ(−ln 3) = 1/4; with T = 2 on position 2, σ(2 ln 3 / 2) = 3/4.
    z = np.array([[0.0, np.log(3.0), -np.log(3.0)], [np.log(3.0), 2 * np.log(3.0), 0.0]])
    np.testing.assert_allclose(calibrate.predicted_survival(z), [[1 / 2, 3 / 8, 3 / 32], [3 / 4, 3 / 4 * 0.9, 0.3375]])
    np.testing.assert_allclose(calibrate.predicted_survival(z, [1.0, 2.0, 1.0])[1], [3 / 4, 9 / 16, 9 / 32])


def test_ece_hand_example():
    # Bins of width 0.5: {0.2, 0.4} predict 0.3 mean vs 0.5 observed, {0.9, 0.9} predict 0.9 vs 1.0.
    pred, obs = np.array([0.2, 0.4, 0.9, 0.9]), np.array([0.0, 1.0, 1.0, 1.0])
    assert calibrate.ece(pred, obs, bins=2) == pytest.approx(0.5 * 0.2 + 0.5 * 0.1)
    assert calibrate.ece(obs, obs) == 0.0


def test_sts_recovers_true_temperatures(fitted):
    # Early positions see most rounds survive and pin T*_k tightly; later ones have fewer informative rounds.
    assert len(fitted) == len(T_STAR)
    np.testing.assert_allclose(fitted[:3], T_STAR[:3], rtol=0.15)
    np.testing.assert_allclose(fitted, T_STAR, rtol=0.3)


def test_sts_closes_survival_gap_on_held_out(fitted):
    z, m = synthetic_rounds(1, 20_000, T_STAR)
    report = calibrate.calibration_report(z, m, fitted)
    assert report["mean_gap_before"] > 0.04
    assert report["mean_gap_after"] <= 0.02
    np.testing.assert_allclose(report["gap_after"], calibrate.survival_gap(z, m, fitted))
    assert report["ece_pooled_after"] < 0.5 * report["ece_pooled_before"]
    assert np.all(np.array(report["ece_after"]) < np.array(report["ece_before"]))
    assert report["num_rounds"] == 20_000
    assert report["num_survived"] == [int((m >= k).sum()) for k in range(1, len(T_STAR) + 1)]


def shifted_rounds(seed: int, n: int, t_star, b_star) -> tuple[np.ndarray, np.ndarray]:
    """As synthetic_rounds, with true c_k = σ(z_k / T*_k + b*_k): errors that cross away from c = ½."""
    rng = np.random.default_rng(seed)
    z = rng.normal(-1.0, 1.0, size=(n, len(t_star)))
    accepted = rng.random(z.shape) < 1.0 / (1.0 + np.exp(-(z / np.asarray(t_star) + np.asarray(b_star))))
    return z, np.cumprod(accepted, axis=1).sum(axis=1)


def test_offsets_close_a_gap_temperatures_cannot():
    t_star, b_star = (1.8, 1.5, 1.2), (-0.6, 0.8, -0.4)
    z, m = shifted_rounds(4, 20_000, t_star, b_star)
    zt, mt = shifted_rounds(5, 20_000, t_star, b_star)
    sts_t, sts_b = calibrate.sequential_calibration(z, m, offsets=False)
    assert sts_b == (0.0,) * 3 and sts_t == calibrate.sequential_temperature_scaling(z, m)
    t, b = calibrate.sequential_calibration(z, m, offsets=True)
    np.testing.assert_allclose(t[:2], t_star[:2], rtol=0.2)
    np.testing.assert_allclose(b[:2], b_star[:2], atol=0.15)
    sts = calibrate.calibration_report(zt, mt, sts_t)
    both = calibrate.calibration_report(zt, mt, t, offsets=b)
    assert sts["mean_gap_after"] > 0.015  # a temperature alone leaves the mean off
    assert both["mean_gap_after"] <= 0.005 < sts["mean_gap_after"] / 3
    assert both["ece_pooled_after"] < sts["ece_pooled_after"]
    np.testing.assert_allclose(both["gap_after"], calibrate.survival_gap(zt, mt, t, b))
    assert both["auc"] == sts["auc"]  # monotone maps keep the ranking


def test_conditional_auc_hand_example():
    # Position 1 over all 4 rounds: accepted {z=2, 1}, rejected {0, 1} → pairs (2>0, 2>1, 1>0, 1=1 ½) = 3.5 / 4.
    # Position 2 over the rounds that reached it (m ≥ 1: rows 0, 1): row 0 accepted (z=0.5), row 1 not (z=1.0).
    z = np.array([[2.0, 0.5], [1.0, 1.0], [0.0, 3.0], [1.0, 3.0]])
    m = np.array([2, 1, 0, 0])
    assert calibrate.conditional_auc(z, m) == [3.5 / 4, 0.0]
    assert calibrate.conditional_auc(z, np.array([2, 2, 2, 2])) == [None, None]


def test_positions_with_too_few_survivors_stay_raw():
    z, m = synthetic_rounds(6, 2_000, (1.6, 2.0, 0.8))
    m = np.minimum(m, 1)  # nobody survives past position 1
    t, b = calibrate.sequential_calibration(z, m)
    assert t[1:] == (1.0, 1.0) and b[1:] == (0.0, 0.0)


def test_sts_leaves_calibrated_head_alone():
    z, m = synthetic_rounds(2, 20_000, (1.0,) * 4)
    np.testing.assert_allclose(calibrate.sequential_temperature_scaling(z, m), 1.0, rtol=0.15)


def test_sts_rejects_bad_shapes():
    with pytest.raises(ValueError, match="num_accepted"):
        calibrate.sequential_temperature_scaling(np.zeros((4, 3)), np.array([0, 1, 4, 2]))
    with pytest.raises(ValueError, match="conf_logits"):
        calibrate.sequential_temperature_scaling(np.zeros(4), np.zeros(4, int))


def _is_png(path) -> bool:
    """A real PNG of a 256-colour palette (`plots.save_figure`: a third of matplotlib's RGBA file)."""
    from PIL import Image

    data = path.read_bytes()
    with Image.open(path) as image:
        return len(data) > 1000 and data.startswith(PNG_MAGIC) and image.mode == "P"


def test_png_writers(tmp_path, fitted):
    z, m = synthetic_rounds(3, 2_000, T_STAR)
    out = calibrate.reliability_diagram(z, m, fitted, tmp_path / "reliability.png")
    assert _is_png(out)

    tau = {"dflash": {"math": 3.1, "chat": 2.2}, "dspark": {"math": 3.6, "chat": 2.6}}
    assert _is_png(plots.plot_tau(tau, tmp_path / "tau.png"))
    curves = {"dflash": [0.8, 0.7, 0.6], "dspark": [0.8, 0.78, 0.77]}
    assert _is_png(plots.plot_conditional_acceptance(curves, tmp_path / "cond.png"))
    by_domain = {name: {"math": c, "chat": [x - 0.1 for x in c]} for name, c in curves.items()}
    assert _is_png(plots.plot_conditional_acceptance(by_domain, tmp_path / "cond_domains.png"))
    runs = {"a": [{"step": s, "loss": 5.0 / (s + 1), "acceptance": 0.1 * s} for s in range(5)],
            "b": [{"step": s, "loss": 4.0 / (s + 1)} for s in range(5)]}
    assert _is_png(plots.plot_loss_curves(runs, tmp_path / "loss.png"))
    held = {name: [{"step": s, "heldout": {"t1": {"c_star": [0.1 * s + d, 0.05 * s]}}} for s in (50, 100)]
            for name, d in (("base", 0.0), ("arm", 0.02))}
    assert _is_png(plots.plot_heldout_runs(held, tmp_path / "ab.png", reference={"shipped": (0.3, 0.35)}))
    with pytest.raises(ValueError, match="no run holds"):
        plots.plot_heldout_runs(held, tmp_path / "none.png", set_name="t0")
    assert plots.heldout_table(held, [("t1 mean", "t1", "c_star", None), ("t1 k = 2", "t1", "c_star", 1)],
                               every=100).splitlines() == [
        "| arm | step | t1 mean | t1 k = 2 |", "|---|---:|---:|---:|",
        "| base | 100 | 7.5000 | 5.0000 |", "| arm | 100 | 7.5100 | 5.0000 |"]
    throughput = {"static": {1: {"total_tps": 50, "per_user_tps": 50}, 8: {"total_tps": 300, "per_user_tps": 37}},
                  "dspark": {"1": {"total_tps": 60, "per_user_tps": 60}, "8": {"total_tps": 380, "per_user_tps": 47}}}
    assert _is_png(plots.plot_throughput(throughput, tmp_path / "throughput.png"))
