"""Time to first answer of `python -m dspark_jax.serve`, as a newcomer meets it: on a cold compilation cache
(a fresh, empty directory) and then warm (the same directory, second start).

    python scripts/bench_startup.py                       # the default server (SmolLM2 + its DSpark drafter)
    python scripts/bench_startup.py --server-args --drafter none --startup blocking

Each start spawns the server, polls /health, sends one chat request (greedy, 32 tokens) as soon as it is up, and
records the seconds from spawn to the answer. The server's own start-up lines (what it compiled, how long) are
printed. The two answers must be equal (a check, not a timing). Writes the rows to `--out`/bench_startup.json.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import subprocess
import sys
import tempfile
import time

MESSAGE = "Name three primary colours."


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--port", type=int, default=8771)
    p.add_argument("--timeout", type=float, default=1800.0, help="seconds one start may take")
    p.add_argument("--out", default=f"reports/{datetime.date.today()}/startup",
                   help="directory for bench_startup.json (default: reports/<today>/startup)")
    p.add_argument("--server-args", nargs=argparse.REMAINDER, default=[],
                   help="everything after this goes to python -m dspark_jax.serve")
    return p.parse_args(argv)


def first_answer(port: int, cache: str, server_args: list[str], timeout: float) -> dict:
    import httpx

    cmd = [sys.executable, "-m", "dspark_jax.serve", "--port", str(port), "--compile-cache", cache, *server_args]
    t0 = time.perf_counter()
    log = tempfile.TemporaryFile("w+")
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, text=True)
    try:
        url = f"http://127.0.0.1:{port}"
        while True:
            if proc.poll() is not None:
                log.seek(0)
                raise SystemExit(f"the server exited with {proc.returncode}:\n{log.read()[-3000:]}")
            if time.perf_counter() - t0 > timeout:
                raise SystemExit(f"no answer within {timeout:.0f}s")
            try:
                if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            time.sleep(0.2)
        up = time.perf_counter() - t0
        model = httpx.get(f"{url}/v1/models", timeout=10).json()["data"][0]["id"]
        r = httpx.post(f"{url}/v1/chat/completions", timeout=timeout,
                       json={"model": model, "messages": [{"role": "user", "content": MESSAGE}],
                             "max_tokens": 32, "temperature": 0.0})
        r.raise_for_status()
        answered = time.perf_counter() - t0
        text = r.json()["choices"][0]["message"]["content"]
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
    log.seek(0)
    lines = [ln.rstrip() for ln in log if "compiled" in ln or "serving" in ln or "SPS" in ln]
    return {"health_s": up, "first_answer_s": answered, "answer": text, "server_lines": lines}


def main(argv=None) -> int:
    args = parse_args(argv)
    rows = []
    with tempfile.TemporaryDirectory() as cache:
        for start in ("cold", "warm"):
            row = {"start": start, **first_answer(args.port, cache, args.server_args, args.timeout)}
            rows.append(row)
            print(f"{start}: healthy after {row['health_s']:.1f}s, first answer after {row['first_answer_s']:.1f}s")
            for line in row["server_lines"]:
                print(f"    {line}")
    if rows[0]["answer"] != rows[1]["answer"]:
        raise SystemExit(f"the two starts answered differently: {rows[0]['answer']!r} vs {rows[1]['answer']!r}")
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "bench_startup.json"), "w") as f:
        json.dump({"server_args": args.server_args, "rows": rows}, f, indent=1)
    print(f"answer: {rows[0]['answer']!r}\nwrote {os.path.join(args.out, 'bench_startup.json')}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
