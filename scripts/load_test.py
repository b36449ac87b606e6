"""Load and correctness test for a running `python -m serve.cli` server (loopback only). Not a pytest test.

  1. reference: every built-in prompt once, greedy, non-streaming (each prompt has its own endpoint and
     max_tokens, so the reference is the exact expected text);
  2. load: --requests streaming greedy requests over --clients concurrent connections, prompts drawn at
     random; --cancel-frac of them close the stream after a few chunks (the server must abort them);
     every completed request's text must equal its reference (batching must not change greedy output);
  3. after a grace period, /metrics must show every KV page free again and /health must be 200;
  4. malformed JSON, a wrong type, a negative max_tokens and an unknown model must each get a 4xx with an
     OpenAI error message.

Prints a summary table and exits 1 on any failure (2 for bad arguments). Example:

    python -m serve.cli --port 8000 &
    python scripts/load_test.py --clients 64 --requests 256
"""

from __future__ import annotations

import argparse
import asyncio
import ipaddress
import json
import random
import sys
import time
import urllib.parse

import httpx

# (endpoint, prompt, max_tokens): varied lengths, topics and scripts; chat prompts go through the template.
PROMPTS: list[tuple[str, str, int]] = [
    ("chat", "Hi! Who are you?", 24),
    ("chat", "Write a haiku about the sea.", 48),
    ("chat", "Explain speculative decoding to a five-year-old.", 128),
    ("chat", "List five fruits, one per line.", 40),
    ("chat", "Write a Python function that returns the n-th Fibonacci number.", 160),
    ("chat", "Translate 'good morning, my friend' into French, German and Spanish.", 64),
    ("chat", "What is 17 * 23? Show your steps.", 96),
    ("chat", "Summarise the plot of Romeo and Juliet in three sentences. " * 3, 112),
    ("chat", "日本の首都はどこですか？", 32),
    ("completions", "The capital of France is", 8),
    ("completions", "def quicksort(xs):\n", 96),
    ("completions", "Once upon a time, in a land far away,", 64),
    ("completions", "1, 2, 3, 4, 5,", 16),
    ("completions", "The three laws of thermodynamics are", 200),
]


def loopback_url(url: str) -> str:
    """Returns `url` without a trailing slash; raises ArgumentTypeError unless its host is loopback."""
    parsed = urllib.parse.urlsplit(url)
    host = parsed.hostname or ""
    if parsed.scheme not in ("http", "https") or not host:
        raise argparse.ArgumentTypeError(f"expected an http URL like http://127.0.0.1:8000, got {url!r}")
    if host != "localhost":
        try:
            ok = ipaddress.ip_address(host).is_loopback
        except ValueError:
            ok = False  # a name other than localhost: not resolved, refused
        if not ok:
            raise argparse.ArgumentTypeError(f"refusing non-loopback host {host!r}: this script floods its target")
    return url.rstrip("/")


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--url", type=loopback_url, default="http://127.0.0.1:8000",
                   help="server base URL, loopback only (default: %(default)s)")
    p.add_argument("--model", default=None, help="model name (default: the first one /v1/models lists)")
    p.add_argument("--clients", type=int, default=64, help="concurrent streaming clients (default: %(default)s)")
    p.add_argument("--requests", type=int, default=256, help="streaming requests in all (default: %(default)s)")
    p.add_argument("--cancel-frac", type=float, default=0.25,
                   help="fraction of requests that hang up after a few chunks (default: %(default)s)")
    p.add_argument("--timeout", type=float, default=600.0,
                   help="seconds allowed for the whole load phase; also each request's limit (default: %(default)s)")
    p.add_argument("--grace", type=float, default=10.0,
                   help="seconds to wait for every KV page to be free after the load (default: %(default)s)")
    p.add_argument("--seed", type=int, default=0, help="seed of the request mix (default: %(default)s)")
    p.add_argument("--api-key", default=None, help="the server's --api-key, sent as a Bearer token")
    args = p.parse_args(argv)
    if args.clients < 1 or args.requests < 1:
        p.error("--clients and --requests must be >= 1")
    if not 0.0 <= args.cancel_frac <= 1.0:
        p.error(f"--cancel-frac must be in [0, 1], got {args.cancel_frac}")
    return args


def request_body(model: str, kind: str, prompt: str, max_tokens: int, stream: bool) -> tuple[str, dict]:
    body = {"model": model, "max_tokens": max_tokens, "temperature": 0.0, "stream": stream}
    if stream:
        body["stream_options"] = {"include_usage": True}
    if kind == "chat":
        return "/v1/chat/completions", {**body, "messages": [{"role": "user", "content": prompt}]}
    return "/v1/completions", {**body, "prompt": prompt}


async def reference(client: httpx.AsyncClient, model: str, i: int) -> tuple[str, str]:
    """(text, finish_reason) of prompt i, greedy, non-streaming."""
    kind, prompt, max_tokens = PROMPTS[i]
    path, body = request_body(model, kind, prompt, max_tokens, stream=False)
    r = await client.post(path, json=body)
    r.raise_for_status()
    choice = r.json()["choices"][0]
    return (choice["message"]["content"] if kind == "chat" else choice["text"]), choice["finish_reason"]


async def stream_one(client: httpx.AsyncClient, model: str, i: int, cancel_after: int | None) -> dict:
    """One streaming request; hangs up after `cancel_after` chunks when given."""
    kind, prompt, max_tokens = PROMPTS[i]
    path, body = request_body(model, kind, prompt, max_tokens, stream=True)
    t0 = time.perf_counter()
    text, finish, chunks, usage, done = "", None, 0, None, False
    async with client.stream("POST", path, json=body) as r:
        if r.status_code != 200:
            return {"prompt": i, "error": f"HTTP {r.status_code}: {(await r.aread())[:200]!r}"}
        async for line in r.aiter_lines():
            if not line.startswith("data: "):
                continue
            if line == "data: [DONE]":
                done = True
                break
            obj = json.loads(line[6:])
            if "error" in obj:
                return {"prompt": i, "error": f"stream error: {obj['error']}"}
            if obj.get("usage"):
                usage = obj["usage"]
            for c in obj.get("choices", []):
                text += (c["delta"].get("content") or "") if kind == "chat" else c["text"]
                finish = c["finish_reason"] or finish
            chunks += 1
            if cancel_after is not None and chunks >= cancel_after:
                return {"prompt": i, "cancelled": True}  # leaving the block closes the connection
    if not done:
        return {"prompt": i, "error": "stream ended without [DONE]"}
    return {"prompt": i, "text": text, "finish": finish, "latency_s": time.perf_counter() - t0,
            "tokens": (usage or {}).get("completion_tokens", 0)}


async def load(args, client: httpx.AsyncClient, model: str) -> tuple[list[dict], float]:
    rng = random.Random(args.seed)
    jobs: asyncio.Queue = asyncio.Queue()
    for _ in range(args.requests):
        cancel = rng.randint(1, 6) if rng.random() < args.cancel_frac else None
        jobs.put_nowait((rng.randrange(len(PROMPTS)), cancel))
    results: list[dict] = []

    async def worker():
        while not jobs.empty():
            i, cancel = jobs.get_nowait()
            try:
                results.append(await stream_one(client, model, i, cancel))
            except httpx.HTTPError as e:
                results.append({"prompt": i, "error": f"{type(e).__name__}: {e}"})

    t0 = time.perf_counter()
    await asyncio.wait_for(asyncio.gather(*(worker() for _ in range(args.clients))), args.timeout)
    return results, time.perf_counter() - t0


async def pages_free(client: httpx.AsyncClient, grace_s: float) -> tuple[bool, str]:
    from prometheus_client.parser import text_string_to_metric_families

    deadline, seen = time.monotonic() + grace_s, "no /metrics answer"
    while True:
        r = await client.get("/metrics")
        if r.status_code == 200:
            values = {s.name: s.value for f in text_string_to_metric_families(r.text) for s in f.samples}
            free, total = values.get("dspark_free_pages"), values.get("dspark_total_pages")
            seen = f"free_pages={free} total_pages={total}"
            if free is not None and free == total:
                return True, seen
        if time.monotonic() > deadline:
            return False, seen
        await asyncio.sleep(0.25)


async def error_checks(client: httpx.AsyncClient, model: str) -> list[str]:
    """The failures among the bad requests that must be answered 4xx with an error message."""
    chat = [{"role": "user", "content": "hi"}]
    cases = {
        "malformed JSON": ("/v1/chat/completions", b'{"model": "x", "messages": ['),
        "wrong type": ("/v1/chat/completions", {"model": model, "messages": chat, "temperature": "hot"}),
        "negative max_tokens": ("/v1/completions", {"model": model, "prompt": "hi", "max_tokens": -5}),
        "unknown model": ("/v1/chat/completions", {"model": model + "-nope", "messages": chat}),
    }
    failures = []
    for name, (path, body) in cases.items():
        r = await (client.post(path, content=body, headers={"content-type": "application/json"})
                   if isinstance(body, bytes) else client.post(path, json=body))
        try:
            message = r.json()["error"]["message"]
        except (ValueError, KeyError, TypeError):
            message = None
        if not (400 <= r.status_code < 500 and message):
            failures.append(f"{name}: HTTP {r.status_code} {r.text[:200]!r}")
    return failures


def percentile(xs: list[float], q: float) -> float:
    if not xs:
        return float("nan")
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(round(q * (len(xs) - 1))))]


async def run(args) -> int:
    limits = httpx.Limits(max_connections=args.clients + 4, max_keepalive_connections=args.clients)
    headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}
    async with httpx.AsyncClient(base_url=args.url, timeout=args.timeout, limits=limits, headers=headers) as client:
        model = args.model or (await client.get("/v1/models")).json()["data"][0]["id"]
        print(f"model {model} at {args.url}; references for {len(PROMPTS)} prompts ...", flush=True)
        refs = await asyncio.gather(*(reference(client, model, i) for i in range(len(PROMPTS))))
        print(f"load: {args.requests} streaming requests over {args.clients} clients ...", flush=True)
        results, wall = await load(args, client, model)
        completed = [r for r in results if "text" in r]
        cancelled = [r for r in results if r.get("cancelled")]
        errors = [r for r in results if "error" in r]
        mismatches = [r for r in completed if (r["text"], r["finish"]) != refs[r["prompt"]]]
        pages_ok, pages_seen = await pages_free(client, args.grace)
        health = (await client.get("/health")).status_code
        bad = await error_checks(client, model)

    latencies = [r["latency_s"] for r in completed]
    tokens = sum(r["tokens"] for r in completed)
    rows = [("requests", len(results)), ("completed", len(completed)), ("cancelled", len(cancelled)),
            ("errors", len(errors)), ("mismatches", len(mismatches)),
            ("p50 latency s", f"{percentile(latencies, 0.5):.3f}"),
            ("p95 latency s", f"{percentile(latencies, 0.95):.3f}"),
            ("tokens/s", f"{tokens / wall:.1f}" if wall > 0 else "n/a"), ("wall s", f"{wall:.2f}"),
            ("pages free", f"{'ok' if pages_ok else 'FAIL'} ({pages_seen})"), ("/health", health),
            ("error handling", "ok" if not bad else f"FAIL ({len(bad)})")]
    width = max(len(k) for k, _ in rows)
    print("\n".join(f"{k:<{width}}  {v}" for k, v in rows))
    for r in errors[:5]:
        print(f"error (prompt {r['prompt']}): {r['error']}")
    for r in mismatches[:5]:
        print(f"mismatch (prompt {r['prompt']}): got {r['text'][:80]!r} / {r['finish']}, "
              f"reference {refs[r['prompt']][0][:80]!r} / {refs[r['prompt']][1]}")
    for line in bad:
        print(f"bad-request check failed: {line}")
    failed = errors or mismatches or not pages_ok or health != 200 or bad or len(results) != args.requests
    print("FAIL" if failed else "PASS")
    return 1 if failed else 0


def main(argv=None) -> int:
    args = parse_args(argv)
    try:
        return asyncio.run(run(args))
    except (TimeoutError, httpx.HTTPError) as e:
        print(f"error: {type(e).__name__}: {e}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
