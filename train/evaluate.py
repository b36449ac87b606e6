"""Drafter evaluation and calibration on held-out prompts (`python -m train eval`, `python -m train calibrate`).

eval       — for each drafter and domain (chat: MT-Bench, code: HumanEval, math: held-out GSM-style), real
             speculative decoding with the target at temperature 1 and a fixed block (every draft token
             verified, no scheduler): τ = emitted tokens per round per request, and the position-wise
             conditional acceptance P(token k accepted | tokens 1..k−1 accepted) (paper Fig. 2). Writes
             eval.json, tau.png and acceptance.png.
calibrate  — the same rounds with an uncalibrated view of a DSpark drafter record (confidence logits z [L],
             accepted m) per request-round; sequential temperature scaling (train/calibrate.py) is fitted on
             one half of the prompts and reported on the other; the temperatures are stored in the drafter's
             config (applied at inference as σ(z_k / T_k)). Writes calibration.json and reliability.png.
"""

from __future__ import annotations

import json
import os

import numpy as np

from train import datasets


def run_rounds(target, drafter, prompts: list[str], *, max_new_tokens: int, temperature: float, batch_size: int,
               seed: int, progress=None):
    """Speculative decoding of chat prompts with the full block verified. Returns (stats summed over batches,
    confidence logits [N, L] and accepted counts [N] of every live request-round)."""
    from dspark_jax.decoding import generate
    from dspark_jax.policy import Policy

    L = drafter.config.block_size
    ids = [target.chat_ids(p) for p in prompts]
    attempts, accepts = np.zeros(L, np.int64), np.zeros(L, np.int64)
    emitted = rounds = 0
    zs, ms = [], []

    def on_round(live, lengths, m, conf):
        c = np.clip(conf[live], 1e-7, 1 - 1e-7)
        zs.append(np.log(c) - np.log1p(-c))
        ms.append(m[live])

    for start in range(0, len(ids), batch_size):
        res = generate(target, ids[start : start + batch_size], drafter, policy=Policy(kind="fixed"),
                       max_new_tokens=max_new_tokens, temperature=temperature, seed=seed + start, on_round=on_round)
        s = res.stats
        attempts += np.asarray(s["acceptance_attempts"])
        accepts += np.asarray(s["acceptance_accepts"])
        emitted += s["tau"] * s["row_rounds"]
        rounds += s["row_rounds"]
        if progress is not None:
            progress.update(len(ids[start : start + batch_size]))
    stats = {"tau": emitted / max(rounds, 1), "row_rounds": rounds,
             "conditional_acceptance": (accepts / np.maximum(attempts, 1)).tolist(),
             "acceptance_attempts": attempts.tolist()}
    z = np.concatenate(zs) if zs else np.zeros((0, L))
    m = np.concatenate(ms) if ms else np.zeros((0,), np.int64)
    return stats, z, m


def evaluate(target, drafters: dict, *, prompts_per_domain: int, max_new_tokens: int, temperature: float = 1.0,
             batch_size: int = 8, seed: int = 0) -> dict:
    """τ and conditional acceptance per drafter and domain, plus the macro average τ."""
    from tqdm.auto import tqdm

    prompts = {d: datasets.load_prompts("eval", d, prompts_per_domain, seed=seed) for d in datasets.DOMAINS}
    out = {}
    for name, drafter in drafters.items():
        res = {}
        bar = tqdm(total=sum(map(len, prompts.values())), desc=f"eval {name}", unit="prompt")
        for domain, ps in prompts.items():
            stats, _, _ = run_rounds(target, drafter, ps, max_new_tokens=max_new_tokens, temperature=temperature,
                                     batch_size=batch_size, seed=seed, progress=bar)
            res[domain] = stats
        bar.close()
        out[name] = {"per_domain": res, "macro_tau": float(np.mean([r["tau"] for r in res.values()])),
                     "block_size": drafter.config.block_size, "kind": drafter.config.kind,
                     "num_params": drafter.num_params()}
    return out


def _load(target, spec: str):
    from dspark_jax.drafter import load_drafter

    return load_drafter(spec, target)


def eval_cli(args) -> None:
    from dspark_jax.target import load_target
    from train.plots import plot_conditional_acceptance, plot_tau

    target = load_target(args.target)
    drafters = {}
    for spec in args.drafters:
        name = spec.rstrip("/").split("/")[-1] if not os.path.isdir(spec) else os.path.basename(spec.rstrip("/"))
        drafters[name if name not in drafters else spec] = _load(target, spec)
    result = evaluate(target, drafters, prompts_per_domain=args.prompts, max_new_tokens=args.max_new_tokens,
                      temperature=args.temperature, batch_size=args.batch_size, seed=args.seed)
    os.makedirs(args.out, exist_ok=True)
    names = list(result)
    ratios = {}
    for a in names:
        for b in names:
            if a != b:
                ratios[f"{a}/{b}"] = result[a]["macro_tau"] / result[b]["macro_tau"]
    summary = {"drafters": result, "macro_tau_ratios": ratios, "temperature": args.temperature,
               "prompts_per_domain": args.prompts, "max_new_tokens": args.max_new_tokens}
    with open(os.path.join(args.out, "eval.json"), "w") as f:
        json.dump(summary, f, indent=2)
    plot_tau({n: {d: r["tau"] for d, r in result[n]["per_domain"].items()} for n in names},
             os.path.join(args.out, "tau.png"))
    plot_conditional_acceptance({n: {d: r["conditional_acceptance"] for d, r in result[n]["per_domain"].items()}
                                 for n in names}, os.path.join(args.out, "acceptance.png"))
    for n in names:
        per = ", ".join(f"{d} {r['tau']:.3f}" for d, r in result[n]["per_domain"].items())
        print(f"{n}: macro τ {result[n]['macro_tau']:.3f} ({per})")
    for k, v in ratios.items():
        print(f"τ ratio {k}: {v:.3f}")


def calibrate_cli(args) -> None:
    from tqdm.auto import tqdm

    from dspark_jax.target import load_target
    from train.calibrate import calibration_report, reliability_diagram, sequential_calibration

    target = load_target(args.target)
    drafter = _load(target, args.drafter)
    if not drafter.config.confidence:
        raise ValueError(f"a {drafter.config.kind} drafter has no confidence head to calibrate")
    raw = drafter.with_config(calibration=(), calibration_offsets=())
    if args.rounds:  # rounds saved by an earlier run (its rounds.npz): refit without decoding again
        try:
            with np.load(args.rounds) as f:
                z_fit, m_fit, z_test, m_test = f["z_fit"], f["m_fit"], f["z_test"], f["m_test"]
                prompts = {"fit": int(f["prompts_fit"]), "held_out": int(f["prompts_held_out"])}
        except (OSError, KeyError, ValueError) as e:
            raise ValueError(f"--rounds {args.rounds}: not a rounds.npz written by `train calibrate`: {e}") from None
    else:
        fit_p, test_p = [], []
        for d in datasets.DOMAINS:
            ps = datasets.load_prompts("eval", d, 2 * args.prompts, seed=args.seed + 1)
            fit_p += ps[0::2]
            test_p += ps[1::2]
        prompts = {"fit": len(fit_p), "held_out": len(test_p)}
        bar = tqdm(total=len(fit_p) + len(test_p), desc="calibration rounds", unit="prompt")
        kw = dict(max_new_tokens=args.max_new_tokens, temperature=1.0, batch_size=8, seed=args.seed, progress=bar)
        _, z_fit, m_fit = run_rounds(target, raw, fit_p, **kw)
        _, z_test, m_test = run_rounds(target, raw, test_p, **kw)
        bar.close()
    L = raw.config.block_size
    # Candidates fitted on the fit split: the raw head, the paper's STS, STS with logit offsets (`--offsets`).
    fits = {"raw": ((1.0,) * L, (0.0,) * L), "sts": sequential_calibration(z_fit, m_fit, offsets=False)}
    if args.offsets:
        fits["sts_offsets"] = sequential_calibration(z_fit, m_fit, offsets=True)
    methods = {name: {"fit": calibration_report(z_fit, m_fit, t, offsets=b),
                      "held_out": calibration_report(z_test, m_test, t, offsets=b)} for name, (t, b) in fits.items()}
    # Shipped: the candidate with the smallest held-out mean survival gap (the raw head where no fit beats it).
    chosen = min(methods, key=lambda k: methods[k]["held_out"]["mean_gap_after"])
    temps, offsets = fits[chosen]
    report = {**methods[chosen], "method": chosen, "temperatures": list(temps), "offsets": list(offsets),
              "methods": methods, "prompts": prompts}
    from dspark_jax.drafter import resolve_drafter

    drafter_dir = resolve_drafter(args.drafter)
    out = args.out or drafter_dir
    raw_head = chosen == "raw"
    calibrated = drafter.with_config(calibration=() if raw_head else tuple(float(t) for t in temps),
                                     calibration_offsets=() if raw_head or not any(offsets)
                                     else tuple(float(b) for b in offsets))
    calibrated.save(out, dtype=args.dtype)
    rep_dir = args.report or out
    os.makedirs(rep_dir, exist_ok=True)
    np.savez_compressed(os.path.join(rep_dir, "rounds.npz"), z_fit=z_fit, m_fit=m_fit, z_test=z_test, m_test=m_test,
                        prompts_fit=prompts["fit"], prompts_held_out=prompts["held_out"])
    with open(os.path.join(rep_dir, "calibration.json"), "w") as f:
        json.dump(report, f, indent=2)
    reliability_diagram(z_test, m_test, temps, os.path.join(rep_dir, "reliability.png"), offsets=offsets,
                        title=f"Prefix survival calibration, {chosen} (held out, {len(m_test)} rounds)")
    for name, r in methods.items():
        h = r["held_out"]
        print(f"{name:>12}: held-out mean |predicted − observed| survival {h['mean_gap_before']:.4f} → "
              f"{h['mean_gap_after']:.4f}; pooled ECE {h['ece_pooled_before']:.4f} → {h['ece_pooled_after']:.4f}")
    print(f"shipped: {chosen}; temperatures {[round(t, 3) for t in temps]}, offsets {[round(b, 3) for b in offsets]}")
    print(f"held-out AUC per position (rounds that reached it): "
          f"{[None if a is None else round(a, 3) for a in report['held_out']['auc']]}")
