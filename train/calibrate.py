"""Post-hoc calibration of the confidence head: Sequential Temperature Scaling (paper §3.2.1), in numpy.

The confidence head gives one logit z_k per draft position k = 1..L; its confidence c_k = σ(z_k) estimates the
conditional acceptance P(x_k accepted | x_1..x_{k−1} accepted). By the chain rule the survival of the prefix
x_1..x_k is a_k = ∏_{j≤k} c_j, and the hardware-aware scheduler (§3.2.2) uses the absolute value of a_k, so
a_k must be calibrated, not merely well ranked. STS divides each logit by a temperature T_k, c_k = σ(z_k / T_k),
and fits T_1, T_2, … left to right on held-out rounds: at position k, with T_1..T_{k−1} fixed, a 1-D grid search
picks the T_k that minimises the ECE of a_k against the observed survival 1[num_accepted ≥ k].
Temperature scaling is monotone, so the ranking of draft tokens the head learned is unchanged.

A temperature only stretches logits about z = 0, i.e. about c = ½. A head whose errors cross elsewhere (the
shipped SmolLM2 drafter's position 1 is under-confident below c ≈ 0.25 and over-confident above it) keeps a
mean bias no temperature removes. `sequential_calibration(..., offsets=True)` adds one logit offset per
position, c_k = σ(z_k / T_k + b_k), still fitted left to right: for every candidate T_k the b_k that makes the
mean predicted a_k equal the observed survival (bisection: the mean is monotone in b_k), then the T_k whose
pair has the least ECE. An affine map of the logit with a positive slope is monotone too, so rankings are kept.

Shapes: N verification rounds, L draft block; conf_logits float [N, L], num_accepted int [N] in 0..L.
The rounds must come from full-block verification (every draft token verified): a round whose verification
was cut at ℓ < L says nothing about survival past ℓ and would bias the labels downwards.
"""

from __future__ import annotations

import numpy as np

DEFAULT_BINS = 15
# Geometric grid for T_k: 2% steps from 0.05 (sharpen 20×) to 20 (flatten 20×).
DEFAULT_GRID = np.geomspace(0.05, 20.0, 301)
OFFSET_BOUND = 20.0  # |b_k| ≤ this: beyond it σ saturates in float32
MIN_SURVIVORS = 20  # a position whose fit split has fewer surviving rounds keeps T_k = 1, b_k = 0 (too few to fit)
# Cap on grid × rounds elements evaluated at once by the vectorised grid search (~32 MB of float64).
_CHUNK_ELEMENTS = 4_000_000


def _sigmoid(x: np.ndarray) -> np.ndarray:
    # tanh form: no overflow warnings for large |x|, unlike 1 / (1 + exp(−x)).
    return 0.5 * (1.0 + np.tanh(0.5 * x))


def _check(conf_logits, num_accepted=None) -> tuple[np.ndarray, np.ndarray | None]:
    z = np.asarray(conf_logits, dtype=np.float64)
    if z.ndim != 2 or z.shape[0] == 0:
        raise ValueError(f"conf_logits must be [N, L] with N > 0, got {z.shape=}")
    if num_accepted is None:
        return z, None
    m = np.asarray(num_accepted)
    if m.shape != (z.shape[0],):
        raise ValueError(f"num_accepted must be [N] matching conf_logits [N, L], got {m.shape=} {z.shape=}")
    if m.size and (m.min() < 0 or m.max() > z.shape[1]):
        raise ValueError(f"num_accepted must lie in 0..L={z.shape[1]}, got range [{m.min()}, {m.max()}]")
    return z, m


def _temperatures(temperatures, block_size: int) -> np.ndarray:
    if temperatures is None:
        return np.ones(block_size)
    t = np.asarray(temperatures, dtype=np.float64)
    if t.shape != (block_size,) or np.any(t <= 0):
        raise ValueError(f"temperatures must be [L={block_size}] and positive, got {t.shape=} {t=}")
    return t


def survival_labels(num_accepted, block_size: int) -> np.ndarray:
    """Observed prefix survival: labels[n, k−1] = 1 if the first k draft tokens of round n were accepted.

    Args:
      num_accepted: int [N], accepted draft tokens per round, in 0..block_size.
      block_size: L.

    Returns:
      float64 [N, L], 1.0 where num_accepted ≥ k (k = 1..L), else 0.0.
    """
    m = np.asarray(num_accepted)
    if m.ndim != 1:
        raise ValueError(f"num_accepted must be [N], got {m.shape=}")
    k = np.arange(1, block_size + 1)
    return (m[:, None] >= k[None, :]).astype(np.float64)


def _offsets(offsets, block_size: int) -> np.ndarray:
    if offsets is None or len(offsets) == 0:
        return np.zeros(block_size)
    b = np.asarray(offsets, dtype=np.float64)
    if b.shape != (block_size,) or not np.all(np.isfinite(b)):
        raise ValueError(f"offsets must be [L={block_size}] and finite, got {b.shape=} {b=}")
    return b


def predicted_survival(conf_logits, temperatures=None, offsets=None) -> np.ndarray:
    """Predicted prefix survival a_k = ∏_{j≤k} σ(z_j / T_j + b_j).

    Args:
      conf_logits: float [N, L], confidence-head logits z.
      temperatures: positive float [L], or None for T = 1 (the raw head).
      offsets: float [L] logit offsets b, or None / () for 0.

    Returns:
      float64 [N, L], non-increasing along L.
    """
    z, _ = _check(conf_logits)
    t, b = _temperatures(temperatures, z.shape[1]), _offsets(offsets, z.shape[1])
    return np.cumprod(_sigmoid(z / t + b), axis=-1)


def _bin_index(pred: np.ndarray, bins: int) -> np.ndarray:
    # Equal-width bins over [0, 1]; pred = 1 falls into the last bin.
    return np.clip((pred * bins).astype(np.int64), 0, bins - 1)


def ece(pred, obs, bins: int = DEFAULT_BINS) -> float:
    """Expected calibration error: Σ_b (n_b / M) |mean pred_b − mean obs_b| over equal-width bins of [0, 1].

    Args:
      pred: float [M], predicted probabilities.
      obs: float [M], observed outcomes in {0, 1} (or frequencies).
      bins: number of equal-width bins.

    Returns:
      The ECE, a float in [0, 1].
    """
    p = np.asarray(pred, dtype=np.float64).ravel()
    o = np.asarray(obs, dtype=np.float64).ravel()
    if p.shape != o.shape or p.size == 0:
        raise ValueError(f"pred and obs must be non-empty and the same size, got {p.shape=} {o.shape=}")
    # n_b |mean pred_b − mean obs_b| = |Σ_b (pred − obs)|, so one weighted bincount is enough.
    diff = np.bincount(_bin_index(p, bins), weights=p - o, minlength=bins)
    return float(np.abs(diff).sum() / p.size)


def _ece_over_grid(pred: np.ndarray, obs: np.ndarray, bins: int) -> np.ndarray:
    """ECE of each row of pred [G, M] against obs [M] -> [G], one bincount for the whole grid."""
    g, m = pred.shape
    idx = _bin_index(pred, bins) + bins * np.arange(g)[:, None]
    diff = np.bincount(idx.ravel(), weights=(pred - obs[None, :]).ravel(), minlength=g * bins)
    return np.abs(diff.reshape(g, bins)).sum(axis=1) / m


def sequential_temperature_scaling(conf_logits, num_accepted, grid=None,
                                   bins: int = DEFAULT_BINS) -> tuple[float, ...]:
    """The paper's STS: per-position temperatures alone (`sequential_calibration` without offsets)."""
    return sequential_calibration(conf_logits, num_accepted, grid, bins, offsets=False)[0]


def _matching_offsets(prefix: np.ndarray, scaled: np.ndarray, target: float, iters: int = 50) -> np.ndarray:
    """For each row g of scaled [G, N] (logits z / T_g), the b_g with mean(prefix · σ(scaled_g + b_g)) = target,
    by bisection on [−OFFSET_BOUND, OFFSET_BOUND] (clamped there when the target is out of reach)."""
    lo = np.full(scaled.shape[0], -OFFSET_BOUND)
    hi = np.full(scaled.shape[0], OFFSET_BOUND)
    for _ in range(iters):
        mid = 0.5 * (lo + hi)
        above = (prefix[None, :] * _sigmoid(scaled + mid[:, None])).mean(axis=1) > target
        hi, lo = np.where(above, mid, hi), np.where(above, lo, mid)
    return 0.5 * (lo + hi)


def sequential_calibration(conf_logits, num_accepted, grid=None, bins: int = DEFAULT_BINS,
                           offsets: bool = True) -> tuple[tuple[float, ...], tuple[float, ...]]:
    """Fit per-position temperatures (and, with `offsets`, logit offsets) left to right (paper §3.2.1, STS).

    At position k the survival before it, a_{k−1} (already calibrated with the fitted T_1..T_{k−1}), is fixed,
    and T_k = argmin_{T ∈ grid} ECE(a_{k−1} · σ(z_k / T + b_k(T)), 1[num_accepted ≥ k]); ties go to the
    smallest T. b_k(T) = 0 without offsets; with them, the offset that matches the mean of a_k to the observed
    survival at that T (module docstring). A position with fewer than MIN_SURVIVORS surviving rounds keeps
    T_k = 1, b_k = 0: a handful of labels would fit noise.

    Args:
      conf_logits: float [N, L], held-out confidence-head logits.
      num_accepted: int [N] in 0..L, accepted draft tokens of the same rounds (full-block verification).
      grid: positive float [G] candidate temperatures; default a 301-point geometric grid over [0.05, 20].
      bins: ECE bins.
      offsets: fit b_k too (else every b_k = 0, the paper's STS).

    Returns:
      (T_1..T_L, b_1..b_L), two tuples of L floats.
    """
    z, m = _check(conf_logits, num_accepted)
    g = DEFAULT_GRID if grid is None else np.asarray(grid, dtype=np.float64).ravel()
    if g.size == 0 or np.any(g <= 0):
        raise ValueError(f"grid must be non-empty and positive, got {g.shape=}")
    n, block = z.shape
    obs = survival_labels(m, block)
    prefix = np.ones(n)  # a_{k−1}, calibrated
    chunk = max(1, _CHUNK_ELEMENTS // n)
    temps, offs = [], []
    for k in range(block):
        if obs[:, k].sum() < MIN_SURVIVORS:
            temps.append(1.0)
            offs.append(0.0)
            prefix = prefix * _sigmoid(z[:, k])
            continue
        errors, shifts = [], []
        for i in range(0, g.size, chunk):
            scaled = z[None, :, k] / g[i:i + chunk, None]
            b = (_matching_offsets(prefix, scaled, obs[:, k].mean()) if offsets
                 else np.zeros(scaled.shape[0]))
            errors.append(_ece_over_grid(prefix[None, :] * _sigmoid(scaled + b[:, None]), obs[:, k], bins))
            shifts.append(b)
        best = int(np.argmin(np.concatenate(errors)))
        t_k, b_k = float(g[best]), float(np.concatenate(shifts)[best])
        temps.append(t_k)
        offs.append(b_k)
        prefix = prefix * _sigmoid(z[:, k] / t_k + b_k)
    return tuple(temps), tuple(offs)


def survival_gap(conf_logits, num_accepted, temperatures=None, offsets=None) -> np.ndarray:
    """Per-position |mean predicted a_k − mean observed survival_k|.

    Args:
      conf_logits: float [N, L].
      num_accepted: int [N] in 0..L.
      temperatures: float [L] or None (raw).
      offsets: float [L] or None (none).

    Returns:
      float64 [L].
    """
    z, m = _check(conf_logits, num_accepted)
    pred = predicted_survival(z, temperatures, offsets)
    return np.abs(pred.mean(axis=0) - survival_labels(m, z.shape[1]).mean(axis=0))


def conditional_auc(conf_logits, num_accepted) -> list[float | None]:
    """Per position k, the ROC-AUC of z_k for "x_k accepted" among the rounds that reached k (num_accepted ≥
    k − 1): how well the head ranks the drafts it is asked about. Monotone maps of z_k (any calibration) leave
    it unchanged. None where the rounds that reached k are all accepted or all rejected."""
    from scipy.stats import rankdata

    z, m = _check(conf_logits, num_accepted)
    out = []
    for k in range(1, z.shape[1] + 1):
        reached = m >= k - 1
        pos = (m[reached] >= k)
        n_pos, n_neg = int(pos.sum()), int((~pos).sum())
        if not n_pos or not n_neg:
            out.append(None)
            continue
        ranks = rankdata(z[reached, k - 1])  # ties get their mean rank (Mann–Whitney)
        out.append(float((ranks[pos].sum() - n_pos * (n_pos + 1) / 2) / (n_pos * n_neg)))
    return out


def calibration_report(conf_logits, num_accepted, temperatures, bins: int = DEFAULT_BINS, offsets=None) -> dict:
    """Calibration of a_k before (raw) and after (the given temperatures and offsets), JSON-serialisable.

    The issue's acceptance criterion is `mean_gap_after` ≤ 0.01 on held-out rounds.

    Args:
      conf_logits: float [N, L].
      num_accepted: int [N] in 0..L.
      temperatures: float [L], e.g. from `sequential_calibration` on a different split.
      bins: ECE bins.
      offsets: float [L] logit offsets, or None.

    Returns:
      dict with temperatures and offsets; auc [L] (`conditional_auc`, the same before and after);
      ece_before / ece_after [L] per position and the pooled ece_pooled_before/after;
      gap_before / gap_after [L] and their means mean_gap_before / mean_gap_after; mean predicted survival
      pred_survival_before / after [L] and observed obs_survival [L]; num_rounds N and num_survived [L]
      (rounds that accepted at least k draft tokens).
    """
    z, m = _check(conf_logits, num_accepted)
    block = z.shape[1]
    t, b = _temperatures(temperatures, block), _offsets(offsets, block)
    obs = survival_labels(m, block)
    report: dict = {"temperatures": [float(x) for x in t], "offsets": [float(x) for x in b],
                    "auc": conditional_auc(z, m), "num_rounds": int(z.shape[0]),
                    "num_survived": [int(x) for x in obs.sum(axis=0)],
                    "obs_survival": [float(x) for x in obs.mean(axis=0)]}
    for name, temps, offs in (("before", None, None), ("after", t, b)):
        pred = predicted_survival(z, temps, offs)
        gap = np.abs(pred.mean(axis=0) - obs.mean(axis=0))
        report[f"ece_{name}"] = [ece(pred[:, k], obs[:, k], bins) for k in range(block)]
        report[f"ece_pooled_{name}"] = ece(pred, obs, bins)
        report[f"gap_{name}"] = [float(x) for x in gap]
        report[f"mean_gap_{name}"] = float(gap.mean())
        report[f"pred_survival_{name}"] = [float(x) for x in pred.mean(axis=0)]
    return report


def _reliability_curve(pred: np.ndarray, obs: np.ndarray, bins: int):
    """Per non-empty bin: mean predicted, mean observed, count."""
    idx = _bin_index(pred, bins)
    count = np.bincount(idx, minlength=bins)
    sum_pred = np.bincount(idx, weights=pred, minlength=bins)
    sum_obs = np.bincount(idx, weights=obs, minlength=bins)
    keep = count > 0
    return sum_pred[keep] / count[keep], sum_obs[keep] / count[keep], count


def reliability_diagram(conf_logits, num_accepted, temperatures, path, title: str = "Prefix survival calibration",
                        bins: int = DEFAULT_BINS, offsets=None):
    """Write a PNG: a reliability curve of a_k pooled over positions, and mean a_k per position, before/after.

    Left panel: binned mean predicted vs observed survival over all (round, position) pairs, raw (T = 1) and
    calibrated, over a shaded histogram of the calibrated predictions (paper Fig. 6 style).
    Right panel: mean predicted survival per position, raw and calibrated, against the observed survival.

    Args:
      conf_logits: float [N, L].
      num_accepted: int [N] in 0..L.
      temperatures: float [L].
      path: output PNG path.
      offsets: float [L] logit offsets, or None.
      title: figure title.
      bins: reliability bins.

    Returns:
      path.
    """
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from train.plots import save_figure

    z, m = _check(conf_logits, num_accepted)
    block = z.shape[1]
    obs = survival_labels(m, block)
    before, after = predicted_survival(z, None), predicted_survival(z, temperatures, offsets)
    positions = np.arange(1, block + 1)

    fig, (ax_rel, ax_pos) = plt.subplots(1, 2, figsize=(11, 4.5))
    hist = ax_rel.twinx()
    _, _, count = _reliability_curve(after.ravel(), obs.ravel(), bins)
    hist.bar((np.arange(bins) + 0.5) / bins, count, width=1.0 / bins, color="0.85", zorder=0)
    hist.set_ylabel("samples (calibrated)")
    ax_rel.set_zorder(hist.get_zorder() + 1)
    ax_rel.patch.set_visible(False)  # let the histogram show through behind the curves
    ax_rel.plot([0, 1], [0, 1], color="0.5", linestyle=":", label="perfect")
    for name, pred, style in (("raw", before, "--"), ("calibrated", after, "-")):
        p, o, _ = _reliability_curve(pred.ravel(), obs.ravel(), bins)
        ax_rel.plot(p, o, style, marker="o", label=f"{name} (ECE {ece(pred, obs, bins):.3f})")
    ax_rel.set(xlim=(0, 1), ylim=(0, 1), xlabel="predicted survival a_k", ylabel="observed survival",
               title="Reliability, pooled over positions")
    ax_rel.legend(loc="upper left")

    ax_pos.plot(positions, obs.mean(axis=0), "k-", marker="s", label="observed")
    ax_pos.plot(positions, before.mean(axis=0), "--", marker="o", label="raw")
    ax_pos.plot(positions, after.mean(axis=0), "-", marker="o", label="calibrated")
    ax_pos.set(xlabel="draft position k", ylabel="mean survival", ylim=(0, 1.02), xticks=positions,
               title="Mean survival per position")
    ax_pos.legend()
    fig.suptitle(title)
    save_figure(fig, path)
    return path
