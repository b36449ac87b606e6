"""Benchmark (not a test): the serving engine's step cost on an accelerator, with random weights of a real shape.

Weights do not change a step's cost, so where the real checkpoint cannot be reached (the GPU machine has no
network) this builds a randomly initialised target of a real architecture (SmolLM2-135M's, Qwen3-0.6B's or
Qwen3-8B's config) straight on the device — parameters created under `jax.jit` in the serving dtype, never a
host copy — and a random DSpark drafter for it, and measures, per scheduler, kernel mode and concurrency:

  * start-up: seconds until the engine is ready, the XLA programs compiled meanwhile (backend compiles counted
    by a jax.monitoring listener) and the device's peak memory (`memory_stats()`, where the backend has it);
  * per wave of c requests: engine steps/s, tokens/s, ms per step beside the weight-read floor
    (parameter bytes / HBM bandwidth, --hbm-tbps, default an H200's 4.8 TB/s) and their ratio.

Acceptance of a random drafter is ~0, so speculative rows show what a step costs, not what speculation gains;
τ is printed so that nobody mistakes it. Results are written after every wave (--out), so a run cut short by a
time limit still leaves what it measured.

    python scripts/bench_engine_device.py --arch smollm2 --concurrency 1 4 16 64 --kernels auto reference
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import threading
import time

import numpy as np

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

ARCHS = {
    "tiny": dict(model_type="llama", hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                 num_attention_heads=4, num_key_value_heads=2, vocab_size=1024, max_position_embeddings=2048,
                 tie_word_embeddings=True),  # a smoke test of this script on a CPU
    "tiny-qwen3": dict(model_type="qwen3", hidden_size=64, intermediate_size=128, num_hidden_layers=3,
                       num_attention_heads=4, num_key_value_heads=2, head_dim=32, vocab_size=1024,
                       max_position_embeddings=2048, tie_word_embeddings=False),  # the 8B's structure, tiny
    "smollm2": dict(model_type="llama", hidden_size=576, intermediate_size=1536, num_hidden_layers=30,
                    num_attention_heads=9, num_key_value_heads=3, vocab_size=49152, max_position_embeddings=8192,
                    rope_theta=100000.0, rms_norm_eps=1e-5, tie_word_embeddings=True),
    "qwen3-0.6b": dict(model_type="qwen3", hidden_size=1024, intermediate_size=3072, num_hidden_layers=28,
                       num_attention_heads=16, num_key_value_heads=8, head_dim=128, vocab_size=151936,
                       max_position_embeddings=40960, rope_theta=1000000.0, rms_norm_eps=1e-6,
                       tie_word_embeddings=True),
    "qwen3-8b": dict(model_type="qwen3", hidden_size=4096, intermediate_size=12288, num_hidden_layers=36,
                     num_attention_heads=32, num_key_value_heads=8, head_dim=128, vocab_size=151936,
                     max_position_embeddings=40960, rope_theta=1000000.0, rms_norm_eps=1e-6,
                     tie_word_embeddings=False),
}


def random_target(arch: str, dtype: str):
    """A Target of `arch`'s shape with random parameters made on the default device under jit (an 8B target
    in bf16 never exists on the host); no tokenizer: the engine is driven with token ids."""
    import jax
    import jax.numpy as jnp
    from flax import nnx

    from dspark_jax.config import ModelConfig
    from dspark_jax.model import Decoder
    from dspark_jax.target import Target

    cfg = ModelConfig.from_hf(ARCHS[arch])
    make = lambda: Decoder(cfg, dtype=jnp.dtype(dtype), rngs=nnx.Rngs(0))  # noqa: E731
    graphdef, _ = nnx.split(nnx.eval_shape(make))
    state = jax.jit(lambda: nnx.state(make()))()
    return Target(nnx.merge(graphdef, state), source=f"random {arch}")


class CompileCounter:
    """Counts XLA backend compilations (and their seconds) while active: jax.monitoring's compile event."""

    EVENT = "/jax/core/compile/backend_compile_duration"

    def __init__(self):
        import jax

        self.count, self.seconds, self.active = 0, 0.0, False
        jax.monitoring.register_event_duration_secs_listener(self._on)

    def _on(self, event, duration, **_):
        if self.active and event == self.EVENT:
            self.count += 1
            self.seconds += duration


def memory() -> dict:
    """The default device's memory_stats (bytes in use, peak, limit), {} where the backend keeps none (CPU)."""
    import jax

    stats = jax.devices()[0].memory_stats() or {}
    return {k: stats[k] for k in ("bytes_in_use", "peak_bytes_in_use", "bytes_limit") if k in stats}


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
    p.add_argument("--max-batch", type=int, default=None, help="default: the largest concurrency")
    p.add_argument("--max-model-len", type=int, default=1024)
    p.add_argument("--pipelining", choices=("on", "off", "both"), default="both",
                   help="rounds chained on device (on, the default engine), read back one by one (off), or both")
    p.add_argument("--hbm-tbps", type=float, default=4.8, help="HBM bandwidth for the weight-read floor (H200)")
    p.add_argument("--out", default=None, help="write the results as JSON here (after every wave)")
    args = p.parse_args(argv)
    max_batch = args.max_batch or max(args.concurrency)

    import jax

    from dspark_jax.drafter import init_drafter
    from serve.startup import create_engine

    print(f"devices: {jax.devices()}", flush=True)
    t0 = time.perf_counter()
    target = random_target(args.arch, args.dtype)
    weight_bytes = sum(x.nbytes for x in jax.tree.leaves(target.params))
    floor_ms = weight_bytes / (args.hbm_tbps * 1e12) * 1e3
    report = {"args": vars(args), "device": str(jax.devices()[0]), "weight_bytes": weight_bytes,
              "weight_read_ms": floor_ms, "built_s": time.perf_counter() - t0, "after_build": memory(),
              "results": {}}
    print(f"{args.arch} {args.dtype}: {weight_bytes / 2**30:.2f} GiB of weights (built on device in "
          f"{report['built_s']:.1f}s), weight-read floor {floor_ms:.3f} ms at {args.hbm_tbps} TB/s", flush=True)

    def save():
        if args.out:
            with open(args.out, "w") as f:
                json.dump(report, f, indent=2)

    save()
    drafter = None
    if any(s != "none" for s in args.schedulers):
        drafter = init_drafter(target, "dspark", block_size=7, num_layers=1)
    compiles = CompileCounter()
    for kernels in args.kernels:
        for sched in args.schedulers:
            compiles.count, compiles.seconds, compiles.active = 0, 0.0, True
            t0 = time.perf_counter()
            engine = create_engine(target_obj=target, drafter_obj=None if sched == "none" else drafter,
                                   scheduler=sched, max_batch=max_batch, max_model_len=args.max_model_len,
                                   kernels=kernels, profile=False, progress=False)
            ready = time.perf_counter() - t0
            compiles.active = False
            start = {"startup_s": ready, "programs": compiles.count, "compile_s": compiles.seconds,
                     "memory": memory()}
            print(f"[{sched} kernels={kernels}] ready in {ready:.1f}s: {compiles.count} programs compiled "
                  f"({compiles.seconds:.1f}s of backend compile), memory {start['memory'] or 'n/a'}", flush=True)
            modes = {"on": [True], "off": [False], "both": [True, False]}[args.pipelining]
            for pipelined in modes:
                engine.core.pipelined = pipelined  # between waves, with the engine idle
                key = f"{sched} kernels={kernels} pipelining={'on' if pipelined else 'off'}"
                report["results"][key] = dict(start)
                for c in args.concurrency:
                    r = wave(engine, c, args.max_tokens)
                    r["step_ms"] = 1e3 / r["steps_per_s"] if r["steps_per_s"] else float("inf")
                    r["step_over_weight_read"] = r["step_ms"] / floor_ms
                    r["memory"] = memory()
                    report["results"][key][c] = r
                    save()
                    print(f"[{key}] c={c:3d} {r['tokens_per_s']:8.1f} tok/s  {r['steps_per_s']:7.1f} steps/s  "
                          f"{r['step_ms']:7.3f} ms/step = {r['step_over_weight_read']:6.1f}x weight read  "
                          f"τ {r['tau']:.2f}  verify/pass {r['verify_tokens_per_pass']:.1f}", flush=True)
            engine.stop()
    return 0


if __name__ == "__main__":
    sys.exit(main())
