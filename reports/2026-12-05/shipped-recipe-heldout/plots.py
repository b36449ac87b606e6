"""The re-run of the shipped DSpark recipe with held-out logging: its training loss beside the shipped run's
(same command, same seed and data order), and its held-out curve. Run from the repository root:
    python reports/2026-12-05/shipped-recipe-heldout/plots.py runs/af-heldout
"""

import json
import os
import shutil
import sys

sys.path.insert(0, os.getcwd())
from train.plots import plot_loss_curves  # noqa: E402

HERE = os.path.dirname(os.path.abspath(__file__))
SHIPPED = "dspark_jax/drafters/smollm2-135m-instruct/dspark/metrics.jsonl"


def read(path):
    with open(path) as f:
        return [json.loads(line) for line in f]


def main(run_dir: str) -> None:
    rerun, shipped = read(os.path.join(run_dir, "metrics.jsonl")), read(SHIPPED)
    train = {"shipped run": [r for r in shipped if "loss" in r], "re-run": [r for r in rerun if "loss" in r]}
    plot_loss_curves(train, os.path.join(HERE, "loss_shipped_vs_rerun.png"),
                     title="configs/smollm2_af_dspark.yaml: shipped run and its re-run with held-out logging")
    shutil.copy(os.path.join(run_dir, "heldout.png"), os.path.join(HERE, "heldout.png"))
    rows = [{"step": r["step"], "heldout": r["heldout"], "best": r["best"]} for r in rerun if "heldout" in r]
    with open(os.path.join(HERE, "heldout.json"), "w") as f:
        json.dump(rows, f, indent=1)
    by_step = {r["step"]: r for r in train["shipped run"]}
    for r in train["re-run"]:
        if r["step"] % 500 == 0 and r["step"] in by_step:
            print(f"step {r['step']}: loss shipped {by_step[r['step']]['loss']:.4f}, re-run {r['loss']:.4f}")
    for r in rows:
        t1, t0 = r["heldout"]["t1"], r["heldout"].get("t0", {})
        mean = sum(t1["c_star"]) / len(t1["c_star"])
        print(f"step {r['step']}: t1 c* k=1 {t1['c_star'][0]:.3f} mean {mean:.3f}; "
              f"t0 top-1 k=1 {t0.get('top1', [float('nan')])[0]:.3f}{'  (best so far)' if r['best'] else ''}")


if __name__ == "__main__":
    main(sys.argv[1])
