"""Table and figures of the loss A/Bs: every arm's held-out acceptance at each evaluation, from
runs/loss-ab/<arm>/metrics.jsonl, beside the cheap A/Bs' base arm (the same config on an earlier tree,
../cheap-ab/metrics-base.jsonl). Copies each arm's metrics.jsonl here as metrics-<arm>.jsonl.

    python reports/2026-12-05/loss-ab/summarize.py [runs/loss-ab] > reports/2026-12-05/loss-ab/table.md
"""

import json
import os
import shutil
import sys

sys.path.insert(0, os.getcwd())
from train.plots import heldout_table, plot_heldout_runs  # noqa: E402

HERE = os.path.dirname(os.path.abspath(__file__))
root = sys.argv[1] if len(sys.argv) > 1 else "runs/loss-ab"
ARMS = ("dspark-kl", "dspark-L1", "dspark-L1-wide", "dspark-r256", "eagle3", "eagle3-soft")
for a in ARMS:
    src = os.path.join(root, a, "metrics.jsonl")
    if os.path.exists(src):
        shutil.copy(src, os.path.join(HERE, f"metrics-{a}.jsonl"))
runs = {"dspark-base (earlier tree)": os.path.join(HERE, "..", "cheap-ab", "metrics-base.jsonl")}
runs.update({a: os.path.join(HERE, f"metrics-{a}.jsonl") for a in ARMS})
runs = {a: [json.loads(ln) for ln in open(p)] for a, p in runs.items() if os.path.exists(p)}
runs = {a: recs for a, recs in runs.items() if any("heldout" in r for r in recs)}

COLUMNS = [("t1 c* mean", "t1", "c_star", None),
           ("t1 c* k = 1", "t1", "c_star", 0),
           ("t0 c* mean", "t0", "c_star", None),
           ("t0 top-1 mean", "t0", "top1", None),
           ("t0 top-1 k = 1", "t0", "top1", 0)]
print(heldout_table(runs, COLUMNS))
plot_heldout_runs(runs, os.path.join(HERE, "loss_ab_t1.png"), set_name="t1", measure="c_star",
                  title="Loss A/Bs, 300 steps: held-out c* on T = 1 text")
plot_heldout_runs(runs, os.path.join(HERE, "loss_ab_t0.png"), set_name="t0", measure="top1",
                  title="Loss A/Bs, 300 steps: held-out top-1 on greedy (T = 0) text")
