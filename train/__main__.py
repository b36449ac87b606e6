"""`python -m train {prepare,fit,calibrate,eval}`: the drafter training pipeline, one subcommand per stage.

  prepare    regenerate responses to real training prompts with the target → ArrayRecord shards, then
             precompute the target features the drafters read (also alone: `features`)
  fit        distil a drafter from a YAML config (configs/*.yaml) with --set overrides; resumes from its out_dir
  calibrate  sequential temperature scaling of a DSpark drafter's confidence head on held-out data
  eval       τ per domain and position-wise conditional acceptance (paper Fig. 2) for a set of drafters
  launch     run `fit` as N processes of one multi-process JAX runtime (one global mesh; see train/launch.py)
  heldout    teacher-forced held-out acceptance (c*, top-1) per draft position of saved drafters
  vocab      size a draft vocabulary from the target's T = 1 mass on prepared T = 1 text; report its outside mass
  shrink     a trained DSpark drafter's Markov head moved to a draft vocabulary and cut to a lower rank, to ship
"""

from __future__ import annotations

import argparse
import datetime
import json
import sys


def _prepare(args) -> None:
    from train.prepare import prepare

    per_domain = {"chat": args.chat, "code": args.code, "math": args.math, "chat_turns": args.chat_turns}
    meta = prepare(args.out, target_spec=args.target, per_domain={k: v for k, v in per_domain.items() if v > 0},
                   max_prompt_tokens=args.max_prompt_tokens, max_new_tokens=args.max_new_tokens,
                   batch_size=args.batch_size, temperature=args.temperature, top_p=args.top_p,
                   part_size=args.part_size, seed=args.seed, magpie=args.magpie,
                   magpie_domains=dict(args.magpie_domains) if args.magpie_domains else None,
                   greedy_share=args.greedy_share, exclude=tuple(args.exclude), plan_only=args.plan_only)
    print(json.dumps({k: v for k, v in meta.items() if k not in ("shards", "settings")}, indent=2))
    if args.plan_only:
        print(f"{args.out}: plan saved, no responses generated (--plan-only)")
    elif args.features:
        _features(args)


def _weight(text: str) -> tuple[str, float]:
    """"code=3" → ("code", 3.0), for --magpie-domains."""
    name, _, weight = text.partition("=")
    try:
        return name, float(weight)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not DOMAIN=WEIGHT") from None


def _features(args) -> None:
    from dspark_jax.drafter_config import default_target_layers
    from dspark_jax.target import load_target
    from train.features import featurize

    target = load_target(args.target)
    layers = tuple(args.layers) if args.layers else default_target_layers(target.config.num_layers)
    out = featurize(args.out, target, layers, out_root=args.features_root, batch_size=args.features_batch)
    print(f"features of target layers {list(layers)} → {out}")


def _fit(args) -> None:
    from train.config import load_config, parse_root, resolve, resolve_config_paths
    from train.fit import fit

    roots = dict(parse_root(r) for r in args.path_root or [])
    cfg = load_config(None if args.config is None else resolve(args.config, roots), args.set or [])
    cfg = resolve_config_paths(cfg, roots)
    dist = (args.coordinator, args.num_processes, args.process_id)
    if any(x is not None for x in dist):
        if any(x is None for x in dist):
            raise ValueError("--coordinator, --num-processes and --process-id go together")
        from train.launch import initialize

        initialize(*dist)
    fit(cfg, export=args.export, stop_after=args.stop_after)


def _launch(args) -> int:
    from train.launch import launch

    rest = args.train_args[1:] if args.train_args[:1] == ["--"] else args.train_args
    return launch(rest, num_processes=args.num_processes, process_ids=args.process_ids,
                  coordinator=args.coordinator, cpu_devices=args.cpu_devices)


def _calibrate(args) -> None:
    from train.evaluate import calibrate_cli

    calibrate_cli(args)


def _eval(args) -> None:
    from train.evaluate import eval_cli

    eval_cli(args)


def _heldout(args) -> None:
    import numpy as np
    from flax import nnx

    from dspark_jax.drafter import load_drafter
    from dspark_jax.target import load_target
    from train.heldout import HeldoutSets, make_eval_fn

    sets = {}
    for item in args.sets:
        name, eq, path = item.partition("=")
        if not eq or not name or not path:
            raise ValueError(f"--sets expects NAME=DIR, got {item!r}")
        sets[name] = path
    target = load_target(args.target)
    out = {}
    for spec in args.drafters:
        drafter = load_drafter(spec, target, dtype=np.float32)
        held = HeldoutSets(sets, sequences=args.sequences, seq_len=args.seq_len, anchors_per_seq=args.anchors,
                           batch_sequences=args.batch, block_size=drafter.config.block_size)
        out[spec] = held.evaluate(make_eval_fn(target, drafter), nnx.to_pure_dict(drafter.params))
        for name, r in out[spec].items():
            print(f"{spec} on {name}: c* mean {np.mean(r['c_star']):.4f} (position 1 {r['c_star'][0]:.4f}), "
                  f"top-1 mean {np.mean(r['top1']):.4f}; {r['slots'][0]} anchors", flush=True)
    print(json.dumps(out))
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"sets": sets, "sequences": args.sequences, "seq_len": args.seq_len,
                       "anchors_per_seq": args.anchors, "drafters": out}, f, indent=1)


def _vocab(args) -> None:
    import numpy as np

    from dspark_jax.target import load_target
    from train.vocab import _write_json, outside_mass, read_records, read_vocab_file, select_by_mass, target_mass

    target = load_target(args.target)
    records = read_records(args.text)
    if len(records) < 2:
        raise ValueError(f"--text {args.text}: {len(records)} record(s); need some to rank on and some to measure on")
    halves = {"fit": records[0::2], "held_out": records[1::2]}  # rank on one half, measure on the other
    mass = {name: target_mass(target, recs, batch=args.batch) for name, recs in halves.items()}
    (fit_mass, _), (held_mass, held_pos) = mass["fit"], mass["held_out"]
    ids, outside = select_by_mass(fit_mass, held_mass, held_pos, max_outside=args.max_outside,
                                  multiple=args.multiple, always=target.eos_token_ids)
    report = {"text": args.text, "records": {k: len(v) for k, v in halves.items()},
              "positions": {k: m[1] for k, m in mass.items()}, "max_outside": args.max_outside,
              "chosen": {"size": len(ids), "outside_mass_held_out": round(outside, 5)}, "compared": {},
              "curve": {}}
    for path in args.compare:
        other = read_vocab_file(path)
        report["compared"][path] = {"size": len(other),
                                    "outside_mass_held_out": round(outside_mass(other, held_mass, held_pos), 5)}
    order = np.lexsort((np.arange(len(fit_mass)), -fit_mass))
    for n in (1024, 2048, 4096, 8192, 12288, 16384, 24576, 32768):  # outside mass against size, ranked by mass
        if n <= len(order):
            report["curve"][n] = round(outside_mass(order[:n], held_mass, held_pos), 5)
    print(json.dumps(report, indent=1))
    if args.out:
        _write_json(args.out, {"size": len(ids), "outside_mass": round(outside, 6), "data": args.text,
                               "ids": list(ids)})
    if args.report:
        _write_json(args.report, report)


def _shrink(args) -> None:
    import os

    from dspark_jax.target import load_target
    from train.fit import save_drafter
    from train.shrink import bytes_on_disk, shrink
    from train.vocab import read_vocab_file

    target = load_target(args.target)
    counts = None
    if args.counts_from:
        from train.vocab import response_token_counts

        counts = response_token_counts(args.counts_from, target.config.vocab_size)
    vocab = read_vocab_file(args.draft_vocab) if args.draft_vocab else None
    drafter, report = shrink(args.source, target, draft_vocab=vocab, markov_rank=args.markov_rank, counts=counts)
    save_drafter(drafter, args.dest, dtype=args.dtype)
    report.update(dest=args.dest, bytes=bytes_on_disk(args.dest), dtype=args.dtype)
    if vocab is not None:
        report["draft_vocab"]["file"] = os.path.abspath(args.draft_vocab)
    print(json.dumps(report, indent=1))
    if args.report:
        with open(args.report, "w") as f:
            json.dump(report, f, indent=1)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m train", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="command", required=True)

    pr = sub.add_parser("prepare", help="regenerate training responses with the target (resumable: rerun the "
                        "same command to continue)")
    pr.add_argument("--out", default="data/smollm2", help="output directory for shards and metadata.json")
    pr.add_argument("--target", default="smollm2-135m-instruct", help="target name, HF directory or .gguf file")
    pr.add_argument("--chat", type=int, default=480, help="ShareGPT training prompts")
    pr.add_argument("--code", type=int, default=240, help="code training prompts")
    pr.add_argument("--math", type=int, default=240, help="GSM-style math training prompts")
    pr.add_argument("--chat-turns", type=int, default=0, help="ShareGPT later-turn training prompts")
    pr.add_argument("--magpie", type=int, default=0,
                    help="queries the target writes itself from its chat template's pre-query prefix (Magpie)")
    pr.add_argument("--magpie-domains", nargs="+", type=_weight, default=None, metavar="DOMAIN=WEIGHT",
                    help="weights over the Magpie seed domains (chat, code, math, reasoning, "
                    "writing), e.g. code=3 chat=1; default equal")
    pr.add_argument("--greedy-share", type=float, default=0.0,
                    help="share of prompts answered greedily (T = 0) instead of at --temperature")
    pr.add_argument("--exclude", nargs="*", default=[], metavar="DIR",
                    help="prepared directories (e.g. held-out sets) whose prompts this plan must not hold")
    pr.add_argument("--plan-only", action="store_true",
                    help="save the plan (prompts, and Magpie queries if asked) and stop: no responses, no features; "
                    "another plan can --exclude the directory, and the same command without it fills it")
    pr.add_argument("--max-prompt-tokens", type=int, default=256, help="skip longer chat-templated prompts")
    pr.add_argument("--max-new-tokens", type=int, default=256, help="response length cap")
    pr.add_argument("--batch-size", type=int, default=64, help="decode slots (prompts decoded together)")
    pr.add_argument("--temperature", type=float, default=0.2, help="SmolLM2's recommended sampling: 0.2")
    pr.add_argument("--top-p", type=float, default=0.9, help="SmolLM2's recommended sampling: 0.9")
    pr.add_argument("--part-size", type=int, default=128,
                    help="prompts per shard: the unit written as soon as it is done, and of resumption")
    pr.add_argument("--seed", type=int, default=0, help="prompt selection and sampling seed")
    pr.add_argument("--no-features", dest="features", action="store_false",
                    help="skip precomputing the target features (then training runs the target each step)")
    pr.add_argument("--layers", type=int, nargs="*", default=None,
                    help="target layers to store features of (default: the drafters' low/mid/high layers)")
    pr.add_argument("--features-root", default=None,
                    help="directory for features-<layers>/ (default: --out); features are large, tokens small")
    pr.add_argument("--features-batch", type=int, default=4, help="sequences per target forward")
    pr.set_defaults(func=_prepare)

    fe = sub.add_parser("features", help="precompute target features for prepared data (incremental: skips "
                        "shards already done)")
    fe.add_argument("--out", default="data/smollm2", help="the prepared data directory")
    fe.add_argument("--target", default="smollm2-135m-instruct", help="target name, HF directory or .gguf file")
    fe.add_argument("--layers", type=int, nargs="*", default=None,
                    help="target layers (default: the drafters' low/mid/high layers)")
    fe.add_argument("--features-root", default=None,
                    help="directory for features-<layers>/ (default: --out); features are large, tokens small")
    fe.add_argument("--features-batch", type=int, default=4, help="sequences per target forward")
    fe.set_defaults(func=_features)

    f = sub.add_parser("fit", help="distil a drafter (resumes from the run directory)")
    f.add_argument("--config", default=None, help="YAML config (configs/*.yaml); defaults otherwise")
    f.add_argument("--set", action="append", metavar="KEY=VALUE", help="dotted override, e.g. optim.steps=10")
    f.add_argument("--path-root", action="append", metavar="PREFIX=ROOT",
                   help="read and write paths starting with PREFIX under ROOT instead, e.g. "
                        "gs://bucket=file:///mnt/bucket (the config file's own path too; repeatable; "
                        "added to run.path_roots)")
    f.add_argument("--export", default=None, help="also save the final drafter (bf16) to this directory")
    f.add_argument("--stop-after", type=int, default=None, metavar="STEP",
                   help="stop after this step without a final checkpoint, as a preempted run would (tests)")
    f.add_argument("--coordinator", default=None, metavar="HOST:PORT",
                   help="multi-process run: process 0's address (with --num-processes, --process-id; "
                        "`python -m train launch` sets all three)")
    f.add_argument("--num-processes", type=int, default=None, help="multi-process run: number of processes")
    f.add_argument("--process-id", type=int, default=None, help="multi-process run: this process's index")
    f.set_defaults(func=_fit)

    la = sub.add_parser("launch", help="run fit as N processes of one JAX runtime (train/launch.py)",
                        description="Starts processes of an N-process `fit` on this machine: "
                                    "python -m train launch --num-processes 2 --cpu-devices 4 -- fit --config ...")
    la.add_argument("--num-processes", type=int, required=True, help="processes in the whole run (all hosts)")
    la.add_argument("--process-ids", type=int, nargs="+", default=None,
                    help="the processes to start on this machine (default: all; a pod host passes its index)")
    la.add_argument("--coordinator", default=None, metavar="HOST:PORT",
                    help="process 0's address, reachable from every host (default: a free local port)")
    la.add_argument("--cpu-devices", type=int, default=None,
                    help="run on the CPU with this many simulated devices per process")
    la.add_argument("train_args", nargs=argparse.REMAINDER, help="-- fit [fit arguments]")
    la.set_defaults(func=_launch)

    c = sub.add_parser("calibrate", help="sequential temperature scaling of the confidence head")
    c.add_argument("--drafter", required=True, help="drafter directory or name; calibrated in place unless --out")
    c.add_argument("--out", default=None, help="write the calibrated drafter here instead")
    c.add_argument("--target", default="smollm2-135m-instruct")
    c.add_argument("--prompts", type=int, default=24, help="held-out prompts per domain (half fit, half test)")
    c.add_argument("--max-new-tokens", type=int, default=128)
    c.add_argument("--report", default=None, help="directory for calibration.json and reliability.png")
    c.add_argument("--seed", type=int, default=0)
    c.add_argument("--offsets", action=argparse.BooleanOptionalAction, default=True,
                   help="also fit a logit offset per position beside its temperature (c = σ(z/T + b)); the "
                        "candidate (raw, STS, STS with offsets) with the smallest held-out survival gap is shipped "
                        "(default: on)")
    c.add_argument("--rounds", default=None, metavar="NPZ",
                   help="refit on the rounds.npz an earlier run wrote to its report directory instead of decoding")
    c.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float32"),
                   help="dtype to store the calibrated drafter's parameters in (default: %(default)s, as shipped)")
    c.set_defaults(func=_calibrate)

    e = sub.add_parser("eval", help="τ per domain and conditional acceptance at T=1, fixed block")
    e.add_argument("--drafters", nargs="+", required=True, help="drafter directories or names")
    e.add_argument("--target", default="smollm2-135m-instruct")
    e.add_argument("--prompts", type=int, default=16, help="held-out prompts per domain")
    e.add_argument("--max-new-tokens", type=int, default=128)
    e.add_argument("--temperature", type=float, default=1.0)
    e.add_argument("--batch-size", type=int, default=8)
    e.add_argument("--out", default=f"reports/{datetime.date.today()}/eval",
                   help="directory for eval.json and the PNG curves (default: reports/<today>/eval)")
    e.add_argument("--seed", type=int, default=0)
    e.set_defaults(func=_eval)

    h = sub.add_parser("heldout", help="held-out c* and top-1 per draft position (train/heldout.py)",
                       description="The measure `fit` logs with heldout.every, for saved drafters: teacher-forced "
                       "c*_k (the T = 1 acceptance) and top-1 agreement (the T = 0 acceptance on greedy text) on the "
                       "first --sequences records of each set, fixed windows and anchors.")
    h.add_argument("--drafters", nargs="+", required=True, help="drafter directories or shipped names")
    h.add_argument("--sets", nargs="+", required=True, metavar="NAME=DIR", help="prepared shards never trained on")
    h.add_argument("--target", default="smollm2-135m-instruct", help="target name, HF directory or .gguf file")
    h.add_argument("--sequences", type=int, default=64, help="records per set")
    h.add_argument("--anchors", type=int, default=16, help="anchors per record window")
    h.add_argument("--seq-len", type=int, default=256, help="window length")
    h.add_argument("--batch", type=int, default=4, help="windows per forward")
    h.add_argument("--out", default=None, help="write the results here (JSON)")
    h.set_defaults(func=_heldout)

    v = sub.add_parser("vocab", help="size a draft vocabulary by the target's T = 1 mass (train/vocab.py)",
                       description="Ranks tokens by the target's T = 1 probability mass summed over the response "
                       "positions of half the records of --text, and picks the smallest size (a multiple of "
                       "--multiple) whose outside mass on the other half is at most --max-outside.")
    v.add_argument("--text", required=True, help="prepared shards of T = 1 text (`prepare --temperature 1`)")
    v.add_argument("--target", default="smollm2-135m-instruct", help="target name, HF directory or .gguf file")
    v.add_argument("--max-outside", type=float, default=0.02, help="bound on the held-out outside mass")
    v.add_argument("--multiple", type=int, default=256, help="the size is a multiple of this")
    v.add_argument("--compare", action="append", default=[], metavar="JSON",
                   help="a draft-vocabulary file ({\"ids\": [...]}) whose outside mass to report too (repeatable)")
    v.add_argument("--batch", type=int, default=4, help="sequences per target forward")
    v.add_argument("--out", default=None, help="write the chosen vocabulary here (draft_vocab.json format)")
    v.add_argument("--report", default=None, help="write the numbers here (JSON)")
    v.set_defaults(func=_vocab)

    sh = sub.add_parser("shrink", help="a DSpark drafter made smaller to ship (train/shrink.py)",
                        description="Moves a trained DSpark drafter's Markov head to a draft vocabulary (kept tokens "
                        "exactly) and cuts it to a lower rank (the truncated SVD of W1·W2; the confidence head's "
                        "weights on W1[x] refitted), every other parameter unchanged; writes DEST in --dtype. "
                        "Recalibrate the result (`calibrate`) and measure it (`heldout`) before shipping it.")
    sh.add_argument("source", help="drafter directory or shipped name")
    sh.add_argument("dest", help="directory to write (drafter_config.json + model.safetensors)")
    sh.add_argument("--target", default="smollm2-135m-instruct", help="target name, HF directory or .gguf file")
    sh.add_argument("--draft-vocab", default=None, metavar="JSON",
                    help="a draft-vocabulary file ({\"ids\": [...]}, what `vocab --out` writes); default: keep it")
    sh.add_argument("--markov-rank", type=int, default=None, help="the new Markov rank R (default: keep it)")
    sh.add_argument("--counts-from", default=None, metavar="DIR",
                    help="prepared shards whose response-token counts weight the truncation's rows (default: equal)")
    sh.add_argument("--dtype", default="bfloat16", help="dtype of the written weights (default bfloat16)")
    sh.add_argument("--report", default=None, help="also write the report printed here (JSON; the card reads it)")
    sh.set_defaults(func=_shrink)
    return p


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    try:
        code = args.func(args)
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    return code or 0


if __name__ == "__main__":
    sys.exit(main())
