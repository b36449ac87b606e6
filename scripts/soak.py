"""Soak test: --minutes (default 30) of mixed load on loopback, then a drain; does the server stay flat?

Load (--clients concurrent workers, each looping until the deadline): greedy streams whose text must equal the
prompt's reference, streams cancelled mid-way, sampled n > 1 completions, chats with logprobs, malformed requests
(truncated JSON, text/plain, deep nesting, unknown fields, wrong types, token ids outside the vocabulary) and
oversized bodies, which must all get their 4xx. Every --sample-s the server's resident memory (RSS), its KV pages
and queue (/metrics) are sampled, and every request's latency is kept.

Verdicts (exit 1 if any fails): RSS flat (median of the last window within --rss-tolerance of the first), no
page leaked (free == total after the drain), p99 latency of the last window within --p99-tolerance of the first
(windows: 5 minutes, or a third of a shorter run; at least 20 complete requests in each, else the verdict is
inconclusive and fails), no response >= 500, no mismatched greedy output, /health 200
and the server alive at the end. Writes reports/<today>/soak/soak-<time>.json and a latency/RSS/pages-over-time PNG.

    python scripts/soak.py --minutes 30                            # starts python -m dspark_jax.serve
    python scripts/soak.py --minutes 2 -- --max-batch 4 --max-model-len 256 --drafter none
    python scripts/soak.py --base-url http://127.0.0.1:8000 --server-pid 1234
"""

from __future__ import annotations

import argparse
import asyncio
import datetime
import json
import os
import random
import statistics
import sys
import time

import httpx

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from fuzz_api import ServerProcess  # noqa: E402 (scripts/ is not a package)
from load_test import PROMPTS, loopback_url, percentile, request_body  # noqa: E402

MIX = {"stream": 30, "cancel": 15, "n": 15, "chat_logprobs": 15, "malformed": 20, "oversized": 5}
WINDOW_S = 300.0
MIN_LATENCY_SAMPLES = 20  # per window; fewer make p99 noise (then the verdict is "inconclusive", not a pass)
SERVER_ARGS = ["--max-batch", "4", "--max-model-len", "256", "--max-body-bytes", str(1 << 20),
               "--log-level", "warning"]


def malformed_cases(model: str) -> list[tuple[str, bytes, dict, int]]:
    """(path, body, headers, expected status) of requests the server must refuse without harm."""
    js = {"content-type": "application/json"}
    good = {"model": model, "prompt": "Hello", "max_tokens": 4}
    return [
        ("/v1/completions", b'{"model": "' + model.encode() + b'", "prompt": [', js, 400),
        ("/v1/completions", json.dumps(good).encode(), {"content-type": "text/plain"}, 415),
        ("/v1/chat/completions", b"[" * 5000 + b"]" * 5000, js, 400),
        ("/v1/completions", json.dumps({**good, "logit_bias": {"1": 500}}).encode(), js, 400),  # > 100
        ("/v1/completions", json.dumps({**good, "frobnicate": True}).encode(), js, 400),
        ("/v1/chat/completions", json.dumps({"model": model, "messages": "hi"}).encode(), js, 400),
        ("/v1/completions", json.dumps({**good, "prompt": [1, 10**12]}).encode(), js, 400),
        ("/v1/completions", json.dumps({**good, "top_k": 2**70}).encode(), js, 400),
        ("/v1/completions", b'{"model": "x", "prompt": "a", "temperature": NaN}', js, 400),
    ]


class Soak:
    def __init__(self, args, client: httpx.AsyncClient, model: str, refs: dict[int, str], pid: int | None):
        self.args, self.client, self.model, self.refs, self.pid = args, client, model, refs, pid
        self.t0 = time.monotonic()
        self.requests: list[dict] = []  # {t, kind, status, latency_s, ok}
        self.samples: list[dict] = []  # {t, rss_mb, free_pages, total_pages, running, waiting}
        self.problems: list[str] = []
        self.malformed = malformed_cases(model)

    def now(self) -> float:
        return time.monotonic() - self.t0

    def note(self, kind: str, status: int | None, t_start: float, ok: bool, error: str | None = None) -> None:
        self.requests.append({"t": round(t_start, 3), "kind": kind, "status": status,
                              "latency_s": round(self.now() - t_start, 4), "ok": ok})
        if error and len(self.problems) < 50:
            self.problems.append(f"{kind}: {error}")

    async def one(self, rng: random.Random) -> None:
        kind = rng.choices(list(MIX), weights=list(MIX.values()))[0]
        t = self.now()
        i = rng.randrange(len(PROMPTS))
        ptype, prompt, mt = PROMPTS[i]
        mt = min(mt, self.args.max_tokens)
        try:
            if kind in ("stream", "cancel"):
                path, body = request_body(self.model, ptype, prompt, mt, stream=True)
                stop_after = rng.randint(1, 4) if kind == "cancel" else None
                text, chunks = "", 0
                async with self.client.stream("POST", path, json=body) as r:
                    if r.status_code != 200:
                        return self.note(kind, r.status_code, t, False, f"HTTP {r.status_code}")
                    async for line in r.aiter_lines():
                        if not line.startswith("data: ") or line == "data: [DONE]":
                            continue
                        obj = json.loads(line[6:])
                        if "error" in obj:
                            return self.note(kind, 200, t, False, f"stream error {obj['error']}")
                        for c in obj.get("choices", []):
                            text += (c["delta"].get("content") or "") if ptype == "chat" else c["text"]
                        chunks += 1
                        if stop_after is not None and chunks >= stop_after:
                            return self.note(kind, 200, t, True)  # leaving the block hangs up
                if kind == "stream" and text != self.refs[(i, mt)]:
                    return self.note(kind, 200, t, False, f"greedy output of prompt {i} differs from its reference")
                return self.note(kind, 200, t, True)
            if kind == "n":
                body = {"model": self.model, "prompt": PROMPTS[-1][1], "max_tokens": mt, "n": rng.randint(2, 3),
                        "temperature": 0.8, "seed": rng.randrange(2**31)}
                r = await self.client.post("/v1/completions", json=body)
                ok = r.status_code == 200 and len(r.json()["choices"]) == body["n"]
                return self.note(kind, r.status_code, t, ok, None if ok else f"HTTP {r.status_code} {r.text[:200]}")
            if kind == "chat_logprobs":
                body = {"model": self.model, "messages": [{"role": "user", "content": prompt}], "max_tokens": mt,
                        "temperature": 0, "logprobs": True, "top_logprobs": 2}
                r = await self.client.post("/v1/chat/completions", json=body)
                ok = r.status_code == 200 and r.json()["choices"][0]["logprobs"] is not None
                return self.note(kind, r.status_code, t, ok, None if ok else f"HTTP {r.status_code} {r.text[:200]}")
            if kind == "malformed":
                path, raw, headers, want = rng.choice(self.malformed)
            else:  # oversized: a body over the server's cap
                path, headers, want = "/v1/completions", {"content-type": "application/json"}, 413
                raw = json.dumps({"model": self.model, "prompt": "a" * self.args.oversize_bytes}).encode()
            r = await self.client.post(path, content=raw, headers=headers)
            ok = r.status_code == want
            return self.note(kind, r.status_code, t, ok, None if ok else f"{path} expected {want}, got "
                                                                         f"{r.status_code} {r.text[:200]}")
        except (httpx.HTTPError, ValueError, KeyError) as e:
            return self.note(kind, None, t, False, f"{type(e).__name__}: {e}")

    async def worker(self, seed: int, deadline: float) -> None:
        rng = random.Random(seed)
        while self.now() < deadline:
            await self.one(rng)

    async def sample(self) -> dict:
        s = {"t": round(self.now(), 2), "rss_mb": None}
        if self.pid is not None:
            import psutil

            try:
                s["rss_mb"] = psutil.Process(self.pid).memory_info().rss / 2**20
            except psutil.Error:
                s["rss_mb"] = None
        s.update(await metrics(self.client))
        self.samples.append(s)
        return s

    async def sampler(self, deadline: float) -> None:
        while self.now() < deadline:
            s = await self.sample()
            print(f"  t={s['t']:7.1f}s requests={len(self.requests):6d} rss={s['rss_mb'] or 0:8.1f} MB "
                  f"pages free {s.get('free_pages')}/{s.get('total_pages')} running={s.get('running')} "
                  f"waiting={s.get('waiting')}", flush=True)
            await asyncio.sleep(min(self.args.sample_s, max(0.0, deadline - self.now())))


async def metrics(client: httpx.AsyncClient) -> dict:
    from prometheus_client.parser import text_string_to_metric_families

    try:
        r = await client.get("/metrics")
        v = {s.name: s.value for f in text_string_to_metric_families(r.text) for s in f.samples if not s.labels}
    except (httpx.HTTPError, ValueError):
        return {}
    return {"free_pages": v.get("dspark_free_pages"), "total_pages": v.get("dspark_total_pages"),
            "running": v.get("dspark_requests_running"), "waiting": v.get("dspark_requests_waiting")}


async def references(client: httpx.AsyncClient, model: str, max_tokens: int) -> dict:
    """Greedy streamed text of every prompt at the capped length, alone on the server."""
    refs = {}
    for i, (ptype, prompt, mt) in enumerate(PROMPTS):
        mt = min(mt, max_tokens)
        path, body = request_body(model, ptype, prompt, mt, stream=True)
        text = ""
        async with client.stream("POST", path, json=body) as r:
            r.raise_for_status()
            async for line in r.aiter_lines():
                if line.startswith("data: ") and line != "data: [DONE]":
                    for c in json.loads(line[6:]).get("choices", []):
                        text += (c["delta"].get("content") or "") if ptype == "chat" else c["text"]
        refs[(i, mt)] = text
    return refs


def verdicts(soak: Soak, duration: float, drained: dict, health: int, alive: bool, args) -> dict:
    w = min(WINDOW_S, duration / 3)
    first = [r["latency_s"] for r in soak.requests if r["ok"] and r["kind"] in ("stream", "n", "chat_logprobs")
             and r["t"] < w]
    last = [r["latency_s"] for r in soak.requests if r["ok"] and r["kind"] in ("stream", "n", "chat_logprobs")
            and r["t"] >= duration - w]
    rss_first = [s["rss_mb"] for s in soak.samples if s["rss_mb"] and s["t"] < w]
    rss_last = [s["rss_mb"] for s in soak.samples if s["rss_mb"] and s["t"] >= duration - w]
    p99_first, p99_last = percentile(first, 0.99), percentile(last, 0.99)
    out = {"window_s": round(w, 1),
           "p99_first_s": p99_first, "p99_last_s": p99_last, "latency_samples": [len(first), len(last)],
           "p99_ok": bool(min(len(first), len(last)) >= MIN_LATENCY_SAMPLES
                          and p99_last <= (1 + args.p99_tolerance) * p99_first)}
    if min(len(first), len(last)) < MIN_LATENCY_SAMPLES:
        out["p99_inconclusive"] = f"fewer than {MIN_LATENCY_SAMPLES} complete requests in a window"
    if rss_first and rss_last:
        a, b = statistics.median(rss_first), statistics.median(rss_last)
        out.update(rss_first_mb=a, rss_last_mb=b, rss_max_mb=max(s["rss_mb"] for s in soak.samples if s["rss_mb"]),
                   rss_ok=abs(b / a - 1) <= args.rss_tolerance)
    else:
        out.update(rss_ok=None)  # no pid: not measured
    out.update(pages_after_drain=drained, pages_ok=bool(drained) and drained.get("free_pages") ==
               drained.get("total_pages"), server_errors=sum(1 for r in soak.requests if (r["status"] or 0) >= 500),
               failed_requests=sum(1 for r in soak.requests if not r["ok"]), health=health, alive=alive)
    out["ok"] = (out["p99_ok"] and out["rss_ok"] is not False and out["pages_ok"] and not out["server_errors"]
                 and not out["failed_requests"] and health == 200 and alive)
    return out


def plot(soak: Soak, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from train.plots import save_figure

    fig, (ax1, ax2) = plt.subplots(2, 1, figsize=(11, 7), sharex=True)
    for kind in ("stream", "n", "chat_logprobs", "cancel", "malformed", "oversized"):
        pts = [(r["t"], r["latency_s"]) for r in soak.requests if r["kind"] == kind and r["ok"]]
        if pts:
            ax1.scatter(*zip(*pts, strict=True), s=6, alpha=0.5, label=kind)
    ok = sorted((r["t"], r["latency_s"]) for r in soak.requests if r["ok"] and r["kind"] in ("stream", "n",
                                                                                              "chat_logprobs"))
    if ok:  # p99 over buckets of a minute (shorter for short runs)
        end = max(t for t, _ in ok)
        b = min(60.0, max(5.0, end / 20))
        xs = [(k + 0.5) * b for k in range(int(end // b) + 1)]
        ys = [percentile([lat for t, lat in ok if k * b <= t < (k + 1) * b], 0.99) for k in range(len(xs))]
        ax1.plot(xs, ys, "k-", lw=2, label=f"p99 per {b:.0f} s (complete requests)")
    ax1.set_ylabel("latency (s)")
    ax1.legend(fontsize=7, ncol=4)
    ts = [s["t"] for s in soak.samples]
    if any(s["rss_mb"] for s in soak.samples):
        ax2.plot(ts, [s["rss_mb"] for s in soak.samples], "b-", label="server RSS (MB)")
    ax2.set_ylabel("RSS (MB)")
    ax3 = ax2.twinx()
    ax3.plot(ts, [s.get("free_pages") for s in soak.samples], "g-", label="free KV pages")
    ax3.set_ylabel("free pages")
    ax2.set_xlabel("time (s)")
    ax2.legend(loc="upper left", fontsize=7)
    ax3.legend(loc="upper right", fontsize=7)
    save_figure(fig, path, dpi=110)


async def run(args, base_url: str, pid: int | None) -> int:
    duration = args.minutes * 60
    limits = httpx.Limits(max_connections=args.clients + 8, max_keepalive_connections=args.clients + 4)
    async with httpx.AsyncClient(base_url=base_url, timeout=args.request_timeout, limits=limits,
                                 headers={"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}) as c:
        model = (await c.get("/v1/models")).json()["data"][0]["id"]
        print(f"model {model} at {base_url}; references for {len(PROMPTS)} prompts ...", flush=True)
        refs = await references(c, model, args.max_tokens)
        soak = Soak(args, c, model, refs, pid)
        print(f"soak: {args.minutes:g} min, {args.clients} clients", flush=True)
        await asyncio.gather(soak.sampler(duration), *(soak.worker(args.seed + k, duration)
                                                       for k in range(args.clients)))
        t_end = soak.now()
        drain_deadline = time.monotonic() + args.grace
        while True:  # the drain: every page must come back
            last = await soak.sample()
            if last.get("free_pages") is not None and last["free_pages"] == last["total_pages"]:
                break
            if time.monotonic() > drain_deadline:
                break
            await asyncio.sleep(1.0)
        health = (await c.get("/health")).status_code
    alive = pid is None or _alive(pid)
    v = verdicts(soak, t_end, {k: last.get(k) for k in ("free_pages", "total_pages")}, health, alive, args)
    os.makedirs(args.out_dir, exist_ok=True)
    stamp = time.strftime("%Y%m%d-%H%M%S")
    kinds = {k: {"sent": sum(r["kind"] == k for r in soak.requests),
                 "ok": sum(r["kind"] == k and r["ok"] for r in soak.requests)} for k in MIX}
    report = {"base_url": base_url, "model": model, "minutes": args.minutes, "clients": args.clients,
              "max_tokens": args.max_tokens, "requests": len(soak.requests), "by_kind": kinds, "verdicts": v,
              "problems": soak.problems, "samples": soak.samples, "request_log": soak.requests}
    json_path = os.path.join(args.out_dir, f"soak-{stamp}.json")
    png_path = os.path.join(args.out_dir, f"soak-{stamp}.png")
    with open(json_path, "w") as f:
        json.dump(report, f, indent=1)
    plot(soak, png_path)
    rows = [("requests", len(soak.requests)), ("by kind (ok/sent)", {k: f"{d['ok']}/{d['sent']}" for k, d in
                                                                      kinds.items()}),
            ("p99 first/last window s", f"{v['p99_first_s']:.3f} / {v['p99_last_s']:.3f} "
                                        f"(window {v['window_s']} s, n={v['latency_samples']}) "
                                        f"{'ok' if v['p99_ok'] else 'FAIL'} {v.get('p99_inconclusive', '')}"),
            ("RSS first/last MB", "not measured (no --server-pid)" if v["rss_ok"] is None else
             f"{v['rss_first_mb']:.1f} / {v['rss_last_mb']:.1f} (max {v['rss_max_mb']:.1f}) "
             f"{'ok' if v['rss_ok'] else 'FAIL'}"),
            ("pages after drain", f"{v['pages_after_drain']} {'ok' if v['pages_ok'] else 'FAIL'}"),
            ("responses >= 500", v["server_errors"]), ("failed requests", v["failed_requests"]),
            ("/health, alive", f"{health}, {alive}"), ("report", f"{json_path}, {png_path}")]
    width = max(len(k) for k, _ in rows)
    print("\n".join(f"{k:<{width}}  {val}" for k, val in rows))
    for p in soak.problems[:10]:
        print("problem:", p)
    print("PASS" if v["ok"] else "FAIL")
    return 0 if v["ok"] else 1


def _alive(pid: int) -> bool:
    import psutil

    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.Error:
        return False


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--minutes", type=float, default=30.0, help="length of the load phase (default: %(default)s)")
    p.add_argument("--base-url", type=loopback_url, default=None,
                   help="soak this running server (loopback only) instead of starting one")
    p.add_argument("--server-pid", type=int, default=None, help="pid of the --base-url server, to sample its RSS")
    p.add_argument("--clients", type=int, default=8, help="concurrent workers (default: %(default)s)")
    p.add_argument("--max-tokens", type=int, default=32, help="cap on each request's max_tokens (default: %(default)s)")
    p.add_argument("--oversize-bytes", type=int, default=(1 << 20) + 1024,
                   help="size of the oversized bodies; above the server's --max-body-bytes (default: %(default)s, "
                        "for the server started here)")
    p.add_argument("--sample-s", type=float, default=5.0, help="seconds between samples (default: %(default)s)")
    p.add_argument("--grace", type=float, default=60.0, help="seconds allowed for the drain (default: %(default)s)")
    p.add_argument("--request-timeout", type=float, default=300.0, help="per-request client timeout, seconds")
    p.add_argument("--rss-tolerance", type=float, default=0.10, help="allowed RSS change (default: %(default)s)")
    p.add_argument("--p99-tolerance", type=float, default=0.20, help="allowed p99 growth (default: %(default)s)")
    p.add_argument("--api-key", default=None, help="the server's --api-key (also given to a server started here)")
    p.add_argument("--seed", type=int, default=0, help="seed of the request mix (default: %(default)s)")
    p.add_argument("--out-dir", default=f"reports/{datetime.date.today()}/soak",
                   help="where the JSON report and PNG go (default: reports/<today>/soak)")
    p.add_argument("--startup", type=float, default=1200.0, help="seconds allowed for a started server to start")
    p.add_argument("server_args", nargs="*", help=f"flags for a started server, after -- (default: "
                                                  f"{' '.join(SERVER_ARGS)})")
    args = p.parse_args(argv)
    if args.minutes <= 0 or args.clients < 1 or args.max_tokens < 1 or args.sample_s <= 0:
        p.error("--minutes and --sample-s must be > 0, --clients and --max-tokens >= 1")
    if args.base_url:
        return asyncio.run(run(args, args.base_url, args.server_pid))
    server_args = (args.server_args or SERVER_ARGS) + (["--api-key", args.api_key] if args.api_key else [])
    with ServerProcess(server_args, args.startup) as server:
        return asyncio.run(run(args, server.url, server.proc.pid))


if __name__ == "__main__":
    sys.exit(main())
