"""Benchmark: target-only greedy decode tokens/s, ours (JAX) beside transformers (torch) on the same weights.

    python scripts/bench_target_decode.py [--batch 1 8] [--new-tokens 64] [--prompt-len 128]
        [--torch-threads 1 2] [--repeats 3] [--out out/bench_target_decode.json]

Both sides load the same GGUF file (SmolLM2-135M-Instruct, Q4_1 dequantised to f32): ours through
`dspark_jax.load_target`, torch through transformers' own `load_gguf_checkpoint` into a `LlamaForCausalLM`.
Both decode greedily: a prefill of B prompts of `--prompt-len` tokens (which yields the first new token), then
`--new-tokens` tokens per row, EOS ignored. Reported:

  tokens/s = B · new_tokens / decode_seconds     (prefill excluded, timed separately)

"ours" is `dspark_jax.generate` target-only: the serving engine's round (dspark_jax/runner.py, paged KV cache,
the sampler, the host's stop bookkeeping; round r+1 is dispatched before round r is read back), with its own
prefill and decode timings. "ours fwd+argmax" is the bare dense forward (`decoding.prefill`, then
`target.forward` over a dense cache) with a plain argmax, each step synced to the host: the floor the round's
costs stand on. Compilation happens in the warm-up run and is excluded. Torch is eager `model(...)` with its
default `DynamicCache`, `logits_to_keep=1` at prefill (what `model.generate` does, minus its logits-processor
bookkeeping), at each `--torch-threads` setting, each step fed the previous argmax; XLA uses its default thread
pool (all cores). Each measurement is repeated `--repeats` times after one warm-up; the table shows the
fastest and the median run. Other processes on the machine make timings noisy: the 1-minute load average is
printed before and after.
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import inspect
import io
import json
import os
import statistics
import sys
import time

import numpy as np

# Any text works (decoding runs a fixed number of steps, EOS is ignored); rows start at different offsets.
TEXT = (
    "Speculative decoding lets a small drafter propose several tokens that the large target model then "
    "verifies in one forward pass. When the drafter agrees with the target, many tokens are emitted for the "
    "cost of one target step; when it does not, the target's own token replaces the first rejected draft. "
)


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--target", default="smollm2-135m-instruct",
                   help="a .gguf file or known name (torch loads GGUF only); default: %(default)s")
    p.add_argument("--batch", type=int, nargs="+", default=[1, 8], help="batch sizes B (default: 1 8)")
    p.add_argument("--new-tokens", type=int, default=64, help="decode steps per row (default: %(default)s)")
    p.add_argument("--prompt-len", type=int, default=128, help="prompt tokens per row (default: %(default)s)")
    p.add_argument("--torch-threads", type=int, nargs="+", default=[1, 2],
                   help="torch.set_num_threads settings to measure (default: 1 2)")
    p.add_argument("--repeats", type=int, default=3, help="timed runs per measurement (default: %(default)s)")
    p.add_argument("--no-torch", action="store_true", help="measure ours only")
    p.add_argument("--out", default="out/bench_target_decode.json",
                   help="where to write the numbers as JSON (default: %(default)s)")
    args = p.parse_args(argv)
    for name in ("new_tokens", "prompt_len", "repeats"):
        if getattr(args, name) < 1:
            p.error(f"--{name.replace('_', '-')} must be >= 1")
    if min(args.batch) < 1 or min(args.torch_threads) < 1:
        p.error("--batch and --torch-threads values must be >= 1")
    return args


def make_prompts(tokenizer, batch: int, length: int) -> np.ndarray:
    """int32 [B, P]: windows of a tiled text, row b starting 7·b tokens in."""
    base = tokenizer.encode(TEXT, add_special_tokens=False)
    need = length + 7 * batch
    ids = (base * (need // len(base) + 1))[:need]
    return np.array([ids[7 * b : 7 * b + length] for b in range(batch)], np.int32)


# --- ours ------------------------------------------------------------------------------------------------


def ours_generate(target, prompts: np.ndarray, steps: int):
    """`dspark_jax.generate` target-only, greedy; returns (prefill_s, decode_s, tokens [B, steps + 1])."""
    import dspark_jax

    result = dspark_jax.generate(target, prompts.tolist(), max_new_tokens=steps + 1, ignore_eos=True)
    return result.timings["prefill_s"], result.timings["decode_s"], np.array(result.tokens, np.int32)


def ours_forward_argmax(target, prompts: np.ndarray, steps: int):
    """Dense prefill + `steps` forwards with argmax, synced each step; returns (prefill_s, decode_s, tokens)."""
    import jax.numpy as jnp

    from dspark_jax.buckets import round_up
    from dspark_jax.decoding import prefill

    B, P = prompts.shape
    cache = target.init_cache(B, round_up(P + steps + 1, 64))  # a dense cache of the prompt + new tokens
    t0 = time.perf_counter()
    logits, cache, _ = prefill(target.graphdef, target.params, jnp.asarray(prompts), cache,
                               jnp.full((B,), P, jnp.int32))  # fmt: skip
    anchor = jnp.argmax(logits, -1).astype(jnp.int32)
    out = [np.asarray(anchor)]
    t1 = time.perf_counter()
    for _ in range(steps):
        logits, cache, _ = target.forward(anchor[:, None], cache)
        anchor = jnp.argmax(logits[:, -1], -1).astype(jnp.int32)
        out.append(np.asarray(anchor))  # a host sync per step
    t2 = time.perf_counter()
    return t1 - t0, t2 - t1, np.stack(out, 1)


# --- torch -----------------------------------------------------------------------------------------------


def torch_gguf_model(path: str):
    """transformers' LlamaForCausalLM with the GGUF's weights (f32, eval), loaded without `accelerate`."""
    import torch
    import transformers
    from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint

    folder, name = os.path.split(path)
    config = transformers.AutoConfig.from_pretrained(folder, gguf_file=name, local_files_only=True)
    with torch.device("meta"):  # no random init of 135M parameters; everything is assigned below
        model = transformers.AutoModelForCausalLM.from_config(config)
    with contextlib.redirect_stderr(io.StringIO()):  # its tqdm bar
        tensors = load_gguf_checkpoint(path, return_tensors=True, model_to_load=model)["tensors"]
    result = model.load_state_dict({k: v.float() for k, v in tensors.items()}, strict=False, assign=True)
    if result.unexpected_keys or set(result.missing_keys) - {"lm_head.weight"}:
        raise ValueError(f"GGUF tensors do not fit {type(model).__name__}: {result}")
    model.tie_weights()  # tied head: no output.weight in the GGUF
    model.model.rotary_emb = type(model.model.rotary_emb)(config=config)  # buffers were on meta
    return model.float().eval()


def torch_run(model, prompts: np.ndarray, steps: int):
    """Greedy decode in eager torch with a DynamicCache; returns (prefill_s, decode_s, tokens)."""
    import torch

    # transformers renamed `past_key_values` to `cache` (argument and output) during 5.x; use what is there.
    name = "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"
    ids = torch.as_tensor(prompts, dtype=torch.long)
    with torch.inference_mode():
        t0 = time.perf_counter()
        out = model(input_ids=ids, use_cache=True, logits_to_keep=1)
        cache, tok = getattr(out, name), out.logits[:, -1].argmax(-1)
        toks = [tok]
        t1 = time.perf_counter()
        for _ in range(steps):
            out = model(input_ids=tok[:, None], use_cache=True, **{name: cache})
            cache, tok = getattr(out, name), out.logits[:, -1].argmax(-1)
            toks.append(tok)
        t2 = time.perf_counter()
    return t1 - t0, t2 - t1, torch.stack(toks, 1).numpy()


# --- driver ----------------------------------------------------------------------------------------------


def measure(impls, repeats: int, batch: int, steps: int) -> list[dict]:
    """Warms up each (name, threads, run) once (timed: for ours it compiles), then times `repeats` rounds.

    Rounds interleave the implementations, so a burst of load from another process spreads over all of
    them instead of landing on one.
    """

    def call(threads, run):
        if threads is not None:  # a torch run
            import torch

            torch.set_num_threads(threads)
        return run()

    warm = [call(threads, run) for _, threads, run in impls]
    runs = [[] for _ in impls]
    for _ in range(repeats):
        for i, (_, threads, run) in enumerate(impls):
            runs[i].append(call(threads, run))
    rows = []
    for (name, threads, _), w, rs in zip(impls, warm, runs, strict=True):
        decode = [r[1] for r in rs]
        rows.append({
            "batch": batch, "impl": name, "threads": threads,
            "warmup_prefill_s": w[0], "warmup_decode_s": w[1],
            "prefill_s": [r[0] for r in rs], "decode_s": decode,
            "tokens_per_s_best": batch * steps / min(decode),
            "tokens_per_s_median": batch * steps / statistics.median(decode),
            "tokens": rs[-1][2],
        })  # fmt: skip
    return rows


def common_prefix(a: np.ndarray, b: np.ndarray) -> int:
    """Shortest per-row common prefix of two [B, T] token arrays."""
    same = np.cumprod(a == b, axis=1).sum(axis=1)
    return int(same.min())


def main(argv=None) -> int:
    args = parse_args(argv)
    import jax

    import dspark_jax
    from dspark_jax.hub import resolve_target

    load_before = os.getloadavg()[0]
    t0 = time.perf_counter()
    target = dspark_jax.load_target(args.target)
    print(f"ours: loaded {args.target} in {time.perf_counter() - t0:.1f}s", file=sys.stderr)
    model = None
    if not args.no_torch:
        import torch

        kind, path = resolve_target(args.target)
        if kind != "gguf":
            print(f"error: the torch side loads GGUF files only; {args.target!r} is {kind}", file=sys.stderr)
            return 2
        t0 = time.perf_counter()
        model = torch_gguf_model(path)
        print(f"torch: loaded the same GGUF in {time.perf_counter() - t0:.1f}s", file=sys.stderr)

    N, rows = args.new_tokens, []
    for B in args.batch:
        prompts = make_prompts(target.tokenizer, B, args.prompt_len)
        impls = [("ours", None, functools.partial(ours_generate, target, prompts, N)),
                 ("ours fwd+argmax", None, functools.partial(ours_forward_argmax, target, prompts, N))]
        for threads in [] if model is None else args.torch_threads:
            impls.append(("torch", threads, functools.partial(torch_run, model, prompts, N)))
        print(f"  B={B}: {', '.join(name for name, _, _ in impls)} ...", file=sys.stderr)
        batch_rows = measure(impls, args.repeats, B, N)
        ours = batch_rows[0]
        for r in batch_rows:
            r["ours_over_this"] = ours["tokens_per_s_best"] / r["tokens_per_s_best"]
            r["greedy_prefix_agreement"] = common_prefix(ours["tokens"], r["tokens"])
        rows += batch_rows
    load_after = os.getloadavg()[0]

    print(f"\ntarget-only greedy decode, {args.target}, f32, prompt {args.prompt_len} tokens, {N} new tokens "
          f"per row; jax {jax.__version__} on {jax.devices()[0].platform}, {os.cpu_count()} CPUs; "
          f"load average {load_before:.2f} before, {load_after:.2f} after")  # fmt: skip
    head = (f"{'B':>3}  {'impl':<16}{'threads':>7}  {'first_s':>9}  {'prefill_s':>9}  {'decode_s':>8}  "
            f"{'tok/s best':>10}  {'tok/s med':>9}  {'ours/this':>9}  {'agree':>7}")  # fmt: skip
    print(head)
    print("-" * len(head))
    for r in rows:
        first_s = r["warmup_prefill_s"] + r["warmup_decode_s"]
        threads = "all" if r["threads"] is None else str(r["threads"])
        print(f"{r['batch']:>3}  {r['impl']:<16}{threads:>7}  {first_s:>9.2f}  "
              f"{min(r['prefill_s']):>9.3f}  {min(r['decode_s']):>8.3f}  {r['tokens_per_s_best']:>10.1f}  "
              f"{r['tokens_per_s_median']:>9.1f}  {r['ours_over_this']:>9.2f}  "
              f"{r['greedy_prefix_agreement']:>3}/{N + 1:<3}")  # fmt: skip
    print("first_s: the warm-up run, prefill + decode (ours: includes jit compilation); prefill_s, decode_s: "
          "fastest timed run; agree: shortest per-row common prefix with ours' greedy tokens.")

    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    for r in rows:
        r["tokens"] = r["tokens"].tolist()
    report = {"config": {k: v for k, v in vars(args).items() if k != "out"},
              "machine": {"cpus": os.cpu_count(), "loadavg_before": load_before, "loadavg_after": load_after,
                          "jax": jax.__version__, "torch": None if model is None else torch.__version__},
              "results": rows}  # fmt: skip
    with open(args.out, "w") as f:
        json.dump(report, f, indent=1)
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
