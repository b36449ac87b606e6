"""Table and figures of the cheap A/Bs: each arm's held-out acceptance at its last evaluation against the base
arm at the same step, from runs/ab/<arm>/metrics.jsonl; the shipped drafter's levels from shipped-heldout.json.

    python reports/2026-12-05/cheap-ab/summarize.py [runs/ab] > reports/2026-12-05/cheap-ab/table.md
"""

import json
import os
import sys

sys.path.insert(0, os.getcwd())
from train.plots import plot_heldout_runs  # noqa: E402

HERE = os.path.dirname(os.path.abspath(__file__))
root = sys.argv[1] if len(sys.argv) > 1 else "runs/ab"
arms = [a for a in ("base", "feature-norm", "final-feature", "gamma4", "layers4")
        if os.path.exists(os.path.join(root, a, "metrics.jsonl"))]
runs = {a: [json.loads(ln) for ln in open(os.path.join(root, a, "metrics.jsonl"))] for a in arms}
runs = {a: recs for a, recs in runs.items() if any("heldout" in r for r in recs)}  # an arm not yet evaluated


def mean(v):
    return sum(v) / len(v)


def last_eval(recs):
    return [r for r in recs if "heldout" in r][-1]


base_at = {r["step"]: r["heldout"] for r in runs["base"] if "heldout" in r}  # each arm against base at its step
print("| arm | steps | loss (last 5 logs) | t1 c* mean | Δ base | t1 c* k = 1 | Δ base | t0 top-1 mean | Δ base "
      "| t0 top-1 k = 1 |")
print("|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
for a, recs in runs.items():
    h = last_eval(recs)
    t1, t0 = h["heldout"]["t1"], h["heldout"]["t0"]
    base = base_at[h["step"]]
    loss = mean([r["loss"] for r in recs if "loss" in r][-5:])
    print(f"| {a} | {h['step']} | {loss:.3f} | {mean(t1['c_star']):.4f} | {mean(t1['c_star']) - mean(base['t1']['c_star']):+.4f} "
          f"| {t1['c_star'][0]:.4f} | {t1['c_star'][0] - base['t1']['c_star'][0]:+.4f} | {mean(t0['top1']):.4f} "
          f"| {mean(t0['top1']) - mean(base['t0']['top1']):+.4f} | {t0['top1'][0]:.4f} |")
shipped = json.load(open(os.path.join(HERE, "shipped-heldout.json")))["drafters"]
ref = {f"shipped ({name}, 3,000 steps)": (mean(s["t1"]["c_star"]), s["t1"]["c_star"][0]) for name, s in shipped.items()}
plot_heldout_runs(runs, os.path.join(HERE, "ab_t1.png"), set_name="t1", measure="c_star", reference=ref,
                  title="Cheap A/Bs, 300 steps: held-out c* on T = 1 text")
ref0 = {f"shipped ({name})": (mean(s["t0"]["top1"]), s["t0"]["top1"][0]) for name, s in shipped.items()}
plot_heldout_runs(runs, os.path.join(HERE, "ab_t0.png"), set_name="t0", measure="top1", reference=ref0,
                  title="Cheap A/Bs, 300 steps: held-out top-1 on greedy (T = 0) text")
