"""`dspark_jax.generate` at batch 1 against transformers' `model.generate` on the same weights (target only).

    python scripts/bench_generate.py --max-tokens 64 --repeats 3

Each side runs once to warm up (compilation; transformers' first call), then `--repeats` timed runs of the same
greedy request; the median tokens/s of each and their ratio are printed from this one run. Both produce the
same greedy tokens (checked). Counts the decoded tokens after the first (prefill is not decode).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))  # for scripts.bench_target_decode


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--target", default="smollm2-135m-instruct")
    p.add_argument("--prompt", default="Write a short story about a robot who learns to paint.")
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--out", default=None, help="write the result as JSON here")
    return p.parse_args(argv)


def main(argv=None) -> int:
    args = parse_args(argv)
    import torch

    import dspark_jax
    from dspark_jax import hub

    target = dspark_jax.load_target(args.target)
    ids = target.chat_ids(args.prompt)
    n = args.max_tokens

    def ours():
        res = dspark_jax.generate(target, [ids], max_new_tokens=n, ignore_eos=True)
        return res.tokens[0], res.timings["decode_s"]

    from scripts.bench_target_decode import torch_gguf_model

    _, path = hub.resolve_target(args.target)
    hf = torch_gguf_model(path)  # the same GGUF weights, dequantised to f32, in transformers

    def theirs():
        x = torch.tensor([ids])
        with torch.no_grad():
            t0 = time.perf_counter()
            out = hf.generate(x, max_new_tokens=n, min_new_tokens=n, do_sample=False)
            dt = time.perf_counter() - t0
        return out[0, len(ids):].tolist(), dt

    rows = {}
    for name, fn in (("dspark_jax.generate", ours), ("transformers.generate", theirs)):
        tokens, _ = fn()  # warm-up
        times = [fn()[1] for _ in range(args.repeats)]
        rows[name] = {"tokens": tokens, "tok_s": n / statistics.median(times) if name.startswith("transformers")
                      else (n - 1) / statistics.median(times)}
    same = rows["dspark_jax.generate"]["tokens"] == rows["transformers.generate"]["tokens"]
    result = {k: round(v["tok_s"], 2) for k, v in rows.items()}
    result["ratio"] = round(result["dspark_jax.generate"] / result["transformers.generate"], 3)
    result["same_tokens"] = same
    print(json.dumps(result))
    if args.out:
        with open(args.out, "w") as f:
            json.dump(result, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
