"""The OpenAI-compatible server (serve/server.py) against a mock engine whose outputs are computed by hand.

FakeEngine: next token = (previous token * 7 + 3 + offset) % 100, starting from the last prompt token,
where offset = seed when sampling with a seed and 0 otherwise (so greedy ignores the seed and choice i of
an n > 1 request, seeded seed + i, differs from choice 0). Tokens come `per_report` at a time from a worker
thread every `step_s`. It honours max_tokens, the model's context, stop_token_ids, EOS (id 100) unless
ignore_eos, and abort; each request holds KV "pages" from admission to its end, so tests can assert that
every way a request ends gives them back. With `logprobs=k`, token t has logprob `fake_logprob(t)` and the
alternatives `fake_top(t, k)`; with `prompt_logprobs=k` so does every prompt token but the first (None), on
the first report; max_tokens 0 ends after that report. Prompts that start with token 98 are aborted with an
error (no status: a 500), 97 with an error of status 400 (the request's fault); prompts that start with 99 make
add_request raise RuntimeError (an engine bug → 500). `queue_limit` makes add_request raise QueueFull beyond
that many waiting.

The tokenizer is a word-level `tokenizers.Tokenizer` over "t0".."t99" plus chat specials (no download);
decoding joins words with spaces, so `text(ids) == " ".join(f"t{i}")`.
"""

from __future__ import annotations

import asyncio
import math
import random
import sys
import threading
import time
import types

import httpx
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families
from starlette.testclient import TestClient
from tokenizers import Tokenizer, models, pre_tokenizers

import dspark_jax
import serve.server
from serve import cli
from serve import responses as R
from serve.server import ServerThread, build_app
from serve.stream import ChoiceText
from serve.text import ChatFormatter, TokenizerAdapter
from serve.types import EngineRequest, QueueFull, RequestOutput, TokenLogprob

MODEL = "fake-model"
EOS, IM_START, UNK = 100, 101, 102
TEMPLATE = ("{% for m in messages %}<|im_start|>{{ m['content'] }}<|im_end|>{% endfor %}"
            "{% if add_generation_prompt %}<|im_start|>{% endif %}")


def next_token(prev: int, offset: int = 0) -> int:
    return (prev * 7 + 3 + offset) % 100


def fake_logprob(t: int) -> float:
    return -0.25 - t / 64


def fake_top(t: int, k: int) -> tuple[tuple[int, float], ...]:
    """k alternatives, most likely first; the 20th (k = MAX_LOGPROBS) is -inf, which JSON cannot carry."""
    return tuple(((t + 1 + j) % 100, -1.0 - j if j < 19 else float("-inf")) for j in range(k))


def expected_ids(last_prompt_id: int, n: int, offset: int = 0) -> list[int]:
    out, t = [], last_prompt_id
    for _ in range(n):
        t = next_token(t, offset)
        out.append(t)
    return out


def text(ids) -> str:
    return " ".join(f"t{i}" for i in ids)


class FakeEngine:
    """EngineLike with hand-computable outputs, a worker thread, and page accounting."""

    model_name = MODEL
    vocab_size = UNK + 1

    def __init__(self, *, max_model_len=256, page_size=4, total_pages=256, max_batch=8, per_report=3, step_s=0.002):
        self.max_model_len, self.page_size, self.total_pages = max_model_len, page_size, total_pages
        self.max_batch, self.per_report, self.step_s = max_batch, per_report, step_s
        self.free_pages = total_pages
        self.broken = False
        self.queue_limit: int | None = None
        self.paused = False  # admit nothing: requests stay waiting
        self.no_logprobs = False  # an engine that does not implement logprobs
        self.aborted: list[str] = []
        self.added: list[EngineRequest] = []
        self._lock = threading.Lock()
        self._waiting: list[dict] = []
        self._running: dict[str, dict] = {}
        self._finals: list[tuple[EngineRequest, RequestOutput]] = []
        self._counts = dict(requests_total=0, prompt_tokens_total=0, generation_tokens_total=0, steps_total=0)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="fake-engine", daemon=True)
        self._thread.start()

    def pages_for(self, req: EngineRequest) -> int:
        return math.ceil((len(req.prompt_ids) + req.params.max_tokens) / self.page_size)

    def add_request(self, request: EngineRequest) -> None:
        if request.prompt_ids[0] == 99:
            raise RuntimeError("boom")
        if any(not 0 <= t <= UNK for t in request.prompt_ids):
            raise ValueError(f"prompt token ids must be in [0, {UNK}]")
        if len(request.prompt_ids) + request.params.max_tokens > self.max_model_len:
            raise ValueError("too long")  # the server must have caught this before
        with self._lock:
            if self.queue_limit is not None and len(self._waiting) >= self.queue_limit:
                raise QueueFull(f"{len(self._waiting)} waiting")
            self.added.append(request)
            self._counts["requests_total"] += 1
            self._waiting.append(dict(req=request, generated=[], last=request.prompt_ids[-1]))

    def abort(self, request_id: str) -> None:
        with self._lock:
            self.aborted.append(request_id)
            for i, s in enumerate(self._waiting):
                if s["req"].request_id == request_id:
                    del self._waiting[i]
                    self._finals.append((s["req"], RequestOutput(request_id=request_id, token_ids=(),
                                                                 finish_reason="abort")))
            if (s := self._running.pop(request_id, None)) is not None:
                self.free_pages += self.pages_for(s["req"])  # freed at once, as the contract says
                self._finals.append((s["req"], RequestOutput(request_id=request_id, token_ids=(),
                                                             finish_reason="abort")))

    def _step(self) -> list[tuple[EngineRequest, RequestOutput]]:
        with self._lock:
            reports, self._finals = self._finals, []
            while self._waiting and len(self._running) < self.max_batch and not self.paused:
                need = self.pages_for(self._waiting[0]["req"])
                if need > self.free_pages:
                    break
                s = self._waiting.pop(0)
                self.free_pages -= need
                self._counts["prompt_tokens_total"] += len(s["req"].prompt_ids)
                self._running[s["req"].request_id] = s
            if self._running:
                self._counts["steps_total"] += 1
            for rid, s in list(self._running.items()):
                req, p = s["req"], s["req"].params
                if req.prompt_ids[0] in (97, 98):
                    status = 400 if req.prompt_ids[0] == 97 else None
                    out = RequestOutput(request_id=rid, token_ids=(), finish_reason="abort", error="fake failure",
                                        status=status)
                    finish = "abort"
                else:
                    offset = p.seed if p.temperature > 0 and p.seed is not None else 0
                    new, finish, stop = [], "length" if p.max_tokens == 0 else None, None
                    for _ in range(self.per_report if p.max_tokens else 0):
                        t = next_token(s["last"], offset)
                        s["last"] = t
                        if t in p.stop_token_ids or (t == EOS and not p.ignore_eos):
                            finish = "stop"
                            want = p.logprobs is not None and not self.no_logprobs
                            stop = TokenLogprob(token_id=t, logprob=fake_logprob(t) if want else None,
                                                top=fake_top(t, p.logprobs) if want else ())
                            break
                        new.append(t)
                        if len(s["generated"]) + len(new) >= p.max_tokens:
                            finish = "length"
                            break
                    s["generated"] += new
                    self._counts["generation_tokens_total"] += len(new)
                    lps = None if p.logprobs is None or self.no_logprobs else tuple(
                        TokenLogprob(token_id=t, logprob=fake_logprob(t), top=fake_top(t, p.logprobs)) for t in new)
                    plps = None
                    if p.prompt_logprobs is not None and not s.setdefault("reported", False) and not self.no_logprobs:
                        plps = (TokenLogprob(token_id=req.prompt_ids[0], logprob=None),) + tuple(
                            TokenLogprob(token_id=t, logprob=fake_logprob(t), top=fake_top(t, p.prompt_logprobs))
                            for t in req.prompt_ids[1:])
                    s["reported"] = True
                    out = RequestOutput(request_id=rid, token_ids=tuple(new), finish_reason=finish, logprobs=lps,
                                        prompt_logprobs=plps, stop_token=stop)
                if finish is not None:
                    del self._running[rid]
                    self.free_pages += self.pages_for(req)
                reports.append((req, out))
            return reports

    def _loop(self):
        while not self._stop.wait(self.step_s):
            for req, out in self._step():  # callbacks outside the lock, like a real engine
                req.on_output(out)

    def metrics(self) -> dict:
        with self._lock:
            return {**self._counts, "requests_running": len(self._running), "requests_waiting": len(self._waiting),
                    "tokens_per_step": 2.5, "acceptance_per_position": [0.9, 0.7, 0.5],
                    "verify_tokens_per_pass": 12.0, "sps_table": {16: 50.0, 32: 45.5, "2x8@64": 7.0},
                    "free_pages": self.free_pages, "total_pages": self.total_pages}

    def health(self) -> bool:
        return self._thread.is_alive() and not self.broken

    def close(self):
        """Stops the worker thread: later requests never get another report, and health() turns False."""
        self._stop.set()
        self._thread.join()

    def wait_idle(self, timeout_s=3.0) -> bool:
        """True once every page is free again."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.free_pages == self.total_pages:
                return True
            time.sleep(0.01)
        return False


def make_tokenizer() -> Tokenizer:
    vocab = {f"t{i}": i for i in range(100)} | {"<|im_end|>": EOS, "<|im_start|>": IM_START, "<unk>": UNK}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.add_special_tokens(["<|im_end|>", "<|im_start|>", "<unk>"])
    return tok


@pytest.fixture(scope="module")
def engine():
    eng = FakeEngine()
    yield eng
    eng.close()


def app_for(engine, **kw):
    """The server app over `engine` with the word tokenizer and TEMPLATE (`build_app` keywords pass through)."""
    tok = make_tokenizer()
    return build_app(engine, tok, chat_template=ChatFormatter(TEMPLATE, TokenizerAdapter(tok).encode), **kw)


@pytest.fixture(scope="module")
def server(engine):
    with ServerThread(app_for(engine)) as s:
        yield s


@pytest.fixture
def client(server):
    return openai.OpenAI(base_url=server.base_url + "/v1", api_key="x", max_retries=0, timeout=10)


@pytest.fixture
def http(server):
    with httpx.Client(base_url=server.base_url, timeout=10) as c:
        yield c


@pytest.fixture(autouse=True)
def _pages_back(engine):
    """Every test must leave the engine with all pages free."""
    yield
    assert engine.wait_idle(), f"{engine.free_pages=} != {engine.total_pages=}"


def test_tokenizer_and_chat_template():
    tok = TokenizerAdapter(make_tokenizer())
    assert tok.encode("t1 t2") == [1, 2]
    assert tok.decode([1, 2, EOS]) == "t1 t2"
    fmt = ChatFormatter(TEMPLATE, tok.encode)
    assert fmt.render([{"role": "user", "content": "t1 t2"}]) == "<|im_start|>t1 t2<|im_end|><|im_start|>"
    assert fmt([{"role": "user", "content": "t1 t2"}]) == [IM_START, 1, 2, EOS, IM_START]


def test_completion(client, engine):
    r = client.completions.create(model=MODEL, prompt="t1", max_tokens=7, temperature=0)
    assert r.choices[0].text == text(expected_ids(1, 7))
    assert r.choices[0].finish_reason == "length"
    assert (r.usage.prompt_tokens, r.usage.completion_tokens, r.usage.total_tokens) == (1, 7, 8)
    assert r.object == "text_completion" and r.model == MODEL and r.id.startswith("cmpl-")


def test_completion_defaults_and_token_prompt(client, engine):
    r = client.completions.create(model=MODEL, prompt=[5, 6])  # OpenAI's default max_tokens is 16
    assert r.choices[0].text == text(expected_ids(6, 16))
    r = client.completions.create(model=MODEL, prompt=["t5 t6"], max_tokens=2)
    assert r.choices[0].text == text(expected_ids(6, 2)) and r.usage.prompt_tokens == 2


def test_chat(client, engine):
    r = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "t1 t2"}], max_tokens=5)
    assert r.choices[0].message.role == "assistant"
    assert r.choices[0].message.content == text(expected_ids(IM_START, 5))
    assert r.usage.prompt_tokens == 5 and r.usage.completion_tokens == 5
    assert engine.added[-1].prompt_ids == [IM_START, 1, 2, EOS, IM_START]
    r = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "t3"}],
                                       max_completion_tokens=4)
    assert r.choices[0].message.content == text(expected_ids(IM_START, 4))


def test_chat_default_max_tokens_fills_context(client, engine):
    r = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "t3"}])
    assert engine.added[-1].params.max_tokens == engine.max_model_len - 4
    assert r.usage.completion_tokens == engine.max_model_len - 4 and r.choices[0].finish_reason == "length"


def test_sampling_params_pass_through(client, engine, http):
    client.completions.create(model=MODEL, prompt="t1", max_tokens=3, temperature=0.5, top_p=0.9, seed=11,
                              extra_body={"top_k": -1, "ignore_eos": True, "stop_token_ids": [7], "user": "me"})
    p = engine.added[-1].params
    assert (p.temperature, p.top_p, p.top_k, p.seed, p.ignore_eos, p.stop_token_ids) == (0.5, 0.9, 0, 11, True, (7,))
    client.completions.create(model=MODEL, prompt="t1", max_tokens=3, extra_body={"top_k": 5})
    p = engine.added[-1].params
    assert (p.temperature, p.top_p, p.top_k, p.seed, p.min_p) == (1.0, 1.0, 5, None, 0.0)
    client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "t3"}], max_tokens=2,
                                   extra_body={"min_p": 0.05})
    assert engine.added[-1].params.min_p == 0.05
    client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "t3"}], max_tokens=2,
                                   logit_bias={"9": -100, "3": 2.5})
    assert engine.added[-1].params.logit_bias == {3: 2.5, 9: -100.0}
    client.completions.create(model=MODEL, prompt="t1", max_tokens=2, logit_bias={})
    assert engine.added[-1].params.logit_bias is None
    p = engine.added[-1].params
    assert (p.presence_penalty, p.frequency_penalty, p.repetition_penalty) == (0.0, 0.0, 1.0)
    client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "t3"}], max_tokens=2,
                                   presence_penalty=-0.5, frequency_penalty=2, extra_body={"repetition_penalty": 1.2})
    p = engine.added[-1].params
    assert (p.presence_penalty, p.frequency_penalty, p.repetition_penalty) == (-0.5, 2.0, 1.2)
    client.completions.create(model=MODEL, prompt="t1", max_tokens=3, extra_body={"min_tokens": 3})
    assert engine.added[-1].params.min_tokens == 3
    client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "t3"}],
                                   extra_body={"min_tokens": 7})  # max_tokens: the context's room
    assert engine.added[-1].params.min_tokens == 7
    for path, body in (("/v1/completions", {"prompt": "t1"}),  # max_tokens 16 by default
                       ("/v1/chat/completions", {"messages": [{"role": "user", "content": "t3"}], "max_tokens": 4})):
        r = http.post(path, json={"model": MODEL, **body, "min_tokens": 17})
        assert r.status_code == 400 and r.json()["error"]["param"] == "min_tokens", r.text


def test_n_and_seed(client, engine):
    r = client.completions.create(model=MODEL, prompt="t1", n=2, seed=5, temperature=1.0, max_tokens=4)
    by_index = {c.index: c.text for c in r.choices}
    assert by_index == {0: text(expected_ids(1, 4, 5)), 1: text(expected_ids(1, 4, 6))}
    assert [q.params.seed for q in engine.added[-2:]] == [5, 6]
    assert r.usage.completion_tokens == 8 and r.usage.prompt_tokens == 1
    r = client.completions.create(model=MODEL, prompt="t1", n=3, temperature=1.0, max_tokens=2)
    assert [q.params.seed for q in engine.added[-3:]] == [None, None, None]
    assert len({q.request_id for q in engine.added[-3:]}) == 3


def test_stop_token_ids(client):
    # t1 -> 10, 73, 14, 1, 10, ...
    r = client.completions.create(model=MODEL, prompt="t1", max_tokens=10, extra_body={"stop_token_ids": [14]})
    assert r.choices[0].text == "t10 t73" and r.choices[0].finish_reason == "stop"


def test_stop_string_truncates_and_aborts(client, engine):
    r = client.completions.create(model=MODEL, prompt="t1", max_tokens=200, stop=["t14", "zzz"])
    assert r.choices[0].text == "t10 t73 " and r.choices[0].finish_reason == "stop"
    assert engine.added[-1].request_id in engine.aborted  # the engine stopped generating for it
    assert r.usage.completion_tokens == 3  # the report that held the stop: one report of per_report tokens


def test_stop_string_waits_for_min_tokens(client, engine):
    """vLLM's min_tokens: a stop string ending in the text of the first min_tokens tokens does not count."""
    r = client.completions.create(model=MODEL, prompt="t1", max_tokens=200, stop=["t14"],
                                  extra_body={"min_tokens": 3})
    assert r.choices[0].text == "t10 t73 t14 t1 t10 t73 " and r.choices[0].finish_reason == "stop"
    assert engine.added[-1].request_id in engine.aborted


def test_include_stop_str_in_output(client, http):
    """vLLM's include_stop_str_in_output: the text ends after the stop string, or with the stop token id's text
    (then one of the choice's tokens: usage counts it once, logprobs list it with its text)."""
    extra = {"include_stop_str_in_output": True}
    r = client.completions.create(model=MODEL, prompt="t1", max_tokens=200, stop=["t14", "zzz"], extra_body=extra)
    assert r.choices[0].text == "t10 t73 t14" and r.choices[0].finish_reason == "stop"
    stream = client.completions.create(model=MODEL, prompt="t1", max_tokens=200, stop="t1 ", stream=True,
                                       extra_body=extra)
    assert "".join(c.choices[0].text for c in stream) == "t10 t73 t14 t1 "
    for include in (False, True):
        r = client.completions.create(model=MODEL, prompt="t1", max_tokens=10, logprobs=0,
                                      extra_body={"stop_token_ids": [14], "include_stop_str_in_output": include})
        c = r.choices[0]
        assert c.text == ("t10 t73 t14" if include else "t10 t73") and c.finish_reason == "stop"
        assert r.usage.completion_tokens == 3 and len(c.logprobs.tokens) == 3
        assert c.logprobs.text_offset[-1] == len("t10 t73")  # the stop token's text begins where "t10 t73" ends


def test_stop_string_streaming_holds_back_prefixes(client, engine):
    # "t1" is a prefix of "t10": the stream must not send "t1" of "t10" before it knows it is not "t1 ".
    stream = client.completions.create(model=MODEL, prompt="t1", max_tokens=200, stop="t1 ", stream=True)
    chunks = list(stream)
    assert "".join(c.choices[0].text for c in chunks) == "t10 t73 t14 "
    assert chunks[-1].choices[0].finish_reason == "stop"
    assert engine.added[-1].request_id in engine.aborted


def test_completion_stream(client):
    chunks = list(client.completions.create(model=MODEL, prompt="t2", max_tokens=8, stream=True,
                                            stream_options={"include_usage": True}))
    body = [c for c in chunks if c.choices]
    assert "".join(c.choices[0].text for c in body) == text(expected_ids(2, 8))
    assert body[-1].choices[0].finish_reason == "length"
    assert all(c.choices[0].finish_reason is None for c in body[:-1])
    assert chunks[-1].usage.completion_tokens == 8 and chunks[-1].usage.prompt_tokens == 1


def test_chat_stream_n2(client):
    stream = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "t4"}], n=2,
                                            seed=1, temperature=0.7, max_tokens=6, stream=True)
    content, finish, roles = {0: "", 1: ""}, {}, set()
    for chunk in stream:
        for c in chunk.choices:
            if c.delta.role:
                roles.add((c.index, c.delta.role))
            content[c.index] += c.delta.content or ""
            if c.finish_reason:
                finish[c.index] = c.finish_reason
    assert roles == {(0, "assistant"), (1, "assistant")}
    assert content == {0: text(expected_ids(IM_START, 6, 1)), 1: text(expected_ids(IM_START, 6, 2))}
    assert finish == {0: "length", 1: "length"}


def test_engine_abort_with_error(client, http):
    with pytest.raises(openai.InternalServerError, match="fake failure"):
        client.completions.create(model=MODEL, prompt=[98, 1], max_tokens=5)
    with pytest.raises(openai.APIError, match="fake failure"):
        list(client.completions.create(model=MODEL, prompt=[98, 1], max_tokens=5, stream=True))
    assert http.get("/health").status_code == 200


def test_models_and_health(client, http, engine):
    assert [m.id for m in client.models.list()] == [MODEL]
    r = http.get("/health")
    assert r.status_code == 200 and r.json() == {"status": "ok"}
    assert http.get("/version").json() == {"version": dspark_jax.__version__}
    engine.broken = True
    try:
        assert http.get("/health").status_code == 503
        r = http.post("/v1/completions", json={"model": MODEL, "prompt": "t1"})
        assert r.status_code == 503 and r.json()["error"]["code"] == "engine_down"
    finally:
        engine.broken = False


BAD_REQUESTS = [
    # (path, body, status, param)
    ("/v1/completions", b"{not json", 400, None),
    ("/v1/completions", b"[1, 2]", 400, None),
    ("/v1/completions", {"model": MODEL, "prompt": "t1", "max_tokens": "ten"}, 400, "max_tokens"),
    ("/v1/completions", {"model": MODEL, "prompt": "t1", "max_tokens": -3}, 400, "max_tokens"),
    ("/v1/completions", {"model": MODEL, "prompt": "t1", "max_tokens": 0}, 400, "max_tokens"),
    ("/v1/completions", {"model": MODEL, "prompt": "t1", "max_tokens": 2.5}, 400, "max_tokens"),
    ("/v1/completions", {"model": MODEL, "prompt": "t1", "top_p": 0}, 400, "top_p"),
    ("/v1/completions", {"model": MODEL, "prompt": "t1", "top_p": 1.5}, 400, "top_p"),
    ("/v1/completions", {"model": MODEL, "prompt": "t1", "temperature": 2.5}, 400, "temperature"),
    ("/v1/completions", {"model": MODEL, "prompt": "t1", "temperature": "hot"}, 400, "temperature"),
    ("/v1/completions", {"model": MODEL, "prompt": "t1", "top_k": -2}, 400, "top_k"),
    ("/v1/completions", {"model": MODEL, "prompt": "t1", "min_p": 1.5}, 400, "min_p"),
    ("/v1/completions", {"model": MODEL, "prompt": "t1", "min_p": -0.1}, 400, "min_p"),
    ("/v1/completions", {"model": MODEL, "prompt": "t1", "logit_bias": {"x": 1}}, 400, "logit_bias"),
    ("/v1/completions", {"model": MODEL, "prompt": "t1", "logit_bias": {"500": 1}}, 400, "logit_bias"),
    ("/v1/completions", {"model": MODEL, "prompt": "t1", "logit_bias": {"5": 100.5}}, 400, "logit_bias.5"),
    ("/v1/completions", {"model": MODEL, "prompt": "t1", "logit_bias": {"5": "1"}}, 400, "logit_bias.5"),
    ("/v1/completions", {"model": MODEL, "prompt": "t1", "logit_bias": [5]}, 400, "logit_bias"),
    ("/v1/chat/completions", {"model": MODEL, "messages": [{"role": "user", "content": "t1"}],
                              "logit_bias": {str(i): 1 for i in range(65)}}, 400, "logit_bias"),
    ("/v1/completions", {"model": MODEL, "prompt": "t1", "n": 129}, 400, "n"),
    ("/v1/completions", {"model": MODEL, "prompt": "t1", "stream": "yes"}, 400, "stream"),
    ("/v1/completions", {"model": MODEL, "prompt": "t1", "stop": ["a"] * 65}, 400, "stop"),
    ("/v1/completions", {"model": MODEL, "prompt": 5}, 400, "prompt"),
    ("/v1/completions", {"model": MODEL, "prompt": ["t1", [2]]}, 400, "prompt"),  # strings and ids mixed
    ("/v1/completions", {"model": MODEL, "prompt": [[1], []]}, 400, "prompt"),
    ("/v1/completions", {"model": MODEL, "prompt": ["t1", ""]}, 400, "prompt"),
    ("/v1/completions", {"model": MODEL, "prompt": [[1], [500]]}, 400, "prompt"),
    ("/v1/completions", {"model": MODEL, "prompt": ["t1"] * 129}, 400, "prompt"),
    ("/v1/completions", {"model": MODEL, "prompt": ""}, 400, "prompt"),
    ("/v1/completions", {"model": MODEL}, 400, "prompt"),
    ("/v1/completions", {"prompt": "t1"}, 400, "model"),
    ("/v1/completions", {"model": MODEL, "prompt": [500]}, 400, "prompt"),  # outside the vocabulary
    ("/v1/completions", {"model": "gpt-4", "prompt": "t1"}, 404, "model"),
    ("/v1/completions", {"model": MODEL, "prompt": "t1 " * 250, "max_tokens": 10}, 400, "prompt"),
    ("/v1/completions", {"model": MODEL, "prompt": "t1 " * 256}, 400, "prompt"),
    ("/v1/chat/completions", {"model": MODEL, "messages": "hi"}, 400, "messages"),
    ("/v1/chat/completions", {"model": MODEL, "messages": []}, 400, "messages"),
    ("/v1/chat/completions", {"model": MODEL, "messages": [{"role": "user", "content": 3}]}, 400,
     "messages.0.content"),
    ("/v1/chat/completions", {"model": MODEL, "messages": [{"role": "user", "content": "t1"}],
                              "max_completion_tokens": 300}, 400, "messages"),
    ("/v1/chat/completions", {"model": "nope", "messages": [{"role": "user", "content": "t1"}]}, 404, "model"),
    ("/v1/nowhere", {}, 404, None),
]


@pytest.mark.parametrize("path,body,status,param", BAD_REQUESTS)
def test_bad_requests(http, path, body, status, param):
    r = (http.post(path, content=body, headers={"content-type": "application/json"}) if isinstance(body, bytes)
         else http.post(path, json=body))
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert err["message"] and err["type"] == "invalid_request_error" and err["param"] == param, err
    if status == 404 and path != "/v1/nowhere":
        assert err["code"] == "model_not_found"
    if "context" in err["message"]:
        assert err["code"] == "context_length_exceeded" and "256" in err["message"]
    assert http.get("/health").status_code == 200


def test_unexpected_exception_is_500_and_server_lives(http, client):
    r = http.post("/v1/completions", json={"model": MODEL, "prompt": [99], "max_tokens": 2})
    assert r.status_code == 500 and r.json()["error"]["type"] == "server_error"
    assert client.completions.create(model=MODEL, prompt="t1", max_tokens=2).choices[0].text == "t10 t73"


def test_metrics(http, client):
    client.completions.create(model=MODEL, prompt="t1", max_tokens=2)
    r = http.get("/metrics")
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/plain")
    fams = {f.name: f for f in text_string_to_metric_families(r.text)}
    for name in ("requests", "prompt_tokens", "generation_tokens", "steps"):
        assert fams[f"dspark_{name}"].type == "counter"
    for name in ("requests_running", "requests_waiting", "tokens_per_step", "verify_tokens_per_pass",
                 "free_pages", "total_pages", "engine_healthy"):
        assert fams[f"dspark_{name}"].type == "gauge"
    value = {s.name: s.value for f in fams.values() for s in f.samples if not s.labels}
    assert value["dspark_free_pages"] == value["dspark_total_pages"] == 256
    assert value["dspark_requests_total"] >= 1 and value["dspark_tokens_per_step"] == 2.5
    acc = {s.labels["position"]: s.value for s in fams["dspark_acceptance_rate"].samples}
    assert acc == {"1": 0.9, "2": 0.7, "3": 0.5}
    assert {s.labels["bucket"]: s.value for s in fams["dspark_sps"].samples} == {"16": 50.0, "32": 45.5, "2x8@64": 7.0}
    http_counts = {(s.labels["endpoint"], s.labels["status"]) for s in fams["dspark_http_requests"].samples
                   if s.name.endswith("_total")}
    assert ("completions", "200") in http_counts


def test_disconnect_mid_stream_aborts(http, engine):
    engine.step_s, engine.per_report = 0.01, 1  # 200 reports: 2 s unless aborted
    try:
        body = {"model": MODEL, "prompt": "t1", "max_tokens": 200, "stream": True}
        with http.stream("POST", "/v1/completions", json=body) as r:
            seen = 0
            for line in r.iter_lines():
                seen += line.startswith("data: ")
                if seen == 3:
                    # Checked before `break`: leaving the loop closes iter_lines, which closes the connection.
                    rid = engine.added[-1].request_id
                    assert engine.free_pages < engine.total_pages and rid not in engine.aborted
                    break
        assert engine.wait_idle(), "pages not returned after the client went away"
        assert rid in engine.aborted
    finally:
        engine.step_s, engine.per_report = 0.002, 3


def test_disconnect_while_waiting_aborts(server, engine):
    engine.step_s, engine.per_report = 0.02, 1  # 240 reports: 4.8 s unless aborted, far longer than the client waits
    try:
        with pytest.raises(httpx.ReadTimeout):
            httpx.post(server.base_url + "/v1/completions", timeout=0.3,
                       json={"model": MODEL, "prompt": "t1", "max_tokens": 240})
        rid = engine.added[-1].request_id
        assert engine.wait_idle(), "pages not returned after the client went away"
        assert rid in engine.aborted
    finally:
        engine.step_s, engine.per_report = 0.002, 3


def test_concurrent_streams(server):
    async def one(c: httpx.AsyncClient, i: int) -> str:
        body = {"model": MODEL, "prompt": f"t{i}", "max_tokens": 5 + i % 7, "stream": True, "temperature": 0}
        out = ""
        async with c.stream("POST", "/v1/completions", json=body) as r:
            async for line in r.aiter_lines():
                if line.startswith("data: ") and line != "data: [DONE]":
                    out += httpx.Response(200, content=line[6:]).json()["choices"][0]["text"]
        return out

    async def main():
        async with httpx.AsyncClient(base_url=server.base_url, timeout=10) as c:
            return await asyncio.gather(*(one(c, i) for i in range(24)))

    for i, out in enumerate(asyncio.run(main())):
        assert out == text(expected_ids(i, 5 + i % 7)), i


def test_choice_text_holds_back_partial_characters_and_stop_prefixes():
    decode = lambda ids: bytes(ids).decode("utf-8", errors="replace")  # noqa: E731 (one token = one byte)
    t = ChoiceText(decode)
    snowman = list("☃".encode())
    assert t.add([ord("a"), snowman[0]]) == "a"  # the half character waits
    assert t.add(snowman[1:]) == "☃"
    t = ChoiceText(decode, stop=["xyz"])
    assert t.add(b"abx") == "ab"  # "x" may start "xyz"
    assert t.add(b"y") == ""
    assert t.add(b"q") == "xyq"
    assert t.add(b"xy") == "" and t.add(b"", final=True) == "xy"
    t = ChoiceText(decode, stop=["xyz", "b"])
    assert t.add(b"axyzb") == "a" and t.stopped and t.text == "a" and len(t.ids) == 5
    assert t.add(b"more") == ""
    # min_tokens: only a stop that ends past the first min_tokens tokens' text counts (one may begin inside it).
    t = ChoiceText(decode, stop=["b"], min_tokens=2)
    assert t.add(b"ab") == "ab" and not t.stopped
    assert t.add(b"cbd") == "c" and t.stopped and t.text == "abc"
    t = ChoiceText(decode, stop=["xy"], min_tokens=2)
    assert t.add(b"ax") == "a" and t.add(b"y") == "" and t.stopped and t.text == "a"
    t = ChoiceText(decode, stop=["xyz"], include_stop=True)  # nothing held back; the stop is kept
    assert t.add(b"abx") == "abx" and t.add(b"yzq") == "yz" and t.stopped and t.text == "abxyz"
    t = ChoiceText(decode, stop=["b"], min_tokens=3)
    assert t.add(b"abab") == "aba" and t.text == "aba"  # the first b (token 2) is inside, the second past


def test_cli_help_and_bad_flags(capsys):
    with pytest.raises(SystemExit) as e:
        cli.parse_args(["--help"])
    assert e.value.code == 0
    out = capsys.readouterr().out
    for flag in ("--target", "--drafter", "--scheduler", "--max-batch", "--max-model-len", "--page-size", "--host",
                 "--port", "--kernels", "--sps-out", "--log-level", "--api-key", "--max-waiting", "--request-timeout",
                 "--max-body-bytes"):
        assert flag in out
    for bad in (["--scheduler", "fixed:-1"], ["--scheduler", "fixed:x"], ["--scheduler", "threshold:2"],
                ["--scheduler", "magic"], ["--scheduler", "dspark:3"],
                ["--max-batch", "0"], ["--port", "70000"], ["--kernels", "cuda"], ["--log-level", "loud"],
                ["--drafter", "none", "--scheduler", "dspark"], ["--bogus"], ["--max-waiting", "0"],
                ["--request-timeout", "0"], ["--request-timeout", "inf"], ["--max-body-bytes", "-1"]):
        with pytest.raises(SystemExit) as e:
            cli.parse_args(bad)
        err = capsys.readouterr().err
        assert e.value.code == 2 and err.startswith("error: ") and err.count("\n") == 1, (bad, err)
    # No --scheduler: the engine picks dspark with a drafter, none without (the drafter default is "auto").
    assert cli.parse_args(["--drafter", "none"]).scheduler is None
    assert cli.parse_args([]).scheduler is None and cli.parse_args([]).drafter == "auto"
    assert cli.parse_args(["--scheduler", "fixed"]).scheduler == "fixed"  # the whole block
    assert cli.parse_args(["--scheduler", "threshold:0.4"]).scheduler == "threshold:0.4"


def test_cli_main_builds_and_serves(monkeypatch, tmp_path, capsys):
    from serve.startup import EngineConfig

    calls = {}

    def create_engine(config, **kw):
        calls["config"], calls["kw"] = config, kw
        eng = FakeEngine()
        eng.tokenizer = make_tokenizer()
        eng.chat_template = ChatFormatter(TEMPLATE, TokenizerAdapter(eng.tokenizer).encode)
        eng.exit_on_fatal = False
        calls["engine"] = eng
        return eng

    def serve_forever(app, host, port, *, log_level, on_ready):
        calls["serve"] = (host, port, log_level, [r.path for r in app.routes])
        with TestClient(app) as c:  # the flags reached the app
            assert c.post("/v1/completions", json={"model": MODEL, "prompt": "t1"}).status_code == 401
            r = c.post("/v1/completions", headers={"authorization": "Bearer k"},
                       json={"model": MODEL, "prompt": "t1 " * 20, "max_tokens": 1})
            assert r.status_code == 413
        on_ready(f"http://{host}:{port}")

    monkeypatch.setitem(sys.modules, "serve.startup", types.SimpleNamespace(create_engine=create_engine,
                                                                           EngineConfig=EngineConfig))
    monkeypatch.setattr(serve.server, "serve_forever", serve_forever)
    sps = tmp_path / "sps.json"
    assert cli.main(["--drafter", "none", "--port", "8123", "--sps-out", str(sps), "--log-level", "warning",
                     "--api-key", "k", "--max-body-bytes", "40"]) == 0
    assert calls["config"] == EngineConfig(target="smollm2-135m-instruct", drafter=None, scheduler=None,
                                           max_batch=16, max_model_len=None, page_size=16, num_pages=None,
                                           kernels="auto", mesh_shape=(1, 1), sps_table=None, sps_out=str(sps),
                                           dtype="auto", kv_dtype="auto", background=True)
    assert calls["kw"] == dict(progress=True)
    assert calls["serve"][:3] == ("127.0.0.1", 8123, "warning") and "/v1/chat/completions" in calls["serve"][3]
    assert "http://127.0.0.1:8123" in capsys.readouterr().out
    assert not calls["engine"]._thread.is_alive()  # main closes the engine on the way out
    assert calls["engine"].exit_on_fatal  # a dead engine loop ends the process


def _top(t: int, k: int, *, chosen: bool) -> dict:
    top = {f"t{a}": max(lp, -9999.0) for a, lp in fake_top(t, k)}
    return top | ({f"t{t}": fake_logprob(t)} if chosen and f"t{t}" not in top else {})


def test_completion_logprobs(client):
    ids = expected_ids(1, 5)  # 10, 73, 14, 1, 10
    r = client.completions.create(model=MODEL, prompt="t1", max_tokens=5, temperature=0, logprobs=2)
    lp = r.choices[0].logprobs
    assert lp.tokens == [f"t{t}" for t in ids]
    assert lp.token_logprobs == [fake_logprob(t) for t in ids]
    assert lp.top_logprobs == [_top(t, 2, chosen=True) for t in ids]  # k alternatives + the chosen token
    assert lp.text_offset == [0, 3, 7, 11, 14]  # "t10 t73 t14 t1 t10": each token's text starts with its space
    r0 = client.completions.create(model=MODEL, prompt="t1", max_tokens=2, logprobs=0)
    assert r0.choices[0].logprobs.top_logprobs == [{"t10": fake_logprob(10)}, {"t73": fake_logprob(73)}]
    assert client.completions.create(model=MODEL, prompt="t1", max_tokens=2).choices[0].logprobs is None
    chunks = list(client.completions.create(model=MODEL, prompt="t1", max_tokens=5, logprobs=2, stream=True))
    streamed = {k: sum((getattr(c.choices[0].logprobs, k) for c in chunks if c.choices[0].logprobs), [])
                for k in ("tokens", "token_logprobs", "top_logprobs", "text_offset")}
    assert streamed == {k: getattr(lp, k) for k in streamed}
    # A stop string cuts the text inside token 3 (" t14"): its logprob stays, the ones after it go.
    r = client.completions.create(model=MODEL, prompt="t1", max_tokens=50, logprobs=1, stop="t14")
    assert r.choices[0].text == "t10 t73 " and r.choices[0].logprobs.tokens == ["t10", "t73", "t14"]


def test_chat_logprobs(client, http):
    ids = expected_ids(IM_START, 4)
    msgs = [{"role": "user", "content": "t1"}]
    r = client.chat.completions.create(model=MODEL, messages=msgs, max_tokens=4, logprobs=True, top_logprobs=20)
    content = r.choices[0].logprobs.content
    assert [(c.token, c.logprob, c.bytes) for c in content] == [(f"t{t}", fake_logprob(t), list(f"t{t}".encode()))
                                                                 for t in ids]
    for c, t in zip(content, ids, strict=True):
        assert {a.token: a.logprob for a in c.top_logprobs} == _top(t, 20, chosen=False)
        assert len(c.top_logprobs) == 20 and c.top_logprobs[-1].logprob == -9999.0  # -inf is not JSON
    r = client.chat.completions.create(model=MODEL, messages=msgs, max_tokens=2, logprobs=True)
    assert [c.top_logprobs for c in r.choices[0].logprobs.content] == [[], []]
    chunks = list(client.chat.completions.create(model=MODEL, messages=msgs, max_tokens=4, logprobs=True,
                                                 top_logprobs=20, stream=True, n=2))
    for i in range(2):
        got = [x for c in chunks for ch in c.choices if ch.index == i and ch.logprobs for x in ch.logprobs.content]
        assert got == content
    body = http.post("/v1/chat/completions", json={"model": MODEL, "messages": msgs, "max_tokens": 4,
                                                   "logprobs": True, "top_logprobs": 20}).json()
    R.ChatCompletionResponse.model_validate(body)  # the shape /openapi.json promises


def test_openapi_schema_describes_bodies_and_responses(http):
    r = http.get("/openapi.json")
    assert r.status_code == 200
    doc = r.json()
    schemas = doc["components"]["schemas"]
    for path, req, res in (("/v1/completions", "CompletionRequest", "CompletionResponse"),
                           ("/v1/chat/completions", "ChatCompletionRequest", "ChatCompletionResponse")):
        op = doc["paths"][path]["post"]
        assert op["requestBody"]["content"]["application/json"]["schema"] == {"$ref": f"#/components/schemas/{req}"}
        ok = op["responses"]["200"]["content"]
        assert ok["application/json"]["schema"] == {"$ref": f"#/components/schemas/{res}"}
        assert "text/event-stream" in ok
        for status in ("400", "404", "413", "415", "429", "500", "503", "504"):
            assert op["responses"][status]["content"]["application/json"]["schema"]["$ref"].endswith("ErrorResponse")
        assert "422" not in op["responses"]
    assert {"messages", "logprobs", "top_logprobs", "response_format", "tools"} <= set(
        schemas["ChatCompletionRequest"]["properties"])
    assert schemas["ChatCompletionRequest"]["additionalProperties"] is False
    ids = [a for a in schemas["CompletionRequest"]["properties"]["prompt"]["anyOf"] if a["type"] == "array"
           and a["items"]["type"] == "integer"]
    assert ids[0]["items"] == {"type": "integer", "minimum": 0, "maximum": FakeEngine.vocab_size - 1}
    models = doc["paths"]["/v1/models"]["get"]["responses"]["200"]["content"]["application/json"]["schema"]
    assert models == {"$ref": "#/components/schemas/ModelList"}

    def refs(x):
        if isinstance(x, dict):
            yield from ([x["$ref"]] if "$ref" in x else [])
            for v in x.values():
                yield from refs(v)
        elif isinstance(x, list):
            for v in x:
                yield from refs(v)

    assert {ref.rsplit("/", 1)[1] for ref in refs(doc)} <= set(schemas)  # every reference resolves
    assert http.get("/docs").status_code == 200
    R.ModelList.model_validate(http.get("/v1/models").json())
    R.ErrorResponse.model_validate(http.post("/v1/completions", json={"model": MODEL}).json())


def test_choice_text_is_incremental():
    calls = []

    def decode(ids):
        calls.append(len(ids))
        return " ".join(f"t{i}" for i in ids if i != EOS)  # EOS decodes to nothing, like a skipped special

    ids = [(i * 7 + 3) % 101 for i in range(3000)]
    t = ChoiceText(decode, stop=["x" * 256])
    out = "".join(t.add(ids[i : i + 3]) for i in range(0, len(ids), 3)) + t.add([], final=True)
    assert out == t.text == decode(ids) and len(t.ends) == len(ids)
    assert sum(calls[-2 * 3000 :]) < 6 * 3000  # a few ids per decode: O(new tokens), not O(all) per report


def test_choice_text_stops_and_partial_characters_random():
    decode = lambda ids: bytes(ids).decode("utf-8", errors="replace")  # noqa: E731 (one token = one byte)
    rng = random.Random(0)
    for _ in range(2000):
        s = "".join(rng.choice("ab☃é xyz€𝄞") for _ in range(rng.randint(0, 30)))
        stops = ["".join(rng.choice("ab☃ xyz") for _ in range(rng.randint(1, 4))) for _ in range(rng.randint(0, 3))]
        data, t, out, i = s.encode(), ChoiceText(decode, stops), "", 0
        while i < len(data):
            k = rng.randint(1, 4)
            delta = t.add(data[i : i + k])
            assert "\ufffd" not in delta  # no half characters are sent
            out, i = out + delta, i + k
        out += t.add([], final=True)
        assert out == t.text and s.startswith(out), (s, stops, out)
        if any(x in s for x in stops):  # cut right before a stop string, none of which was sent
            assert t.stopped and any(s[len(out):].startswith(x) for x in stops) and not any(x in out for x in stops)
        else:
            assert out == s and not t.stopped
