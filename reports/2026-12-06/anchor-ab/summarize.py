"""Table and figures of the anchor-mode A/B: every arm's held-out acceptance at each evaluation, from
runs/anchor-ab/<arm>/metrics.jsonl. Copies each arm's metrics.jsonl here as metrics-<arm>.jsonl.

    python reports/2026-12-06/anchor-ab/summarize.py [runs/anchor-ab] > reports/2026-12-06/anchor-ab/table.md
"""

import json
import os
import shutil
import sys

sys.path.insert(0, os.getcwd())
from train.plots import heldout_table, plot_heldout_runs  # noqa: E402

HERE = os.path.dirname(os.path.abspath(__file__))
root = sys.argv[1] if len(sys.argv) > 1 else "runs/anchor-ab"
ARMS = [a for a in ("base", "residual", "fused", "context-tokens", "fused-context-tokens", "dspark-a256",
                    "dspark-e3loss", "eagle3-soft", "eagle3-soft-L1")
        if any(os.path.exists(p) for p in (os.path.join(root, a, "metrics.jsonl"),
                                           os.path.join(HERE, f"metrics-{a}.jsonl")))]
for a in ARMS:
    src = os.path.join(root, a, "metrics.jsonl")
    if os.path.exists(src):
        shutil.copy(src, os.path.join(HERE, f"metrics-{a}.jsonl"))
runs = {a: [json.loads(ln) for ln in open(os.path.join(HERE, f"metrics-{a}.jsonl"))] for a in ARMS}
runs = {a: recs for a, recs in runs.items() if any("heldout" in r for r in recs)}

COLUMNS = [("t1 c* mean", "t1", "c_star", None),
           ("t1 c* k = 1", "t1", "c_star", 0),
           ("t1 c* k = 7", "t1", "c_star", -1),
           ("t0 top-1 mean", "t0", "top1", None),
           ("t0 top-1 k = 1", "t0", "top1", 0)]
print(heldout_table(runs, COLUMNS))
plot_heldout_runs(runs, os.path.join(HERE, "anchor_ab_t1.png"), set_name="t1", measure="c_star",
                  title="Anchor-mode A/B, 300 steps: held-out c* on T = 1 text")
plot_heldout_runs(runs, os.path.join(HERE, "anchor_ab_t0.png"), set_name="t0", measure="top1",
                  title="Anchor-mode A/B, 300 steps: held-out top-1 on greedy (T = 0) text")
