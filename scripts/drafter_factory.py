"""Drafters from one short accelerator run: prompts, data, training and held-out c* in `--minutes`, flat files out.

  python scripts/drafter_factory.py split GGUF --out DIR      # the target in byte parts small enough to carry
  python scripts/drafter_factory.py run --target SPEC --out $OUT --minutes 9
  python scripts/drafter_factory.py run --target-parts P0 P1 --parts-json J --out $OUT --minutes 9
  python scripts/drafter_factory.py assemble FACTORY_OUT DEST # flat files → DEST/<kind>/ for load_drafter
  python scripts/drafter_factory.py eval-prompts --out F      # the evaluation prompts, compact, for --eval-prompts

What `run` does is train/factory.py's docstring. A device run carries at most 64 MiB of the working tree, and the
SmolLM2 GGUF is 98 MB and the tracked tree already ~26 MiB: `split` it into three parts (~31 MiB each) plus a
checksum file, bring one part per run while the machine is still held, each run copying its part off the working
tree (e.g. `mkdir -p /tmp/factory && cp factory_in/*.part0 /tmp/factory/`), and in the last `run --target-parts`
joins them (checking the sha256) into a temporary GGUF and loads it. The GPU image lacks the `gguf` package:
carry its wheel in `.whl/` (see scripts/gpu_check.sh); nothing here needs grain or array_record. The evaluation
prompts (`../shared/eval_datasets`, outside the tree) travel as the 0.9 MB file `eval-prompts` writes, given to
`run --eval-prompts`: a run that finds none stops rather than train on queries nobody checked.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from dspark_jax.drafter_config import ANCHOR_MODES  # noqa: E402
from train.factory import FactorySettings, assemble, join_parts, run_factory, split_file  # noqa: E402


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python scripts/drafter_factory.py", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="command", required=True)
    sp = sub.add_parser("split", help="cut a file (the target's GGUF) into byte parts with a checksum file")
    sp.add_argument("file", help="the file to cut, e.g. the SmolLM2 GGUF")
    sp.add_argument("--out", required=True, help="directory for <name>.partK and <name>.parts.json")
    sp.add_argument("--parts", type=int, default=2, help="how many parts (equal sizes)")

    e = sub.add_parser("eval-prompts", help="the evaluation prompts as one compact file for --eval-prompts")
    e.add_argument("--out", required=True, help="file to write (gzipped JSON of the normalised turns)")
    e.add_argument("--source", default=None, help="directory of evaluation sets (default ../shared/eval_datasets)")

    r = sub.add_parser("run", help="prompts → data → training → held-out c* → flat files")
    r.add_argument("--target", default=None, help="target name, HF directory or .gguf file")
    r.add_argument("--target-parts", nargs="+", default=None, help="the target's byte parts, in order")
    r.add_argument("--parts-json", default=None, help="the checksum file `split` wrote (checks the joined file)")
    r.add_argument("--eval-prompts", default=None,
                   help="the evaluation prompts no Magpie query may equal: a directory of sets or the file "
                        "`eval-prompts` wrote (default ../shared/eval_datasets); an empty set stops the run")
    r.add_argument("--no-eval-filter", action="store_true",
                   help="run without any evaluation prompts to filter against (says so loudly)")
    r.add_argument("--dtype", default="auto", help="target dtype: auto (bf16 on GPU/TPU), float32, bfloat16")
    r.add_argument("--out", required=True, help="directory for the flat output files (≤ 8, ≤ 16 MiB each)")
    defaults = FactorySettings()
    r.add_argument("--minutes", type=float, default=defaults.minutes,
                   help="the whole run, loading the target included; phases stop on their share of it")
    r.add_argument("--kernels", default=defaults.kernels, choices=("auto", "pallas", "reference"),
                   help="the slot decoder's attention (default reference: XLA's, safe at thousands of rows)")
    r.add_argument("--kinds", nargs="+", default=list(defaults.kinds), choices=("dspark", "eagle3", "dflash"),
                   help="drafters trained on the same batches")
    r.add_argument("--anchor-mode", default=defaults.anchor_mode, choices=ANCHOR_MODES,
                   help=f"how DSpark's anchor slot reads H_ctx[n-1] (default {defaults.anchor_mode})")
    r.add_argument("--markov-init", default=defaults.markov_init, choices=("zero", "pmi"),
                   help=f"how DSpark's Markov head starts: the training responses' bigram PMI or zero "
                        f"(default {defaults.markov_init})")
    for name, help_ in [
        ("magpie", "Magpie queries the target writes"), ("docstrings", "stdlib docstring prompts"),
        ("responses_per_prompt", "sampled answers per prompt"),
        ("gen_tokens", "stop generating after this many response tokens"), ("gen_batch", "decode slots"),
        ("max_new_tokens", "response cap"), ("seq_len", "training window T"),
        ("batch_sequences", "sequences per training batch"), ("anchors_per_seq", "anchors per sequence"),
        ("train_steps", "the most training steps (the schedule spans what the train phase's time holds at "
                        "the pace of the first steps)"),
        ("dspark_layers", "DSpark layers"), ("dflash_layers", "DFlash layers"),
        ("markov_rank", "DSpark's Markov rank R in training"),
        ("written_markov_rank", "the rank DSpark's Markov head is cut to before evaluation and the files"),
        ("max_query_tokens", "Magpie query cap"), ("max_prompt_tokens", "longer chat-templated prompts left out"),
        ("block_size", "draft block L"), ("seed", "everything seeded"),
    ]:
        r.add_argument("--" + name.replace("_", "-"), type=int, default=getattr(defaults, name),
                       help=f"{help_} (default {getattr(defaults, name)})")
    for name, help_ in [("temperature", "sampling temperature of most responses"),
                        ("greedy_share", "share of responses decoded greedily (T = 0)"),
                        ("heldout_share", "share of sequences held out for c*"), ("lr", "peak learning rate"),
                        ("prompt_share", "share of --minutes for prompts"),
                        ("data_share", "share of --minutes for responses"),
                        ("train_share", "share of --minutes for training")]:
        r.add_argument("--" + name.replace("_", "-"), type=float, default=getattr(defaults, name),
                       help=f"{help_} (default {getattr(defaults, name)})")

    a = sub.add_parser("assemble", help="a factory's flat files → DEST/<kind>/ drafter directories")
    a.add_argument("factory_dir")
    a.add_argument("dest")
    return p.parse_args(argv)


def _split(args) -> None:
    size = os.path.getsize(args.file)
    info = split_file(args.file, args.out, part_bytes=-(-size // args.parts))
    path = os.path.join(args.out, info["name"] + ".parts.json")
    with open(path, "w") as f:
        json.dump(info, f, indent=1)
    print(json.dumps({**info, "checksum_file": path}, indent=1))


def _load_target(args):
    from dspark_jax.target import load_target

    if (args.target is None) == (args.target_parts is None):
        raise SystemExit("give exactly one of --target and --target-parts")
    if args.target is not None:
        return load_target(args.target, args.dtype)
    sha = name = None
    if args.parts_json:
        with open(args.parts_json) as f:
            info = json.load(f)
        sha, name = info["sha256"], info["name"]
    folder = tempfile.mkdtemp(prefix="dspark_factory_")
    path = join_parts(args.target_parts, os.path.join(folder, name or "target.gguf"), sha)
    return load_target(path, args.dtype)


def _banned(args) -> frozenset[str]:
    """The evaluation prompts the run filters against; none found stops the run unless --no-eval-filter."""
    from train import magpie

    source = args.eval_prompts or magpie.EVAL_DIR
    banned = magpie.eval_prompts(source)
    if args.no_eval_filter:
        print(f"WARNING: --no-eval-filter: Magpie queries are not checked against the evaluation prompts "
              f"({len(banned)} found, ignored)", flush=True)
        return frozenset()
    if not banned:
        raise SystemExit(f"no evaluation prompts at {source}: give --eval-prompts "
                         "(a file from `eval-prompts`) or, knowingly, --no-eval-filter")
    return banned


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.command == "split":
        _split(args)
    elif args.command == "eval-prompts":
        from train import magpie

        n = magpie.save_eval_prompts(args.out, args.source or magpie.EVAL_DIR)
        print(f"{n} evaluation prompts → {args.out} ({os.path.getsize(args.out) / 1e6:.2f} MB)")
    elif args.command == "assemble":
        for kind, d in assemble(args.factory_dir, args.dest).items():
            print(f"{kind}: {d}")
    else:
        banned = _banned(args)
        t0 = time.monotonic()
        fields = set(FactorySettings.__dataclass_fields__)
        s = FactorySettings(**{k: (tuple(v) if k == "kinds" else v) for k, v in vars(args).items() if k in fields})
        target = _load_target(args)
        print(f"target loaded in {time.monotonic() - t0:.1f} s", flush=True)
        metrics = run_factory(target, args.out, s, banned=banned, start=t0,  # --minutes counts the load
                              say=lambda line: print(line, flush=True))
        print(json.dumps({k: metrics[k] for k in ("data", "heldout_acceptance", "elapsed_s")}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
