"""Figures for drafter evaluation and training, as matplotlib (Agg) PNG writers that take plain dicts.

Inputs are the JSON-shaped results the evaluation and training scripts write, so a figure can be redrawn
from saved results without a model:
  plot_tau                    — τ (emitted tokens per round) per domain and drafter, grouped bars + macro average;
  plot_conditional_acceptance — c_k per draft position (paper Fig. 2), one panel per domain if given;
  plot_loss_curves            — training loss (and acceptance, when logged) against step, from JSONL records;
  plot_heldout                — one run's training loss beside its held-out acceptance (train/heldout.py);
  plot_heldout_runs           — several runs' held-out acceptance against step (A/Bs), reference levels dotted;
  plot_throughput             — total and per-user tokens/s against concurrency, per scheduler.
Every function returns the path it wrote, a palette PNG (`save_figure`, used by every figure writer here);
`heldout_table` gives the A/B runs' held-out results as Markdown.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import numpy as np


def _pyplot():
    # Import lazily and force the file-only backend: these run on headless machines and inside tests.
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def save_figure(fig, path, dpi: int = 100):
    """Writes `fig` to `path` as a 256-colour palette PNG and closes it. A plot's flat colours and anti-aliased
    edges fit a palette with no visible change, at about a third of matplotlib's RGBA file (the committed
    reports and drafter cards carry dozens)."""
    import io

    fig.tight_layout()
    buf = io.BytesIO()
    fig.savefig(buf, dpi=dpi, format="png")
    _pyplot().close(fig)
    buf.seek(0)
    palette_png(buf, path)
    return path


def palette_png(source, path) -> None:
    """Rewrites a PNG (`source`: a path or file object) at `path` as a 256-colour palette PNG."""
    from PIL import Image

    with Image.open(source) as image:
        rgb = image.convert("RGB")
    rgb.quantize(colors=256, method=Image.Quantize.MEDIANCUT, dither=Image.Dither.NONE).save(path, format="PNG",
                                                                                           optimize=True)


def plot_tau(results: Mapping[str, Mapping[str, float]], path, title: str = "Accepted length τ per domain"):
    """Grouped bars: one group per domain plus a macro average ("avg"), one bar per drafter.

    Args:
      results: {drafter name: {domain: τ}}. A drafter missing a domain gets no bar there, and its average is
        over the domains it has.
      path: output PNG path.
      title: axes title.

    Returns:
      path.
    """
    if not results:
        raise ValueError("results is empty")
    plt = _pyplot()
    domains = list(dict.fromkeys(d for per_domain in results.values() for d in per_domain))
    groups = [*domains, "avg"]
    width = 0.8 / len(results)
    x = np.arange(len(groups))
    fig, ax = plt.subplots(figsize=(max(6.0, 1.2 * len(groups) + 2), 4))
    for i, (name, per_domain) in enumerate(results.items()):
        values = [per_domain.get(d, np.nan) for d in domains]
        values.append(float(np.nanmean(values)) if per_domain else np.nan)
        bars = ax.bar(x + (i - (len(results) - 1) / 2) * width, values, width, label=name)
        ax.bar_label(bars, fmt="%.2f", fontsize=7, padding=1)
    ax.set_xticks(x, groups)
    ax.set(ylabel="τ (tokens per round)", title=title)
    ax.legend()
    return save_figure(fig, path)


def _acceptance_lines(ax, curves: Mapping[str, Sequence[float]], title: str):
    for name, values in curves.items():
        ax.plot(np.arange(1, len(values) + 1), values, marker="o", label=name)
    ax.set(xlabel="draft position k", ylabel="conditional acceptance c_k", title=title)
    ax.xaxis.get_major_locator().set_params(integer=True)
    ax.grid(alpha=0.3)


def plot_conditional_acceptance(results: Mapping[str, Sequence[float] | Mapping[str, Sequence[float]]], path,
                                title: str = "Position-wise conditional acceptance"):
    """Lines of c_k = P(x_k accepted | x_1..x_{k−1} accepted) against draft position k (paper Fig. 2).

    Args:
      results: either {drafter name: [c_1, ..., c_L]} (one panel), or {drafter name: {domain: [c_1, ...]}}
        (one panel per domain, sharing the y axis).
      path: output PNG path.
      title: figure title.

    Returns:
      path.
    """
    if not results:
        raise ValueError("results is empty")
    plt = _pyplot()
    per_domain = [isinstance(v, Mapping) for v in results.values()]
    if any(per_domain) and not all(per_domain):
        raise ValueError("results must map every drafter to a list, or every drafter to {domain: list}")
    if not all(per_domain):
        fig, ax = plt.subplots(figsize=(6, 4))
        _acceptance_lines(ax, results, title)
        ax.legend()
        return save_figure(fig, path)
    domains = list(dict.fromkeys(d for curves in results.values() for d in curves))
    fig, axes = plt.subplots(1, len(domains), figsize=(4 * len(domains), 4), sharey=True, squeeze=False)
    for ax, domain in zip(axes[0], domains, strict=True):
        _acceptance_lines(ax, {name: curves[domain] for name, curves in results.items() if domain in curves}, domain)
    axes[0][0].legend()
    fig.suptitle(title)
    return save_figure(fig, path)


def plot_loss_curves(runs: Mapping[str, Sequence[Mapping]], path, title: str = "Training"):
    """Loss against step per run, plus a second panel of acceptance when any record logs it.

    Args:
      runs: {run name: JSONL records}, each a dict with "step" and "loss" and optionally "acceptance" (mean
        conditional acceptance, a float). Records without a key are skipped for that curve (e.g. eval lines).
      path: output PNG path.
      title: figure title.

    Returns:
      path.
    """
    if not runs:
        raise ValueError("runs is empty")
    plt = _pyplot()
    keys = ["loss"] + (["acceptance"] if any("acceptance" in r for recs in runs.values() for r in recs) else [])
    fig, axes = plt.subplots(1, len(keys), figsize=(5.5 * len(keys), 4), squeeze=False)
    for ax, key in zip(axes[0], keys, strict=True):
        for name, records in runs.items():
            points = [(r["step"], float(np.mean(r[key]))) for r in records if "step" in r and key in r]
            if points:
                ax.plot(*zip(*points, strict=True), label=name)
        ax.set(xlabel="step", ylabel=key, title=key)
        ax.grid(alpha=0.3)
        ax.legend()
    if keys[0] == "loss" and all(r["loss"] > 0 for recs in runs.values() for r in recs if "loss" in r):
        axes[0][0].set_yscale("log")  # losses fall over orders of magnitude; log only when it is defined
    fig.suptitle(title)
    return save_figure(fig, path)


def plot_heldout(records: Sequence[Mapping], path, best_step: int | None = None, title: str = "Training"):
    """Three panels against step for one run's metrics.jsonl records: the training loss; the held-out c* (mean
    over draft positions, one line per set, and position 1 dashed); the held-out top-1 agreement likewise.

    Args:
      records: training lines ({"step", "loss", ...}) and held-out lines ({"step", "heldout": {set: {"c_star":
        [L], "top1": [L]}}}), in any order.
      path: output PNG path.
      best_step: a vertical line marks it (the step saved as the drafter), when given.
      title: figure title.

    Returns:
      path.
    """
    plt = _pyplot()
    train = [(r["step"], float(r["loss"])) for r in records if "loss" in r]
    evals = [r for r in records if "heldout" in r]
    if not train and not evals:
        raise ValueError("records hold neither training losses nor held-out results")
    fig, axes = plt.subplots(1, 3, figsize=(16, 4))
    if train:
        axes[0].plot(*zip(*train, strict=True), label="train")
        if all(v > 0 for _, v in train):
            axes[0].set_yscale("log")
    axes[0].set(xlabel="step", ylabel="loss", title="training loss")
    for ax, key, label in ((axes[1], "c_star", "held-out c* (T = 1)"), (axes[2], "top1", "held-out top-1 (T = 0)")):
        names = list(dict.fromkeys(n for r in evals for n in r["heldout"]))
        for i, name in enumerate(names):
            pts = [(r["step"], r["heldout"][name][key]) for r in evals if name in r["heldout"]]
            steps = [s for s, _ in pts]
            line, = ax.plot(steps, [float(np.mean(v)) for _, v in pts], marker="o", label=f"{name}: mean",
                            color=f"C{i}")
            ax.plot(steps, [v[0] for _, v in pts], ls="--", color=line.get_color(), label=f"{name}: position 1")
        ax.set(xlabel="step", ylabel=key, title=label)
    for ax in axes:
        if best_step is not None:
            ax.axvline(best_step, color="grey", ls=":", label=f"saved: step {best_step}")
        ax.grid(alpha=0.3)
        if ax.get_legend_handles_labels()[0]:
            ax.legend(fontsize=7)
    fig.suptitle(title)
    return save_figure(fig, path)


def plot_heldout_runs(runs: Mapping[str, Sequence[Mapping]], path, *, set_name: str = "t1",
                      measure: str = "c_star", reference: Mapping[str, float] | None = None,
                      title: str = "Held-out acceptance"):
    """One set's held-out measure against step for several runs (the A/B view): mean over draft positions in
    the left panel, position 1 in the right, one line per run.

    Args:
      runs: {run name: metrics.jsonl records}; only held-out lines ({"step", "heldout": {set: {measure: [L]}}})
        are read.
      path: output PNG path.
      set_name, measure: which held-out set and measure ("c_star" or "top1").
      reference: {label: (mean, position 1)} drawn as dotted horizontal lines, e.g. a shipped drafter measured
        on the same rows by `python -m train heldout`.
      title: figure title.

    Returns:
      path.
    """
    plt = _pyplot()
    fig, axes = plt.subplots(1, 2, figsize=(12, 4), sharey=True)
    drawn = 0
    for i, (name, records) in enumerate(runs.items()):
        pts = [(r["step"], r["heldout"][set_name][measure]) for r in records
               if set_name in r.get("heldout", {})]
        if not pts:
            continue
        drawn += 1
        steps = [s for s, _ in pts]
        axes[0].plot(steps, [float(np.mean(v)) for _, v in pts], marker="o", color=f"C{i}", label=name)
        axes[1].plot(steps, [v[0] for _, v in pts], marker="o", color=f"C{i}", label=name)
    if not drawn:
        raise ValueError(f"no run holds held-out {measure!r} results on set {set_name!r}")
    for j, (label, levels) in enumerate((reference or {}).items()):
        for ax, level in zip(axes, levels, strict=True):
            ax.axhline(level, color=f"C{drawn + j}", ls=":", label=label)
    for ax, sub in zip(axes, ("mean over draft positions", "position 1"), strict=True):
        ax.set(xlabel="step", ylabel=f"held-out {measure} ({set_name})", title=sub)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    fig.suptitle(title)
    return save_figure(fig, path)


def heldout_table(runs: Mapping[str, Sequence[Mapping]], columns: Sequence[tuple[str, str, str, int | None]], *,
                  every: int = 100) -> str:
    """The A/B runs' held-out results as a Markdown table: a row per run and evaluation step that `every` divides.

    Args:
      runs: {run name: metrics.jsonl records}, as `plot_heldout_runs` reads them.
      columns: (header, set, measure, position): position k (0-based) of that set's measure, or None for the mean
        over draft positions.
      every: which evaluation steps get a row.

    Returns:
      The table, one line per row, without a trailing newline.
    """
    lines = ["| arm | step | " + " | ".join(c[0] for c in columns) + " |", "|---|---:|" + "---:|" * len(columns)]
    for name, records in runs.items():
        for r in records:
            if "heldout" in r and r["step"] % every == 0:
                values = [r["heldout"][s][m] for _, s, m, _ in columns]
                cells = [sum(v) / len(v) if k is None else v[k] for v, (*_, k) in zip(values, columns, strict=True)]
                lines.append(f"| {name} | {r['step']} | " + " | ".join(f"{x:.4f}" for x in cells) + " |")
    return "\n".join(lines)


def plot_throughput(results: Mapping[str, Mapping[int | str, Mapping[str, float]]], path,
                    title: str = "Serving throughput"):
    """Two panels against concurrency (log2 x axis): total tokens/s and per-user tokens/s, one line per scheduler.

    Args:
      results: {scheduler: {concurrency: {"total_tps": float, "per_user_tps": float}}}; concurrency keys may be
        ints or their strings (as read back from JSON).
      path: output PNG path.
      title: figure title.

    Returns:
      path.
    """
    if not results:
        raise ValueError("results is empty")
    plt = _pyplot()
    from matplotlib.ticker import FuncFormatter

    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    for ax, key, label in ((axes[0], "total_tps", "total tokens/s"), (axes[1], "per_user_tps", "per-user tokens/s")):
        for name, by_conc in results.items():
            points = sorted((int(c), float(v[key])) for c, v in by_conc.items())
            if not points:
                continue
            ax.plot(*zip(*points, strict=True), marker="o", label=name)
        ax.set_xscale("log", base=2)
        ax.xaxis.set_major_formatter(FuncFormatter(lambda v, _: f"{v:g}"))  # 1, 2, 4, … not 2^k
        ax.set(xlabel="concurrency", ylabel=label, title=label)
        ax.grid(alpha=0.3, which="both")
        ax.legend()
    fig.suptitle(title)
    return save_figure(fig, path)
