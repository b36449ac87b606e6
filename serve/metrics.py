"""Prometheus metrics for `/metrics`: the engine's `metrics()` dict, read at scrape time, plus HTTP counts.

Each app gets its own `CollectorRegistry` (several apps in one process, as in tests, do not collide).
Names (all prefixed `dspark_`):

  requests_total, prompt_tokens_total, generation_tokens_total, steps_total    counters
  plain_steps_total                        steps that ran no draft pass (dspark skips drafts that do not pay)
  prefill_passes_total                     prefill passes (prompt tokens / passes: how full they were packed)
  requests_running, requests_waiting                                              gauges (queue depth)
  tokens_per_step                          τ: mean tokens emitted per request per target pass
  acceptance_rate{position="k"}            acceptance of draft position k = 1..L
  verify_tokens_per_pass                   mean tokens the target verifies per pass
  draft_gain_ratio                         dspark: ρ, accepted / predicted draft tokens (decayed, smoothed)
  sps{bucket="N"}                          profiled steps/s of a target pass over N tokens (the SPS table)
  free_pages, total_pages                  KV-cache pages
  engine_healthy                           1 while the engine loop is alive
  http_requests_total{endpoint, status}    answered by this server (counted by an ASGI middleware, so that
                                           errors raised before a route runs, e.g. 401, count too)
  server_waiting                           engine requests admitted by the server, not yet started
"""

from __future__ import annotations

import logging
import re

from prometheus_client import CollectorRegistry, Counter, Gauge, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

PREFIX = "dspark_"
log = logging.getLogger(__name__)

# engine.metrics() key -> (metric name without prefix, help). Counter names drop "_total" (the client adds it).
_COUNTERS = {
    "requests_total": ("requests", "Requests the engine accepted."),
    "prompt_tokens_total": ("prompt_tokens", "Prompt tokens prefilled."),
    "generation_tokens_total": ("generation_tokens", "Tokens generated."),
    "steps_total": ("steps", "Engine steps (target passes)."),
    "plain_steps_total": ("plain_steps", "Engine steps that ran no draft pass."),
    "prefill_passes_total": ("prefill_passes", "Prefill passes (each packs one or more requests' prompt chunks)."),
}
_GAUGES = {
    "requests_running": ("requests_running", "Requests holding a batch slot."),
    "requests_waiting": ("requests_waiting", "Requests queued for a slot."),
    "tokens_per_step": ("tokens_per_step", "Mean tokens emitted per request per step (tau)."),
    "verify_tokens_per_pass": ("verify_tokens_per_pass", "Mean tokens verified per target pass."),
    "draft_gain_ratio": ("draft_gain_ratio", "dspark: accepted over predicted draft tokens (decayed, smoothed)."),
    "free_pages": ("free_pages", "Free KV-cache pages."),
    "total_pages": ("total_pages", "All KV-cache pages."),
}


class EngineCollector:
    """Reads `engine.metrics()` and `engine.health()` on every scrape."""

    def __init__(self, engine):
        self.engine = engine

    def collect(self):
        try:
            healthy = bool(self.engine.health())
        except Exception:  # a dead engine must not take /metrics down with it
            healthy = False
        yield GaugeMetricFamily(PREFIX + "engine_healthy", "1 while the engine loop is alive.", value=int(healthy))
        try:
            m = dict(self.engine.metrics())
        except Exception:
            log.exception("engine.metrics() failed")
            return
        try:  # a malformed value must not take /metrics down either: the engine's families are skipped
            families = list(self._families(m))
        except (TypeError, ValueError):
            log.exception("engine.metrics() returned a value that is not a number")
            return
        yield from families

    def _families(self, m: dict):
        for key, (name, doc) in _COUNTERS.items():
            if m.get(key) is not None:
                yield CounterMetricFamily(PREFIX + name, doc, value=float(m[key]))
        for key, (name, doc) in _GAUGES.items():
            if m.get(key) is not None:
                yield GaugeMetricFamily(PREFIX + name, doc, value=float(m[key]))
        acc = GaugeMetricFamily(PREFIX + "acceptance_rate", "Acceptance rate of draft position k (1-based).",
                                labels=["position"])
        for k, a in enumerate(m.get("acceptance_per_position") or (), start=1):
            acc.add_metric([str(k)], float(a))
        yield acc
        sps = GaugeMetricFamily(PREFIX + "sps", "Profiled target steps per second for a pass over N tokens.",
                                labels=["bucket"])
        # Keys are capacities (ints) or shape names ("BxC@ctx"); sorted by their digits, then as text.
        for bucket, v in sorted((m.get("sps_table") or {}).items(), key=lambda kv: _natural(str(kv[0]))):
            sps.add_metric([str(bucket)], float(v))
        yield sps


def _natural(key: str) -> list:
    return [int(part) if part.isdigit() else part for part in re.split(r"(\d+)", key)]


class ServerMetrics:
    """The app's registry: the engine collector plus what the HTTP layer keeps.

    Args:
      engine: read at scrape time.
      admission: has `waiting` (serve.generation.Admission).
    """

    def __init__(self, engine, admission):
        self.registry = CollectorRegistry(auto_describe=False)
        self.registry.register(EngineCollector(engine))
        self.http_requests = Counter(PREFIX + "http_requests", "HTTP requests answered, by endpoint and status.",
                                     ["endpoint", "status"], registry=self.registry)
        waiting = Gauge(PREFIX + "server_waiting", "Engine requests admitted by the server, not yet started.",
                        registry=self.registry)
        waiting.set_function(lambda: admission.waiting)

    def render(self) -> bytes:
        return generate_latest(self.registry)

    def middleware(self, app):
        """An ASGI middleware (`app.add_middleware(metrics.middleware)`) counting responses by endpoint and status."""
        counter = self.http_requests

        async def count(scope, receive, send):
            if scope["type"] != "http":
                return await app(scope, receive, send)
            endpoint = _ENDPOINTS.get(scope.get("path", ""), "other")  # bounded label values

            async def send_counted(message):
                if message["type"] == "http.response.start":
                    counter.labels(endpoint, str(message["status"])).inc()
                await send(message)

            await app(scope, receive, send_counted)

        return count


_ENDPOINTS = {"/v1/completions": "completions", "/v1/chat/completions": "chat_completions", "/v1/models": "models",
              "/health": "health", "/metrics": "metrics"}
