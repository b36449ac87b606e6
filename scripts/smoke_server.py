"""Smoke run of the README's main job (CI): start `python -m dspark_jax.serve` with its defaults, wait until it
is healthy, chat once through the official openai client (plain and streaming), print the replies and the
scheduler metrics, then stop the server. Exits non-zero if any step fails.

    python scripts/smoke_server.py [--port 8000] [--timeout 900] [--api-key KEY] [extra server flags ...]
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import time
import urllib.request


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--timeout", type=float, default=900, help="seconds to wait for start-up (compiles, profiles)")
    p.add_argument("--api-key", default=None, help="start the server with this --api-key and use it")
    args, extra = p.parse_known_args(argv)
    base = f"http://127.0.0.1:{args.port}"
    key = ["--api-key", args.api_key] if args.api_key else []
    proc = subprocess.Popen([sys.executable, "-m", "dspark_jax.serve", "--port", str(args.port), *key, *extra])
    try:
        t0 = time.time()
        while True:
            if proc.poll() is not None:
                print(f"server exited early with code {proc.returncode}", file=sys.stderr)
                return 1
            try:
                with urllib.request.urlopen(base + "/health", timeout=2) as r:
                    if r.status == 200:
                        break
            except OSError:
                pass
            if time.time() - t0 > args.timeout:
                print("server did not become healthy in time", file=sys.stderr)
                return 1
            time.sleep(2)
        import openai

        client = openai.OpenAI(base_url=base + "/v1", api_key=args.api_key or "none", max_retries=0, timeout=300)
        model = client.models.list().data[0].id
        msg = [{"role": "user", "content": "What is the capital of France?"}]
        r = client.chat.completions.create(model=model, messages=msg, max_tokens=24, temperature=0)
        print("chat:", r.choices[0].message.content, f"({r.usage.completion_tokens} tokens)")
        parts = [c.choices[0].delta.content or "" for c in client.chat.completions.create(
            model=model, messages=msg, max_tokens=24, temperature=0, stream=True)]
        print("stream:", "".join(parts))
        if "".join(parts) != r.choices[0].message.content:
            print("streamed text differs from the plain reply", file=sys.stderr)
            return 1
        with urllib.request.urlopen(base + "/metrics", timeout=10) as m:
            lines = [ln for ln in m.read().decode().splitlines() if ln.startswith(("dspark_tokens_per_step",
                                                                                   "dspark_sps"))]
        print("\n".join(lines))
        return 0
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()


if __name__ == "__main__":
    sys.exit(main())
