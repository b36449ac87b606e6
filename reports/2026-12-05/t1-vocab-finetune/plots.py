"""heldout_ft.png: held-out c* on T = 1 text (mean over the 7 positions, and position 1) against fine-tuning step,
for the 27,648-token vocabulary run and the 8,192-token control, beside the shipped drafter (step 0 of both)."""

import json
import os

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

here = os.path.dirname(os.path.abspath(__file__))
shipped = json.load(open(os.path.join(here, "..", "cheap-ab", "shipped-heldout.json")))
shipped = shipped["drafters"]["smollm2-135m-instruct/dspark"]["t1"]["c_star"]
moved = json.load(open(os.path.join(here, "moved_step0_heldout.json")))["drafters"]["runs/moved-step0"]["t1"]["c_star"]
fig, axes = plt.subplots(1, 2, figsize=(10, 4))
for name, label, step0 in [("t1vocab", "27,648 tokens (T = 1 mass)", moved), ("ft8k", "8,192 tokens (control, stopped at 750)", shipped)]:
    rows = [json.loads(ln) for ln in open(os.path.join(here, f"metrics-{name}.jsonl")) if '"heldout"' in ln]
    steps = [0] + [r["step"] for r in rows]
    c = [step0] + [r["heldout"]["t1"]["c_star"] for r in rows]
    axes[0].plot(steps, [sum(x) / len(x) for x in c], marker="o", label=label)
    axes[1].plot(steps, [x[0] for x in c], marker="o", label=label)
for ax, title, value in [(axes[0], "mean over positions", sum(shipped) / 7), (axes[1], "position 1", shipped[0])]:
    ax.axhline(value, ls=":", c="gray", label="shipped drafter")
    ax.set(xlabel="fine-tuning step", ylabel="held-out c* (T = 1)", title=title)
    ax.grid(alpha=0.3)
axes[0].legend()
fig.suptitle("Fine-tuning the shipped DSpark from its weights (lr 3e-4, 1,000 steps)")
fig.tight_layout()
fig.savefig(os.path.join(here, "heldout_ft.png"), dpi=110)
