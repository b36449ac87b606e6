"""Benchmark (not a test): the serving engine's step cost on an accelerator, with random weights of a real shape.

Weights do not change a step's cost, so where the real checkpoint cannot be reached (the GPU machine has no
network) this builds a randomly initialised target of a real architecture (SmolLM2-135M's or Qwen3-0.6B's
config) through transformers, a random DSpark drafter for it, and measures, per scheduler, kernel mode and
concurrency: engine steps/s, tokens/s and verified tokens per pass. Acceptance of a random drafter is ~0, so
speculative rows show what a step costs, not what speculation gains; τ is printed so that nobody mistakes it.

    python scripts/bench_engine_device.py --arch smollm2 --concurrency 1 4 16 --kernels auto reference
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import threading
import time

import numpy as np

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

ARCHS = {
    "tiny": dict(model_type="llama", hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                 num_attention_heads=4, num_key_value_heads=2, vocab_size=1024, max_position_embeddings=2048,
                 tie_word_embeddings=True),  # a smoke test of this script on a CPU
    "smollm2": dict(model_type="llama", hidden_size=576, intermediate_size=1536, num_hidden_layers=30,
                    num_attention_heads=9, num_key_value_heads=3, vocab_size=49152, max_position_embeddings=8192,
                    rope_theta=100000.0, rms_norm_eps=1e-5, tie_word_embeddings=True),
    "qwen3-0.6b": dict(model_type="qwen3", hidden_size=1024, intermediate_size=3072, num_hidden_layers=28,
                       num_attention_heads=16, num_key_value_heads=8, head_dim=128, vocab_size=151936,
                       max_position_embeddings=40960, rope_theta=1000000.0, rms_norm_eps=1e-6,
                       tie_word_embeddings=True),
}


def random_target(arch: str, dtype: str):
    import jax.numpy as jnp
    import torch
    import transformers

    from dspark_jax.config import ModelConfig
    from dspark_jax.target import Target
    from dspark_jax.weights import build_decoder, read_hf_dir

    cfg = transformers.AutoConfig.for_model(**ARCHS[arch])
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(cfg)
    folder = tempfile.mkdtemp(prefix=f"random-{arch}-")
    model.save_pretrained(folder, safe_serialization=True)
    config, tensors = read_hf_dir(folder)  # no tokenizer: the engine is driven with token ids
    return Target(build_decoder(ModelConfig.from_hf(config), tensors, jnp.dtype(dtype)), source=folder)


def wave(engine, c: int, max_tokens: int) -> dict:
    from serve.types import EngineRequest, SamplingParams

    done, lock, left, counts = threading.Event(), threading.Lock(), [c], {}

    def on_output(o):
        with lock:
            counts[o.request_id] = counts.get(o.request_id, 0) + len(o.token_ids)
            if o.finish_reason is not None:
                left[0] -= 1
                if left[0] == 0:
                    done.set()

    rng = np.random.default_rng(c)
    before = engine.metrics()
    t0 = time.perf_counter()
    for i in range(c):
        prompt = [int(x) for x in rng.integers(10, 1000, size=64 + 16 * (i % 8))]
        engine.add_request(EngineRequest(request_id=f"{c}-{i}-{time.monotonic_ns()}", prompt_ids=prompt,
                                         on_output=on_output, params=SamplingParams(max_tokens=max_tokens,
                                                                                    temperature=0.0,
                                                                                    ignore_eos=True)))
    done.wait()
    wall = time.perf_counter() - t0
    after = engine.metrics()
    steps = after["steps_total"] - before["steps_total"]
    return {"tokens_per_s": sum(counts.values()) / wall, "steps_per_s": steps / wall, "steps": steps,
            "tau": after["tokens_per_step"], "verify_tokens_per_pass": after["verify_tokens_per_pass"]}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--arch", choices=sorted(ARCHS), default="smollm2")
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--schedulers", nargs="+", default=["none", "fixed:3"])
    p.add_argument("--kernels", nargs="+", default=["auto", "reference"])
    p.add_argument("--concurrency", type=int, nargs="+", default=[1, 4, 16])
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--max-batch", type=int, default=16)
    p.add_argument("--pipelining", choices=("on", "off", "both"), default="both",
                   help="rounds chained on device (on, the default engine), read back one by one (off), or both")
    p.add_argument("--out", default=None, help="write the results as JSON here")
    args = p.parse_args(argv)

    import jax

    from dspark_jax.drafter import init_drafter
    from serve.engine import create_engine

    print(f"devices: {jax.devices()}", flush=True)
    target = random_target(args.arch, args.dtype)
    drafter = init_drafter(target, "dspark", block_size=7, num_layers=1)
    results = {}
    for kernels in args.kernels:
        for sched in args.schedulers:
            t0 = time.perf_counter()
            engine = create_engine(target_obj=target, drafter_obj=None if sched == "none" else drafter,
                                   scheduler=sched, max_batch=args.max_batch, max_model_len=1024,
                                   kernels=kernels, profile=False, progress=False)
            ready = time.perf_counter() - t0
            modes = {"on": [True], "off": [False], "both": [True, False]}[args.pipelining]
            for pipelined in modes:
                engine.core.pipelined = pipelined  # between waves, with the engine idle
                key = f"{sched} kernels={kernels} pipelining={'on' if pipelined else 'off'}"
                results[key] = {"startup_s": ready}
                for c in args.concurrency:
                    r = wave(engine, c, args.max_tokens)
                    results[key][c] = r
                    print(f"[{key}] c={c:3d} {r['tokens_per_s']:8.1f} tok/s  {r['steps_per_s']:7.1f} steps/s  "
                          f"τ {r['tau']:.2f}  verify/pass {r['verify_tokens_per_pass']:.1f}  "
                          f"(startup {ready:.0f}s)", flush=True)
            engine.stop()
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"args": vars(args), "device": str(jax.devices()[0]), "results": results}, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
