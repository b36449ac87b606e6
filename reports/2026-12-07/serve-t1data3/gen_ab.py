"""Target-only batch-1 `generate` speed of the dspark_jax in a given checkout: `python gen_ab.py <checkout>`.

The same 4 chat prompts × 64 tokens, each compiled once untimed, then three timed passes (tokens/s).
"""

import sys
import time

sys.path.insert(0, sys.argv[1])
import dspark_jax  # noqa: E402

print(dspark_jax.__file__)
target = dspark_jax.load_target("smollm2-135m-instruct")
QUESTIONS = ["What is the capital of France?", "Write a Python function that reverses a string.",
             "Explain why the sky is blue.", "Give three tips for writing clear emails."]
prompts = [target.chat_ids(q) for q in QUESTIONS]
for p in prompts:
    dspark_jax.generate(target, [p], None, max_new_tokens=64, ignore_eos=True)
for _ in range(3):
    t0, n = time.perf_counter(), 0
    for p in prompts:
        n += len(dspark_jax.generate(target, [p], None, max_new_tokens=64, ignore_eos=True).tokens[0])
    print(f"{sys.argv[1]}: {n / (time.perf_counter() - t0):.2f} tok/s", flush=True)
