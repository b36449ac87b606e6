"""Host cost of a serving step: a tiny target (2 layers, hidden 64, a 256-word vocabulary) whose device work is
negligible, served through the real HTTP server, so the wall time per engine step is what the host spends on
it (scheduling, uploads, dispatch, read-back, HTTP).

    python scripts/bench_host.py                      # c = 1 and 32, pipelined and synchronous, 3 rounds
    python scripts/bench_host.py --concurrency 1 8 32 --max-tokens 200 --rounds 3 --out reports/<date>/host

The target is a randomly initialised Llama saved as a Hugging Face directory (config.json, safetensors and a word-
level tokenizer) and loaded the way `python -m dspark_jax.serve --target DIR --drafter none` loads it; `--startup
blocking` semantics (every shape compiled before the clock starts). Each request asks for `--max-tokens` greedy
tokens with EOS ignored; wall time per step = the level's wall time / the engine steps it took (prefill chunks
included); the client runs in its own process. Pipelined (round n+1 dispatched before round n is read back, the
default) and synchronous engines alternate on the same compiled runner; their outputs must be equal (checked).
Prints one row per (concurrency, mode) with the median over rounds and the synchronous / pipelined ratio.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import statistics
import sys
import tempfile

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--concurrency", nargs="+", type=int, default=[1, 32], help="requests in flight together")
    p.add_argument("--max-tokens", type=int, default=200, help="greedy tokens per request (EOS ignored)")
    p.add_argument("--rounds", type=int, default=3, help="alternating rounds of pipelined and synchronous")
    p.add_argument("--max-batch", type=int, default=32, help="the engine's batch slots")
    p.add_argument("--out", default=f"reports/{datetime.date.today()}/host",
                   help="directory for bench_host.json (default: reports/<today>/host)")
    return p.parse_args(argv)


def make_tiny_target(path: str, vocab: int = 256) -> str:
    """A random 2-layer, hidden-64 Llama with a word-level tokenizer ("w0" … "w255") and a chat template."""
    import torch
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=vocab, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=1024,
                      tie_word_embeddings=True, bos_token_id=0, eos_token_id=1)
    LlamaForCausalLM(cfg).save_pretrained(path, safe_serialization=True)
    tok = Tokenizer(models.WordLevel({f"w{i}": i for i in range(vocab)}, unk_token="w2"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="w0", eos_token="w1", unk_token="w2")
    fast.chat_template = "{% for m in messages %}{{ m['content'] }} {% endfor %}"
    fast.save_pretrained(path)
    return path


CLIENT = """
import asyncio, json, sys, time
import httpx

async def main(base_url, prompts, max_tokens):
    async with httpx.AsyncClient(base_url=base_url, timeout=600, limits=httpx.Limits(max_connections=256)) as c:
        model = (await c.get("/v1/models")).json()["data"][0]["id"]

        async def one(prompt):
            r = await c.post("/v1/completions", json={"model": model, "prompt": prompt, "max_tokens": max_tokens,
                                                      "temperature": 0.0, "ignore_eos": True})
            r.raise_for_status()
            return r.json()["choices"][0]["text"]

        t0 = time.perf_counter()
        texts = await asyncio.gather(*(one(p) for p in prompts))
        return time.perf_counter() - t0, texts

wall, texts = asyncio.run(main(sys.argv[1], json.loads(sys.argv[2]), int(sys.argv[3])))
print(json.dumps({"wall": wall, "texts": texts}))
"""


def run_level(base_url: str, prompts: list[list[int]], max_tokens: int) -> tuple[float, list[str]]:
    """c requests at once from a client in its own process (its threads must not compete with the server's for
    the interpreter lock); the wall time is the client's, from first request to last answer."""
    import subprocess

    out = subprocess.run([sys.executable, "-c", CLIENT, base_url, json.dumps(prompts), str(max_tokens)],
                         capture_output=True, text=True, check=True)
    got = json.loads(out.stdout)
    return got["wall"], got["texts"]


def main(argv=None) -> int:
    args = parse_args(argv)
    import numpy as np

    from serve.cli import chat_template_of
    from serve.server import ServerThread, build_app
    from serve.startup import create_engine

    with tempfile.TemporaryDirectory() as tmp:
        target_dir = make_tiny_target(os.path.join(tmp, "tiny-llama"))
        engine = create_engine(target=target_dir, drafter="none", max_batch=args.max_batch,
                               max_model_len=args.max_tokens + 64, progress=False)
        app = build_app(engine, engine.tokenizer, chat_template=chat_template_of(engine))
        core = engine.core
        rng = np.random.default_rng(0)
        prompts = [[int(x) for x in rng.integers(3, 256, size=16)] for _ in range(max(args.concurrency))]
        rows, texts = [], {}
        with ServerThread(app) as server:
            run_level(server.base_url, prompts[:1], 8)  # first HTTP request and thread start-up off the clock
            for rnd in range(args.rounds):
                for c in args.concurrency:
                    for pipelined in (True, False):
                        core.pipelined = pipelined
                        steps0 = core.stats["steps_total"]
                        wall, out = run_level(server.base_url, prompts[:c], args.max_tokens)
                        steps = core.stats["steps_total"] - steps0
                        prev = texts.setdefault(c, out)
                        if out != prev:
                            raise SystemExit(f"c={c}: pipelined and synchronous outputs differ")
                        rows.append(dict(round=rnd, concurrency=c, pipelined=pipelined, wall_s=wall, steps=steps,
                                         ms_per_step=1e3 * wall / max(steps, 1),
                                         tokens_per_s=c * args.max_tokens / wall))
                        print(f"round {rnd} c={c:3d} {'pipelined' if pipelined else 'synchronous':11s} "
                              f"{rows[-1]['ms_per_step']:.3f} ms/step ({steps} steps, "
                              f"{rows[-1]['tokens_per_s']:.0f} tok/s)", flush=True)
        core.pipelined = True
        engine.stop()

    print("\nconcurrency  pipelined ms/step  synchronous ms/step  sync / pipelined")
    summary = []
    for c in args.concurrency:
        med = {p: statistics.median(r["ms_per_step"] for r in rows if r["concurrency"] == c and r["pipelined"] == p)
               for p in (True, False)}
        summary.append(dict(concurrency=c, pipelined_ms_per_step=med[True], synchronous_ms_per_step=med[False],
                            sync_over_pipelined=med[False] / med[True]))
        print(f"{c:11d}  {med[True]:17.3f}  {med[False]:19.3f}  {med[False] / med[True]:16.2f}")
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "bench_host.json"), "w") as f:
        json.dump({"args": vars(args), "rows": rows, "summary": summary}, f, indent=1)
    print(f"wrote {os.path.join(args.out, 'bench_host.json')}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
