"""Compiled memory of one packed prefill pass of data generation (train/regenerate.py → runner.prefill_program)
on SmolLM2-135M-Instruct, from XLA:CPU's buffer assignment (the pass is compiled, then run once).

    python reports/2026-12-05/factory-gpu-readiness/prefill_memory.py --rows 16 64 256 --q 128 256

float32 by default: on XLA:CPU a bfloat16 pool is scattered through a float32 copy of the whole pool (a CPU
lowering), which would hide what the program itself reserves. Prints temp (the program's own buffers), args
(weights + page pools) and what one [C, V] float32 logits block would take.
"""

import argparse

import numpy as np

import dspark_jax.runner as R
from dspark_jax.target import load_target
from train.regenerate import SlotDecoder, SlotSettings


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rows", type=int, nargs="+", default=[16, 64, 256])
    p.add_argument("--q", type=int, nargs="+", default=[128, 256])
    p.add_argument("--dtype", default="float32")
    a = p.parse_args()
    real = R.prefill_program

    def spy(*args, **kw):
        m = real.lower(*args, **kw).compile().memory_analysis()
        C = args[4].tokens.shape[0]
        rows = args[4].starts.shape[0]
        print(f"rows {rows:4d}  q {kw['max_q_len']:3d}  C {C:6d}: temp {m.temp_size_in_bytes / 2**30:6.2f} GiB, "
              f"args {m.argument_size_in_bytes / 2**30:5.2f} GiB; [C, V] f32 {C * 49152 * 4 / 2**30:6.2f} GiB",
              flush=True)
        return real(*args, **kw)

    R.prefill_program = spy
    t = load_target("smollm2-135m-instruct", dtype=a.dtype)
    for q in a.q:
        for B in a.rows:
            dec = SlotDecoder(t, SlotSettings(batch=B, capacity=q + 64, max_new_tokens=32, temperature=1.0,
                                              top_p=1.0, prefill_tokens=B * q), 0)
            prompts = [[1 + (i * 7 + j) % 500 for j in range(q - 3)] for i in range(B)]
            dec.runner.prefill_many(prompts, dec.tables[:B], np.zeros((B, 2), np.uint32), np.ones(B, np.float32),
                                    np.zeros(B, np.int32), np.ones(B, np.float32), rows=B, capacity=B * q,
                                    max_q_len=q)


if __name__ == "__main__":
    main()
