"""Property-based fuzzing of the HTTP API from its own OpenAPI schema (schemathesis + hypothesis), against the
REAL server (loopback only). Not a pytest test; tests/test_hostile_http.py runs a CI-sized `fuzz()` in-process.

  1. Starts `python -m dspark_jax.serve` on a free loopback port with small sizes (or uses --base-url), reads
     /openapi.json and takes a greedy reference: one completion (token-id prompt) and one chat, non-streamed.
  2. Sends at least --cases generated requests within --minutes: schema-valid ("positive") and schema-violating
     ("negative") bodies for /v1/completions (echo, logprobs, prompt batches included), /v1/chat/completions,
     /tokenize and /detokenize, plus /v1/models, /tokenizer_info, /health, /metrics. The strategy is the server's
     schema with four overrides that keep it cheap and meaningful: `model` names the served model (else nearly
     every case is a 404), `max_tokens` / `max_completion_tokens` are at most --max-tokens, a body without either
     gets `max_tokens` (chat would otherwise fill the context), and a prompt batch within the server's limit holds
     at most MAX_FUZZ_PROMPTS prompts (one over the limit is sent as it is: it must be a 400).
  3. Checks every response: no status >= 500, and (unless --no-schema-checks) the status code, content type and
     JSON body are the ones the schema documents.
  4. Afterwards: /health is 200, the server process is alive, every KV page is free again (/metrics) and the
     reference outputs are unchanged.

Prints counts (by status, by operation, failed checks with reproductions) and exits 1 on any failure (2 for bad
arguments). Examples:

    python scripts/fuzz_api.py                                   # the default server, 1000 cases
    python scripts/fuzz_api.py --cases 200 -- --drafter none     # flags after -- go to the server
    python scripts/fuzz_api.py --base-url http://127.0.0.1:8000 --api-key KEY --cases 5000 --minutes 30
"""

from __future__ import annotations

import argparse
import collections
import copy
import dataclasses
import re
import subprocess
import sys
import threading
import time

import httpx

from serve.protocol import MAX_PROMPTS

SERVER_ARGS = ["--max-batch", "4", "--max-model-len", "256", "--log-level", "warning"]
CHAT_PROMPT = [{"role": "user", "content": "Name three colours."}]
MAX_FAILURE_EXAMPLES = 5
MAX_FUZZ_PROMPTS = 4  # prompts of a generated batch (each is an engine request per choice)


@dataclasses.dataclass
class FuzzReport:
    sent: int = 0
    by_status: collections.Counter = dataclasses.field(default_factory=collections.Counter)
    by_operation: collections.Counter = dataclasses.field(default_factory=collections.Counter)
    server_errors: int = 0  # responses >= 500
    transport_errors: int = 0  # no response at all (connection reset, timeout)
    failed_checks: collections.Counter = dataclasses.field(default_factory=collections.Counter)
    examples: list[str] = dataclasses.field(default_factory=list)
    reference_before: tuple | None = None
    reference_after: tuple | None = None
    pages: str = "not read"
    pages_free: bool = False
    healthy: bool = False
    elapsed_s: float = 0.0
    problems: list[str] = dataclasses.field(default_factory=list)  # invariants broken after the run

    @property
    def ok(self) -> bool:
        return (not self.server_errors and not self.transport_errors and not self.failed_checks and self.healthy
                and self.pages_free and self.reference_before == self.reference_after and not self.problems)

    def summary(self) -> str:
        rows = [("requests sent", self.sent), ("wall s", f"{self.elapsed_s:.1f}"),
                ("by status", dict(sorted(self.by_status.items()))),
                ("by operation", dict(sorted(self.by_operation.items()))),
                ("responses >= 500", self.server_errors), ("transport errors", self.transport_errors),
                ("failed checks", dict(self.failed_checks) or 0),
                ("/health after", "200" if self.healthy else "FAIL"),
                ("pages after", f"{'all free' if self.pages_free else 'FAIL'} ({self.pages})"),
                ("reference unchanged", "yes" if self.reference_before == self.reference_after else
                 f"NO: {self.reference_before!r} -> {self.reference_after!r}")]
        width = max(len(k) for k, _ in rows)
        lines = [f"{k:<{width}}  {v}" for k, v in rows]
        lines += [f"problem: {p}" for p in self.problems]
        lines += [f"--- failure {i + 1} ---\n{e}" for i, e in enumerate(self.examples)]
        lines.append("PASS" if self.ok else "FAIL")
        return "\n".join(lines)


def fuzz_schema(doc: dict, model: str, max_tokens: int) -> dict:
    """The server's schema with the fuzzing overrides (served model, small max_tokens)."""
    doc = copy.deepcopy(doc)
    for name in ("TokenizeRequest", "DetokenizeRequest"):  # `model` optional there
        doc["components"]["schemas"][name]["properties"]["model"] = {"anyOf": [{"type": "string", "enum": [model]},
                                                                            {"type": "null"}]}
    for name in ("CompletionRequest", "ChatCompletionRequest"):
        props = doc["components"]["schemas"][name]["properties"]
        props["model"] = {"type": "string", "enum": [model]}
        for field in ("max_tokens", "max_completion_tokens"):
            if field in props:
                props[field] = {"anyOf": [{"type": "integer", "minimum": 1, "maximum": max_tokens}, {"type": "null"}]}
    return doc


def _cap(case, max_tokens: int):
    """Bounds the work a case asks for, whatever the generator made (negative cases included)."""
    body = case.body
    if isinstance(body, dict) and case.operation.path.startswith("/v1/"):  # (not /tokenize, /detokenize)
        present = False
        for field in ("max_tokens", "max_completion_tokens"):
            v = body.get(field)
            if isinstance(v, int) and not isinstance(v, bool):
                present = True
                if v > max_tokens:
                    body[field] = max_tokens
        if not present and "max_tokens" not in body and "max_completion_tokens" not in body:
            body["max_tokens"] = max_tokens
        prompt = body.get("prompt")
        if isinstance(prompt, list) and prompt and isinstance(prompt[0], (list, str)) and \
                MAX_FUZZ_PROMPTS < len(prompt) <= MAX_PROMPTS:
            body["prompt"] = prompt[:MAX_FUZZ_PROMPTS]
    return case


def reference(client: httpx.Client, model: str) -> tuple:
    """Greedy outputs that no other request may change."""
    r1 = client.post("/v1/completions", json={"model": model, "prompt": [1, 2, 3, 4], "max_tokens": 8,
                                              "temperature": 0})
    r2 = client.post("/v1/chat/completions", json={"model": model, "messages": CHAT_PROMPT, "max_tokens": 8,
                                                   "temperature": 0})
    return (r1.status_code, r1.json()["choices"][0]["text"] if r1.status_code == 200 else r1.text,
            r2.status_code, r2.json()["choices"][0]["message"]["content"] if r2.status_code == 200 else r2.text)


def pages_after(client: httpx.Client, grace_s: float) -> tuple[bool, str]:
    """Waits up to grace_s for free_pages == total_pages on /metrics."""
    from prometheus_client.parser import text_string_to_metric_families

    deadline, seen = time.monotonic() + grace_s, "no /metrics answer"
    while True:
        r = client.get("/metrics")
        if r.status_code == 200:
            v = {s.name: s.value for f in text_string_to_metric_families(r.text) for s in f.samples}
            free, total = v.get("dspark_free_pages"), v.get("dspark_total_pages")
            seen = f"free_pages={free} total_pages={total}"
            if free is not None and free == total:
                return True, seen
        if time.monotonic() > deadline:
            return False, seen
        time.sleep(0.25)


def fuzz(base_url: str, *, cases: int = 1000, seconds: float = 900.0, api_key: str | None = None, seed: int = 0,
         max_tokens: int = 8, schema_checks: bool = True, grace_s: float = 30.0, timeout_s: float = 120.0,
         log=print) -> FuzzReport:
    """Fuzzes the server at `base_url` (loopback) with at least `cases` requests (fewer only if `seconds` run out)."""
    import hypothesis
    import requests
    import schemathesis
    from hypothesis import strategies as st
    from schemathesis.checks import not_a_server_error
    from schemathesis.generation import GenerationMode
    from schemathesis.specs.openapi.checks import (
        content_type_conformance,
        response_schema_conformance,
        status_code_conformance,
    )

    checks = [not_a_server_error] + ([status_code_conformance, content_type_conformance,
                                      response_schema_conformance] if schema_checks else [])
    auth = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    report = FuzzReport()
    t0 = time.monotonic()
    with httpx.Client(base_url=base_url, timeout=timeout_s, headers=auth) as client:
        model = client.get("/v1/models").json()["data"][0]["id"]
        doc = client.get("/openapi.json").json()
        report.reference_before = reference(client, model)
        schema = schemathesis.openapi.from_dict(fuzz_schema(doc, model, max_tokens))
        strategies = []
        for result in schema.get_all_operations():
            op = result.ok()
            strategies.append(op.as_strategy(generation_mode=GenerationMode.POSITIVE))
            if op.method.upper() == "POST":  # GETs take no input to violate
                strategies.append(op.as_strategy(generation_mode=GenerationMode.NEGATIVE))
        strategy = st.one_of(strategies).map(lambda c: _cap(c, max_tokens))
        session = requests.Session()
        deadline = t0 + seconds

        def one(case) -> None:
            if report.sent >= cases or time.monotonic() > deadline:
                return
            report.sent += 1
            report.by_operation[f"{case.operation.method.upper()} {case.operation.path}"] += 1
            try:
                response = case.call(base_url=base_url, session=session, headers=auth, timeout=timeout_s)
            except requests.RequestException as e:
                report.transport_errors += 1
                _example(report, f"{type(e).__name__}: {e}\n{case.as_curl_command(headers=auth)}")
                return
            report.by_status[response.status_code] += 1
            report.server_errors += response.status_code >= 500
            try:
                case.validate_response(response, checks=checks, headers=auth)
            except Exception as e:  # schemathesis' FailureGroup: one entry per failed check
                for failure in getattr(e, "exceptions", [e]):
                    report.failed_checks[getattr(failure, "title", type(failure).__name__)] += 1
                _example(report, str(e))
            if report.sent % 100 == 0:
                log(f"  {report.sent} requests, {time.monotonic() - t0:.0f} s, statuses {dict(report.by_status)}")

        batch = 0
        while report.sent < cases and time.monotonic() < deadline:  # hypothesis may stop a batch early
            run = hypothesis.settings(max_examples=cases - report.sent, deadline=None, database=None,
                                      phases=[hypothesis.Phase.generate], print_blob=False,
                                      suppress_health_check=list(hypothesis.HealthCheck))(
                hypothesis.seed(seed + batch)(hypothesis.given(case=strategy)(one)))
            run()
            batch += 1
        report.elapsed_s = time.monotonic() - t0
        report.pages_free, report.pages = pages_after(client, grace_s)
        health = client.get("/health")
        report.healthy = health.status_code == 200
        report.reference_after = reference(client, model)
    if report.reference_before[0] != 200 or report.reference_before[2] != 200:
        report.problems.append(f"the reference requests failed: {report.reference_before!r}")
    if report.sent < cases:
        report.problems.append(f"only {report.sent} of {cases} requests fit in {seconds:.0f} s")
    return report


def _example(report: FuzzReport, text: str) -> None:
    if len(report.examples) < MAX_FAILURE_EXAMPLES:
        report.examples.append(text[:3000])


class ServerProcess:
    """`python -m dspark_jax.serve --host 127.0.0.1 --port 0 <args>` until it prints its URL; stops on exit."""

    def __init__(self, args: list[str], startup_s: float):
        self.cmd = [sys.executable, "-m", "dspark_jax.serve", "--host", "127.0.0.1", "--port", "0", *args]
        self.startup_s, self.url, self.lines = startup_s, None, collections.deque(maxlen=50)

    def __enter__(self) -> ServerProcess:
        print("starting:", " ".join(self.cmd), flush=True)
        self.proc = subprocess.Popen(self.cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        found = threading.Event()

        def pump():  # keeps the pipe drained for the whole run
            for line in self.proc.stdout:
                self.lines.append(line.rstrip())
                m = re.search(r" at (http://\S+)/v1 ", line)
                if m and not found.is_set():
                    self.url = m.group(1)
                    found.set()

        threading.Thread(target=pump, daemon=True).start()
        deadline = time.monotonic() + self.startup_s
        while not found.wait(1.0):
            if self.proc.poll() is not None or time.monotonic() > deadline:
                self.__exit__()
                raise RuntimeError("the server did not start:\n" + "\n".join(self.lines))
        return self

    def alive(self) -> bool:
        return self.proc.poll() is None

    def __exit__(self, *exc) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.proc.kill()


def main(argv=None) -> int:
    from load_test import loopback_url  # the same loopback-only rule as the load test

    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--base-url", type=loopback_url, default=None,
                   help="fuzz this running server (loopback only) instead of starting one")
    p.add_argument("--cases", type=int, default=1000, help="generated requests to send (default: %(default)s)")
    p.add_argument("--minutes", type=float, default=30.0, help="time bound of the fuzzing phase (default: %(default)s)")
    p.add_argument("--max-tokens", type=int, default=8, help="cap on generated max_tokens (default: %(default)s)")
    p.add_argument("--seed", type=int, default=0, help="hypothesis seed (default: %(default)s)")
    p.add_argument("--api-key", default=None, help="the server's --api-key (also passed to a server started here)")
    p.add_argument("--no-schema-checks", action="store_true",
                   help="check only for >= 500, not status codes, content types and bodies against the schema")
    p.add_argument("--startup", type=float, default=1200.0, help="seconds allowed for the server to start")
    p.add_argument("server_args", nargs="*", help=f"flags for the server after -- (default: {' '.join(SERVER_ARGS)})")
    args = p.parse_args(argv)
    if args.cases < 1 or args.max_tokens < 1 or args.minutes <= 0:
        p.error("--cases and --max-tokens must be >= 1 and --minutes > 0")
    kw = dict(cases=args.cases, seconds=args.minutes * 60, api_key=args.api_key, seed=args.seed,
              max_tokens=args.max_tokens, schema_checks=not args.no_schema_checks)
    if args.base_url:
        report = fuzz(args.base_url, **kw)
    else:
        server_args = (args.server_args or SERVER_ARGS) + (["--api-key", args.api_key] if args.api_key else [])
        with ServerProcess(server_args, args.startup) as server:
            report = fuzz(server.url, **kw)
            if not server.alive():
                report.problems.append(f"the server process exited with {server.proc.returncode}")
    print(report.summary())
    return 0 if report.ok else 1


if __name__ == "__main__":
    sys.path.insert(0, __import__("os").path.dirname(__file__))
    sys.exit(main())
