"""Table and figures of the Markov-rank cut: held-out acceptance of the rank-256 arm, its cuts and the rank-32 arm
(heldout.json, from measure.sh), the cuts' kept energy (runs/anchor-ab/shrink/*.json, copied here as cuts.json),
and the curves of the rank and W1-scale arms (ab.sh, ab2.sh) beside ../anchor-ab's fused and EAGLE-3 arms.

    python reports/2026-12-06/markov-shrink/summarize.py > reports/2026-12-06/markov-shrink/table.md
"""

import json
import os
import shutil
import sys

import numpy as np

sys.path.insert(0, os.getcwd())
from train.plots import _pyplot, heldout_table, plot_heldout_runs, save_figure  # noqa: E402

HERE = os.path.dirname(os.path.abspath(__file__))
AB = os.path.join(HERE, "..", "anchor-ab")
held = json.load(open(os.path.join(HERE, "heldout.json")))["drafters"]
held.update(json.load(open(os.path.join(HERE, "heldout-r1024.json")))["drafters"])  # measure2.sh
cuts_path = os.path.join(HERE, "cuts.json")
if os.path.isdir("runs/anchor-ab/shrink1024"):
    cuts = {f"{d}/{f[:-5]}": json.load(open(os.path.join("runs/anchor-ab", d, f)))
            for d in ("shrink", "shrink1024") for f in sorted(os.listdir(os.path.join("runs/anchor-ab", d)))
            if f.endswith(".json")}
    json.dump(cuts, open(cuts_path, "w"), indent=1)
cuts = json.load(open(cuts_path))
ARMS = ("fused-r256", "fused-r32-s016", "fused-r256-s006", "fused-r1024", "fused-r2048")  # ab.sh, ab2.sh
for arm in ARMS:
    if os.path.exists(f"runs/anchor-ab/{arm}/metrics.jsonl"):
        shutil.copy(f"runs/anchor-ab/{arm}/metrics.jsonl", os.path.join(HERE, f"metrics-{arm}.jsonl"))

NAMES = {"runs/anchor-ab/fused/drafter": "trained at rank 32", "runs/anchor-ab/fused-r256/drafter": "trained at 256",
         "runs/anchor-ab/fused-r1024/drafter": "trained at 1024"}
for k in held:
    if "/shrink" in k:
        cut, src = os.path.basename(k), "1024" if "/shrink1024/" in k else "256"
        NAMES[k] = f"{src} cut to {cut[1:].split('-')[0]}" + (", rows weighted" if cut.endswith("-w") else "")

rows = ["| drafter | kept energy | Markov params | t1 c* mean | t1 c* k = 1 | t1 c* k = 7 | t0 c* mean | "
        "t0 top-1 mean | t0 top-1 k = 1 |", "|---|---:|---:|---:|---:|---:|---:|---:|---:|"]
for k, name in NAMES.items():
    r = held[k]
    cut = cuts.get("/".join(k.split("/")[-2:]), {})
    rank = cut.get("markov_rank", {}).get("to", {"r256": 256, "r1024": 1024}.get(k.split("-")[-1].split("/")[0], 32))
    energy = f"{cut['kept_energy']:.6f}" if cut else "—"
    rows.append(f"| {name} | {energy} | {(8193 + 8192) * rank:,} | {np.mean(r['t1']['c_star']):.4f} | "
                f"{r['t1']['c_star'][0]:.4f} | {r['t1']['c_star'][-1]:.4f} | {np.mean(r['t0']['c_star']):.4f} | "
                f"{np.mean(r['t0']['top1']):.4f} | {r['t0']['top1'][0]:.4f} |")
print("\n".join(rows))

plt = _pyplot()
fig, axes = plt.subplots(1, 2, figsize=(11, 4))
for ax, (s, m) in zip(axes, (("t1", "c_star"), ("t0", "top1")), strict=True):
    for k in ("runs/anchor-ab/fused/drafter", "runs/anchor-ab/fused-r256/drafter", "runs/anchor-ab/shrink/r32"):
        ax.plot(range(1, 8), held[k][s][m], marker="o", label=NAMES[k])
    ax.set(xlabel="draft position k", ylabel=m, title=f"{s}: held-out {m} at step 300")
    ax.grid(alpha=0.3)
    ax.legend()
save_figure(fig, os.path.join(HERE, "positions.png"))
runs = {a: [json.loads(ln) for ln in open(p)] for a, p in (
    ("rank 32, σ 0.02", os.path.join(AB, "metrics-fused.jsonl")),
    ("rank 32, σ 0.16", os.path.join(HERE, "metrics-fused-r32-s016.jsonl")),
    ("rank 256, σ 0.02", os.path.join(HERE, "metrics-fused-r256.jsonl")),
    ("rank 256, σ 0.06", os.path.join(HERE, "metrics-fused-r256-s006.jsonl")),
    ("rank 1024", os.path.join(HERE, "metrics-fused-r1024.jsonl")),
    ("rank 2048", os.path.join(HERE, "metrics-fused-r2048.jsonl")),
    ("EAGLE-3", os.path.join(AB, "metrics-eagle3-soft.jsonl")))}
plot_heldout_runs(runs, os.path.join(HERE, "curves_t1.png"), set_name="t1", measure="c_star",
                  title="300 steps: held-out c* on T = 1 text")
print()
print(heldout_table(runs, [("t1 c* mean", "t1", "c_star", None), ("t1 c* k = 1", "t1", "c_star", 0),
                           ("t1 c* k = 7", "t1", "c_star", -1), ("t0 top-1 mean", "t0", "top1", None)]))
