"""Copies a finished training run's record next to its exported drafter (the shipped checkpoint directory):
train_config.json, metrics.jsonl, a loss-curve PNG and a README.md with the exact command, the data, the
final metrics and the checkpoint size. A run that logged held-out acceptance (`heldout:` in its config) also
gets its held-out curve (heldout.png) and the saved step's per-position held-out c* and top-1 in the card.

    python scripts/ship_drafter.py runs/smollm2-dspark dspark_jax/drafters/smollm2-135m-instruct/dspark \\
        --command "python -m train fit --config configs/smollm2_dspark.yaml --export ..."

A drafter factory's output (scripts/drafter_factory.py: a directory with its metrics.json) is a run too: the card
then comes from metrics.json (settings, data, steps, the factory's own held-out c*; its loss history becomes
metrics.jsonl), plus, when given, `--heldout` (what `python -m train heldout --out` wrote: every drafter it
measured, the shipped one and those to compare it with) and `--shrink` (what `python -m train shrink --report`
wrote):

    python scripts/ship_drafter.py factory_out dspark_jax/drafters/smollm2-135m-instruct/dspark \\
        --command "..." --heldout heldout.json --shrink shrink.json --hardware "one H200"
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import shutil
import sys
import textwrap

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))


def _rows(results: dict, L: int) -> list[str]:
    """Table rows `| set | measure | k = 1 .. L | mean |` from {set: {"c_star": [L], "top1": [L], ...}}."""
    rows = []
    for name, res in results.items():
        for m in ("c_star", "top1"):
            if res.get(m):
                cells = [f"{v:.3f}" for v in res[m]] + [f"{sum(res[m]) / L:.3f}"]
                rows.append(f"| {name} | {m} | " + " | ".join(cells) + " |")
    return rows


def _table(rows: list[str], L: int) -> str:
    header = " | ".join(f"k = {k}" for k in range(1, L + 1))
    return "\n".join([f"| set | measure | {header} | mean |", "|---|---|" + "---:|" * (L + 1), *rows])


def heldout_section(run_dir: str, recs: list[dict], plot, png: str) -> str:
    """The card's held-out paragraph (and `png`, the curve) from a run's held-out lines; "" when it logged none."""
    evals = [r for r in recs if "heldout" in r]
    if not evals:
        return ""
    best_path = os.path.join(run_dir, "best.json")
    step = json.load(open(best_path))["step"] if os.path.exists(best_path) else evals[-1]["step"]
    plot(recs, png, best_step=step, title="training loss and held-out acceptance")
    saved = next(r for r in evals if r["step"] == step)["heldout"]
    L = len(next(iter(saved.values()))["c_star"])
    table = _table(_rows(saved, L), L)
    return f"""
Held-out acceptance (`train/heldout.py`: teacher-forced, on sequences never trained on; c_star is the T = 1
acceptance given the sequence's prefix, top1 the agreement with its next token, which on greedy text is the T = 0
acceptance), evaluated {len(evals)} times during training; the shipped weights are step {step}, the best mean
c_star (`heldout.png` plots every evaluation):

{table}
"""


FACTORY_METRICS = "metrics.json"  # train/factory.py METRICS_FILE (not imported: the card needs no jax)


def ship_factory(args) -> int:
    """The card of a drafter from a factory run (`args.run_dir` holds its metrics.json)."""
    from train.plots import plot_loss_curves

    metrics = json.load(open(os.path.join(args.run_dir, FACTORY_METRICS)))
    cfg = json.load(open(os.path.join(args.ship_dir, "drafter_config.json")))
    kind, L = cfg["kind"], cfg["block_size"]
    if kind not in metrics.get("drafters", {}):
        raise SystemExit(f"{args.run_dir}/{FACTORY_METRICS} has no {kind} drafter "
                         f"(it has {sorted(metrics.get('drafters', {}))})")
    s, data, train = metrics["settings"], metrics["data"], metrics["train"]
    history = train["history"][kind]
    with open(os.path.join(args.ship_dir, "metrics.jsonl"), "w") as f:
        f.writelines(json.dumps(r) + "\n" for r in history)
    with open(os.path.join(args.ship_dir, "train_config.json"), "w") as f:
        json.dump({"factory_settings": s, "loss_weights": train["loss_weights"][kind]}, f, indent=1)
    plot_loss_curves({kind: history}, os.path.join(args.ship_dir, "loss.png"), title="factory training")
    size = os.path.getsize(os.path.join(args.ship_dir, "model.safetensors")) / 1e6
    head = f"`{cfg['head']}`" + (f" (rank {cfg['markov_rank']})" if cfg["head"] != "none" else "")
    vocab = f"{len(cfg['draft_vocab']):,}-token draft vocabulary" if cfg.get("draft_vocab") else "the whole vocabulary"
    fill = functools.partial(textwrap.fill, width=116, break_on_hyphens=False, break_long_words=False)
    bullets = [
        f"Architecture: {kind}, block size L = {L}, {cfg['num_layers']} layer(s), sequential head {head}, confidence "
        f"head: {cfg['confidence']}; reads target layers {cfg['target_layers']}; {vocab}; calibration "
        f"temperatures: {cfg['calibration'] or 'none'}.",
        f"Weights: `model.safetensors`, bfloat16, {size:.1f} MB.",
        f"Data: {data['prompts']:,} prompts (Magpie queries the target wrote, stdlib docstrings; none equal to an "
        f"evaluation prompt, {data['eval_prompts_banned']:,} checked), {data['sequences']:,} responses by the target "
        f"({data['response_tokens']:,} tokens at {data['tokens_per_s']:,.0f} tokens/s; T = {s['temperature']}, a "
        f"share {s['greedy_share']} greedy; {data['heldout']:,} held out).",
        f"Run: {train['steps']:,} steps of {s['batch_sequences']} windows × {s['anchors_per_seq']} anchors "
        f"({train['anchor_blocks']:,} anchor blocks, T = {s['seq_len']}, peak lr {s['lr']}) in "
        f"{train['seconds'] / 60:.1f} min; the whole factory run {metrics['elapsed_s'] / 60:.1f} min on "
        f"{metrics['backend']}.",
    ]
    paragraphs = [
        f"# {kind} drafter for SmolLM2-135M-Instruct",
        fill(f"Trained by the drafter factory (`scripts/drafter_factory.py`, "
             f"[docs/training.md](../../../../docs/training.md)) in one run on {args.hardware}; loads with "
             f'`dspark_jax.load_drafter("smollm2-135m-instruct/{kind}", target)`.'),
        "\n".join(fill(b, initial_indent="- ", subsequent_indent="  ") for b in bullets),
        f"Command:\n\n```bash\n{args.command}\n```",
        fill("`metrics.jsonl` is the training log (every 50th step), `loss.png` plots it, `train_config.json` holds "
             "the factory's settings."),
    ]
    held = (metrics.get("heldout_acceptance") or {}).get(kind) or {}
    rows = _rows({name: {"c_star": held[name]} for name in ("t1", "t0") if held.get(name)}, L)
    if rows:
        seqs = held.get("sequences", {})
        paragraphs += [fill(f"Held-out c* from the factory run (its own held-out share: {seqs.get('t1', 0)} "
                            f"windows of T = 1 responses, {seqs.get('t0', 0)} of greedy ones; teacher-forced, before "
                            "any shrinking):"), _table(rows, L)]
    if args.shrink:
        sh = json.load(open(args.shrink))
        paragraphs.append(fill(
            f"Shrunk to ship (`python -m train shrink`, [train/shrink.py](../../../../train/shrink.py)): the Markov "
            f"head moved from {sh['draft_vocab']['from']:,} to {sh['draft_vocab']['to']:,} tokens and cut from rank "
            f"{sh['markov_rank']['from']} to {sh['markov_rank']['to']} (truncated SVD, "
            f"{100 * sh.get('kept_energy', 1.0):.1f}% of the product's squared norm kept); "
            f"{sh['params']['from']:,} → {sh['params']['to']:,} parameters."))
    if args.heldout:
        ho = json.load(open(args.heldout))
        sets = ", ".join(f"`{k}` = {v}" for k, v in ho["sets"].items())
        rows = [r for name, res in ho["drafters"].items()
                for r in _rows({f"{name} · {k}": v for k, v in res.items()}, L)]
        paragraphs += [fill(f"Held-out acceptance (`python -m train heldout`, {ho['sequences']} records a set, "
                            f"{ho['anchors_per_seq']} anchors per {ho['seq_len']}-token window; {sets}), for each "
                            "drafter measured:"), _table(rows, L)]
    text = "\n\n".join(paragraphs) + "\n"
    with open(os.path.join(args.ship_dir, "README.md"), "w") as f:
        f.write(text)
    print(f"shipped {args.ship_dir}: {size:.1f} MB")
    return 0


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("run_dir")
    p.add_argument("ship_dir")
    p.add_argument("--command", required=True, help="the command that trained it (recorded verbatim)")
    p.add_argument("--data", default="data/smollm2", help="prepared data directory (its metadata.json is quoted)")
    p.add_argument("--hardware", default="2 CPU cores", help="where it trained, for the card")
    p.add_argument("--heldout", default=None,
                   help="factory only: `train heldout --out` JSON (every drafter in it gets its rows in the card)")
    p.add_argument("--shrink", default=None, help="factory only: `train shrink --report` JSON")
    args = p.parse_args(argv)
    if os.path.isfile(os.path.join(args.run_dir, FACTORY_METRICS)):
        return ship_factory(args)

    from train.plots import plot_heldout, plot_loss_curves

    for f in ("train_config.json", "metrics.jsonl"):
        shutil.copy(os.path.join(args.run_dir, f), os.path.join(args.ship_dir, f))
    recs = [json.loads(ln) for ln in open(os.path.join(args.run_dir, "metrics.jsonl"))]
    cfg = json.load(open(os.path.join(args.ship_dir, "drafter_config.json")))
    plot_loss_curves({cfg["kind"]: recs}, os.path.join(args.ship_dir, "loss.png"))
    size = os.path.getsize(os.path.join(args.ship_dir, "model.safetensors")) / 1e6
    meta = json.load(open(os.path.join(args.data, "metadata.json")))
    train = [r for r in recs if "loss" in r]  # held-out lines ({"step", "heldout", ...}) carry no loss
    last = train[-1]
    tail = train[-10:]
    mean = lambda k: sum(r[k] for r in tail) / len(tail)  # noqa: E731
    acc = [round(sum(r["acceptance"][i] for r in tail) / len(tail), 3) for i in range(len(last["acceptance"]))]
    head = f"`{cfg['head']}`" + (f" (rank {cfg['markov_rank']})" if cfg["head"] != "none" else "")
    held = heldout_section(args.run_dir, recs, plot_heldout, os.path.join(args.ship_dir, "heldout.png"))
    text = f"""# {cfg['kind']} drafter for SmolLM2-135M-Instruct

Trained by this repository's pipeline (`docs/training.md`); loads with
`dspark_jax.load_drafter("smollm2-135m-instruct/{cfg['kind']}", target)`.

- Architecture: {cfg['kind']}, block size L = {cfg['block_size']}, {cfg['num_layers']} layer(s), sequential head
  {head}, confidence head: {cfg['confidence']};
  reads target layers {cfg['target_layers']}; calibration temperatures: {cfg['calibration'] or 'none'}.
- Weights: `model.safetensors`, bfloat16, {size:.1f} MB.
- Data: {sum(meta['examples'].values())} sequences ({meta['examples']}), {meta['tokens_total']} tokens of which
  {meta['response_tokens_total']} regenerated by the target (T={meta['sampling']['temperature']},
  top-p {meta['sampling']['top_p']}).
- Run: {last['step']} steps in {last['elapsed_s'] / 60:.1f} min on {args.hardware} (train_config.json).
- Final training metrics (mean of the last {len(tail)} logged steps): loss {mean('loss'):.3f}, CE {mean('ce'):.3f},
  TV {mean('tv'):.3f}, draft top-1 = ground truth {mean('top1'):.3f}, acceptance estimate 1 − ½‖p_d − p_t‖₁ per
  position {acc}.

Command:

```bash
{args.command}
```

`metrics.jsonl` is the full training log; `loss.png` plots it.
{held}"""
    with open(os.path.join(args.ship_dir, "README.md"), "w") as f:
        f.write(text)
    print(f"shipped {args.ship_dir}: {size:.1f} MB")
    return 0


if __name__ == "__main__":
    sys.exit(main())
