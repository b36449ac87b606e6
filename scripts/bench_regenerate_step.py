"""Per-step cost of regeneration decoding, old against new, interleaved so machine load hits both alike.

    python scripts/bench_regenerate_step.py --batch 32 64 --rounds 6

old = `dspark_jax.decoding.decode_step` with SmolLM2's top-p 0.9 (a full sort of V = 49,152 logits per row);
new = train/regenerate.py's slot step (top-64 candidates, exact). Both over a cache of 576 positions (256-token
prompts + 256 new + 1, rounded to 64) filled to 100 positions. Prints the median seconds per step of each.
"""

from __future__ import annotations

import argparse
import json
import time

import numpy as np


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--batch", type=int, nargs="+", default=[32, 64])
    p.add_argument("--rounds", type=int, default=6)
    args = p.parse_args()
    import jax.numpy as jnp

    from dspark_jax import decoding
    from dspark_jax.keys import row_keys
    from dspark_jax.target import load_target
    from train.regenerate import SlotDecoder, SlotSettings

    target = load_target("smollm2-135m-instruct")
    for B in args.batch:
        s = SlotSettings(batch=B, capacity=576, max_new_tokens=256, temperature=0.2, top_p=0.9)
        dec = SlotDecoder(target, s, seed=0)
        cache_new = dec.init_cache()
        cache_new, first = dec.prefill(cache_new, [[1 + i % 50] * 100 for i in range(B)], list(range(B)),
                                       list(range(B)))
        anchor, idx, live = first, np.arange(B), np.ones(B, bool)
        cache_old = target.init_cache(B, 576).with_lengths(jnp.full((B,), 100, jnp.int32))
        temp, tk, tp = decoding.sampling_arrays(B, 0.2, 0, 0.9)
        keys = row_keys(0, B)
        a_old = jnp.asarray(first)
        old, new = [], []
        for r in range(args.rounds + 1):  # round 0 compiles
            t0 = time.perf_counter()
            cache_old, a_old = decoding.decode_step(target.graphdef, target.params, cache_old, a_old, keys, r + 1,
                                                    temp, tk, tp, kernels="reference")
            a_old.block_until_ready()
            t1 = time.perf_counter()
            cache_new, anchor = dec.step(cache_new, anchor, idx, np.full(B, r + 1), live)
            t2 = time.perf_counter()
            if r:
                old.append(t1 - t0)
                new.append(t2 - t1)
        print(json.dumps({"batch": B, "old_step_s": round(float(np.median(old)), 3),
                          "new_step_s": round(float(np.median(new)), 3), "old_all": [round(x, 3) for x in old],
                          "new_all": [round(x, 3) for x in new]}), flush=True)


if __name__ == "__main__":
    main()
