"""Reproduce the DSpark paper's Table 1: τ (emitted tokens per round) per evaluation set, beside the paper's value.

    python scripts/reproduce_table1.py --target ~/models/Qwen3-8B --drafter deepseek-ai/dspark_qwen3_8b_block7
    python scripts/reproduce_table1.py --target DIR --drafter DIR --sets gsm8k humaneval --limit 20

Protocol (DeepSpec's eval.py, which produced Table 1; the prompts are /work/shared/eval_datasets, see its
README): the first user turn of each row, chat template with thinking off (`enable_thinking=False`); per set
DeepSpec's prompt count (a seeded shuffle when a set is larger); batch 1; chain drafting with the drafter's
block γ (7 for the released drafters) verified in full — no scheduler; up to 2048 new tokens, stopping at the
target's EOS tokens (config.json, generation_config.json and the tokenizer's); τ = all emitted tokens / all
rounds of the set (accepted + the bonus or recovered token). Table 1 is T = 1; T = 0 is printed beside it.
The macro average is over the sets run. Alpaca, Table 1's ninth set, is not in the prompt files.

On CPU with a tiny model (`--limit 1 --max-new-tokens 16`) it runs end to end in seconds; the paper's numbers
need the released weights and an accelerator (hours for all sets). These prompts are for evaluation only.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import random
import sys
import time

DATA_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "shared", "eval_datasets")
# DeepSpec eval.py TASKS: (set, prompts), in Table 1's column order.
TASKS = {"gsm8k": 500, "math500": 500, "aime25": 30, "mbpp": 256, "humaneval": 164, "livecodebench": 500,
         "mt-bench": 80, "alpaca": 500, "arena-hard-v2": 500}
DEEPSPEC_SEED = 980406  # eval.py's default --seed: the shuffle that picks a set's prompts
# Table 1 (τ at T = 1), per (target, drafter kind), in TASKS order.
PAPER = {
    ("Qwen3-4B", "eagle3"): (5.14, 4.62, 3.92, 3.69, 4.16, 3.77, 2.39, 2.26, 2.55),
    ("Qwen3-4B", "dflash"): (5.40, 4.85, 4.15, 4.40, 4.74, 4.18, 3.07, 2.96, 2.83),
    ("Qwen3-4B", "dspark"): (6.11, 5.70, 4.89, 5.13, 5.38, 4.86, 3.64, 3.54, 3.29),
    ("Qwen3-8B", "eagle3"): (5.30, 4.77, 3.91, 3.96, 4.33, 4.17, 2.66, 2.54, 2.54),
    ("Qwen3-8B", "dflash"): (5.33, 4.91, 4.07, 4.36, 4.64, 4.39, 3.11, 2.98, 2.81),
    ("Qwen3-8B", "dspark"): (6.17, 5.78, 5.01, 5.16, 5.52, 5.17, 3.72, 3.58, 3.21),
    ("Qwen3-14B", "eagle3"): (5.24, 4.60, 3.71, 3.81, 4.14, 4.01, 2.62, 2.47, 2.48),
    ("Qwen3-14B", "dflash"): (5.41, 4.84, 3.98, 4.44, 4.59, 4.33, 3.10, 2.94, 2.72),
    ("Qwen3-14B", "dspark"): (6.21, 5.74, 4.94, 5.26, 5.43, 5.02, 3.70, 3.58, 3.13),
    ("Gemma4-12B", "eagle3"): (5.87, 5.46, 4.83, 4.72, 5.37, 4.16, 3.19, 3.06, 2.72),
    ("Gemma4-12B", "dflash"): (5.45, 5.04, 4.22, 4.39, 4.95, 3.70, 2.98, 2.84, 2.59),
    ("Gemma4-12B", "dspark"): (6.05, 5.78, 5.12, 5.11, 5.64, 4.51, 3.49, 3.35, 2.92),
}
# Target recognised by (model_type, hidden size, layers, vocabulary) for the default --paper-row.
TARGETS = {("qwen3", 2560, 36, 151936): "Qwen3-4B", ("qwen3", 4096, 36, 151936): "Qwen3-8B",
           ("qwen3", 5120, 40, 151936): "Qwen3-14B"}


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python scripts/reproduce_table1.py", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--target", required=True,
                   help="target model: a Hugging Face directory (e.g. Qwen3-8B), a .gguf file or a known name")
    p.add_argument("--drafter", required=True,
                   help="drafter: a DeepSpec checkpoint directory or hub id in the local HF cache, or one of ours")
    p.add_argument("--sets", nargs="+", default=None, metavar="SET",
                   help=f"evaluation sets (default: every file present of {', '.join(TASKS)})")
    p.add_argument("--data-dir", default=DATA_DIR, help="directory of <set>.jsonl prompt files (default: %(default)s)")
    p.add_argument("--limit", type=int, default=None,
                   help="at most N prompts per set, taken from DeepSpec's selection (default: DeepSpec's counts)")
    p.add_argument("--temperatures", type=float, nargs="+", default=[1.0, 0.0],
                   help="sampling temperatures to run; Table 1 is T=1 (default: %(default)s)")
    p.add_argument("--max-new-tokens", type=int, default=2048, help="per prompt (default: DeepSpec's %(default)s)")
    p.add_argument("--seed", type=int, default=DEEPSPEC_SEED,
                   help="prompt-selection seed; prompt i is sampled with seed + i (default: %(default)s)")
    p.add_argument("--dtype", choices=("float32", "bfloat16"), default="bfloat16",
                   help="target and drafter dtype (default: %(default)s; use float32 on CPU)")
    p.add_argument("--paper-row", default=None, metavar="TARGET/KIND",
                   help="Table 1 row to compare with, e.g. Qwen3-8B/dspark (default: recognised from the target's "
                        "shape and the drafter's kind)")
    p.add_argument("--json", default=None, metavar="PATH", help="also write the results to this JSON file")
    args = p.parse_args(argv)
    if args.limit is not None and args.limit < 1:
        p.error(f"--limit must be >= 1, got {args.limit}")
    if args.max_new_tokens < 1:
        p.error(f"--max-new-tokens must be >= 1, got {args.max_new_tokens}")
    unknown = sorted(set(args.sets or ()) - set(TASKS))
    if unknown:
        p.error(f"unknown sets {unknown}; choose from {', '.join(TASKS)}")
    return args


def select_prompts(path: str, count: int, seed: int) -> list[str]:
    """DeepSpec's selection: first turns; when the set is larger than `count`, a seeded shuffle, then the first."""
    with open(path, encoding="utf-8") as f:
        rows = [json.loads(line) for line in f if line.strip()]
    if len(rows) > count:
        random.Random(seed).shuffle(rows)
        rows = rows[:count]
    return [row["turns"][0] for row in rows]


def chat_ids(tokenizer, text: str) -> list[int]:
    """The chat template with thinking off (DeepSpec's encode_chat_messages), then ids without extra specials."""
    rendered = tokenizer.apply_chat_template([{"role": "user", "content": text}], tokenize=False,
                                             add_generation_prompt=True, enable_thinking=False)
    return list(tokenizer(rendered, add_special_tokens=False)["input_ids"])


def stop_ids(target) -> tuple[int, ...]:
    """The target's EOS ids plus generation_config.json's (DeepSpec stops at the latter, e.g. Qwen3's two)."""
    ids = set(target.eos_token_ids)
    gen = os.path.join(target.source, "generation_config.json") if os.path.isdir(target.source) else ""
    if gen and os.path.isfile(gen):
        with open(gen) as f:
            eos = json.load(f).get("eos_token_id")
        ids |= set(eos if isinstance(eos, list) else [] if eos is None else [eos])
    return tuple(sorted(int(i) for i in ids))


def paper_row(args, target, drafter) -> tuple[str, tuple[float, ...] | None]:
    if args.paper_row:
        name, _, kind = args.paper_row.partition("/")
    else:
        c = target.config
        name, kind = TARGETS.get((c.model_type, c.hidden_size, c.num_layers, c.vocab_size), "?"), drafter.config.kind
    return f"{name}/{kind}", PAPER.get((name, kind))


def run_set(target, drafter, prompts: list[list[int]], temperature: float, max_new_tokens: int, seed: int) -> dict:
    """Batch-1 speculative decoding of each prompt; τ over all rounds of the set."""
    import dspark_jax

    emitted = rounds = tokens = 0
    for i, ids in enumerate(prompts):
        res = dspark_jax.generate(target, [ids], drafter, max_new_tokens=max_new_tokens, temperature=temperature,
                                  seed=seed + i, policy="fixed")
        rounds += res.stats["row_rounds"]
        emitted += round(res.stats["tau"] * res.stats["row_rounds"])
        tokens += len(res.tokens[0])
    return {"prompts": len(prompts), "rounds": rounds, "emitted": emitted, "new_tokens": tokens,
            "tau": emitted / max(rounds, 1)}


def main(argv=None) -> int:
    args = parse_args(argv)
    sets = args.sets or [s for s in TASKS if os.path.isfile(os.path.join(args.data_dir, f"{s}.jsonl"))]
    missing = [s for s in sets if not os.path.isfile(os.path.join(args.data_dir, f"{s}.jsonl"))]
    if not sets or missing:
        print(f"error: no prompt file for {missing or 'any set'} in {args.data_dir}", file=sys.stderr)
        return 2
    import dspark_jax

    try:
        target = dspark_jax.load_target(args.target, dtype=args.dtype)
        drafter = dspark_jax.load_drafter(args.drafter, target)
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    if target.tokenizer is None:
        print("error: the target has no tokenizer (the chat template is part of the protocol)", file=sys.stderr)
        return 2
    # DeepSpec stops at generation_config's EOS ids; the config's eos list is what generate() stops at.
    target.config = dataclasses.replace(target.config, eos_token_ids=stop_ids(target))
    row, paper = paper_row(args, target, drafter)
    L = drafter.config.block_size
    print(f"target {args.target} | drafter {args.drafter} ({drafter.config.kind}, γ = {L}"
          f"{'' if L == 7 else ', Table 1 used 7'}) | paper row {row}" + ("" if paper else " (not in Table 1)"))
    results = {}
    for s in sets:
        texts = select_prompts(os.path.join(args.data_dir, f"{s}.jsonl"), TASKS[s], args.seed)[: args.limit]
        prompts = [chat_ids(target.tokenizer, t) for t in texts]
        results[s] = {}
        for T in args.temperatures:
            t0 = time.perf_counter()
            results[s][T] = run_set(target, drafter, prompts, T, args.max_new_tokens, args.seed)
            results[s][T]["seconds"] = time.perf_counter() - t0
            print(f"  {s:<14} T={T:g}: τ = {results[s][T]['tau']:.2f} over {results[s][T]['rounds']} rounds, "
                  f"{len(prompts)} prompts ({results[s][T]['seconds']:.0f} s)", flush=True)
    paper_of = dict(zip(TASKS, paper, strict=True)) if paper else {}
    cols = [f"τ T={T:g}" for T in args.temperatures]
    print(f"\n{'set':<14} {'prompts':>7}  " + "  ".join(f"{c:>9}" for c in cols) + f"  {'Table 1':>9}")
    for s in sets:
        vals = "  ".join(f"{results[s][T]['tau']:>9.2f}" for T in args.temperatures)
        print(f"{s:<14} {results[s][args.temperatures[0]]['prompts']:>7}  {vals}  "
              f"{paper_of[s] if s in paper_of else '—':>9}")
    macro = {T: sum(results[s][T]["tau"] for s in sets) / len(sets) for T in args.temperatures}
    paper_macro = sum(paper_of[s] for s in sets) / len(sets) if paper_of else None
    print(f"{'macro':<14} {'':>7}  " + "  ".join(f"{macro[T]:>9.2f}" for T in args.temperatures)
          + f"  {'—' if paper_macro is None else f'{paper_macro:.2f}':>9}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"target": args.target, "drafter": args.drafter, "kind": drafter.config.kind, "gamma": L,
                       "paper_row": row, "limit": args.limit, "max_new_tokens": args.max_new_tokens,
                       "sets": {s: {f"{T:g}": r for T, r in results[s].items()} for s in sets},
                       "macro": {f"{T:g}": v for T, v in macro.items()},
                       "paper": {s: paper_of[s] for s in sets if s in paper_of} or None}, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
