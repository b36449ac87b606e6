"""The OpenAI-compatible HTTP server: FastAPI app over an `EngineLike` (serve/types.py).

Endpoints: POST /v1/completions, POST /v1/chat/completions (JSON, or SSE `data: {...}` chunks ending with
`data: [DONE]` when `stream` is true), GET /v1/models, GET /health, GET /metrics (Prometheus text).

Here: validation (serve/protocol.py), tokenization, the context-length check, sampling parameters, and
the OpenAI response and chunk formats. One HTTP request becomes one `Generation` (serve/generation.py): n
engine requests (one per choice, seeds seed+i) whose outputs reach the event loop from the engine thread.
Every way a request can end early (client disconnect during a stream or while waiting for a non-streamed
answer, task cancellation, an error) aborts its unfinished engine requests, which frees their KV pages.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import threading
import time
import uuid
from collections.abc import AsyncIterator, Callable

import fastapi
import jinja2
import uvicorn
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from serve.generation import ClientDisconnected, Generation
from serve.metrics import ServerMetrics
from serve.protocol import APIError, ChatCompletionRequest, CompletionRequest, parse_request
from serve.text import as_text_tokenizer
from serve.types import EngineLike, SamplingParams

DEFAULT_COMPLETION_TOKENS = 16  # OpenAI's default max_tokens for /v1/completions
log = logging.getLogger(__name__)


class _SSEResponse(StreamingResponse):
    """A streaming response that runs `on_close` however it ends (done, client gone, cancelled)."""

    def __init__(self, content, on_close: Callable[[], None]):
        super().__init__(content, media_type="text/event-stream", headers={"Cache-Control": "no-cache"})
        self._on_close = on_close

    async def __call__(self, scope, receive, send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            self._on_close()


def _sse(obj) -> str:
    return f"data: {json.dumps(obj, separators=(',', ':'))}\n\n"


def error_response(e: APIError) -> JSONResponse:
    return JSONResponse(e.body(), status_code=e.status)


def build_app(engine: EngineLike, tokenizer, *, chat_template: Callable[[list[dict]], list[int]]) -> fastapi.FastAPI:
    """The FastAPI app serving `engine`.

    Args:
      engine: satisfies `EngineLike` (`model_name`, `max_model_len`, `add_request`, `abort`, `metrics`,
        `health`); its thread calls each request's `on_output`.
      tokenizer: the target's tokenizer: a `tokenizers.Tokenizer`, a transformers tokenizer, or anything with
        `encode(text) -> list[int]` and `decode(ids) -> str`.
      chat_template: OpenAI messages (dicts with role, content) -> prompt token ids, generation prompt
        included (e.g. `serve.text.ChatFormatter`).
    """
    tok = as_text_tokenizer(tokenizer)
    metrics = ServerMetrics(engine)
    app = fastapi.FastAPI(title="dspark-jax", description="OpenAI-compatible DSpark speculative decoding server")
    app.state.engine = engine

    @app.exception_handler(APIError)
    async def _api_error(request, e: APIError):
        return error_response(e)

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request, e: StarletteHTTPException):
        code = {404: "not_found", 405: "method_not_allowed"}.get(e.status_code)
        return error_response(APIError(str(e.detail), status=e.status_code, code=code))

    @app.exception_handler(RequestValidationError)
    async def _validation_error(request, e: RequestValidationError):
        return error_response(APIError(f"invalid request: {e.errors()}"))

    @app.exception_handler(Exception)
    async def _unexpected(request, e: Exception):
        return error_response(_internal_error(e))

    def prompt_of(req) -> list[int]:
        if isinstance(req, ChatCompletionRequest):
            try:
                ids = list(chat_template(req.message_dicts()))
            except (ValueError, jinja2.TemplateError) as e:  # e.g. the template's raise_exception("...")
                raise APIError(f"cannot apply the chat template: {e}", param="messages") from None
            param = "messages"
        else:
            p, param = req.prompt, "prompt"
            if isinstance(p, list) and isinstance(p[0], int):  # token ids, passed through
                ids = list(p)
            else:  # a string or a list of one string
                ids = tok.encode(p if isinstance(p, str) else p[0])
        if not ids:
            raise APIError("the prompt is empty", param=param)
        return ids

    def sampling_of(req, prompt_len: int) -> list[SamplingParams]:
        chat = isinstance(req, ChatCompletionRequest)
        limit, param = engine.max_model_len, "messages" if chat else "prompt"
        remaining = limit - prompt_len
        max_tokens = req.max_new_tokens() if chat else req.max_tokens
        if max_tokens is None:
            if remaining < 1:
                raise APIError(f"This model's maximum context length is {limit} tokens, but the prompt has "
                               f"{prompt_len} tokens, leaving no room for a completion. Shorten the prompt.",
                               param=param, code="context_length_exceeded")
            max_tokens = remaining if chat else min(DEFAULT_COMPLETION_TOKENS, remaining)
        elif prompt_len + max_tokens > limit:
            raise APIError(f"This model's maximum context length is {limit} tokens. However, you requested "
                           f"{prompt_len + max_tokens} tokens ({prompt_len} in the prompt, {max_tokens} for the "
                           f"completion). Reduce the prompt or max_tokens.", param=param,
                           code="context_length_exceeded")
        top_k = req.top_k if req.top_k is not None and req.top_k > 0 else 0  # 0 and -1 both mean off
        base = SamplingParams(max_tokens=max_tokens, temperature=1.0 if req.temperature is None else req.temperature,
                              top_p=1.0 if req.top_p is None else req.top_p, top_k=top_k, seed=req.seed,
                              stop_token_ids=tuple(req.stop_token_ids or ()), ignore_eos=bool(req.ignore_eos))
        return [dataclasses.replace(base, seed=None if req.seed is None else req.seed + i) for i in range(req.n or 1)]

    async def serve(request: fastapi.Request, endpoint: str, model_cls) -> Response:
        try:
            req = parse_request(await request.body(), model_cls)
            if req.model != engine.model_name:
                raise APIError(f"The model '{req.model}' does not exist; this server serves '{engine.model_name}'.",
                               status=404, param="model", code="model_not_found")
            if not engine.health():
                raise APIError("the engine is not running", status=503, type="server_error", code="engine_down")
            prompt_ids = prompt_of(req)
            params = sampling_of(req, len(prompt_ids))
            chat = model_cls is ChatCompletionRequest
            base_id = f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex}"
            gen = Generation(engine, prompt_ids, params, base_id=base_id, decode=tok.decode, stop=req.stop_strings())
            gen.submit()
            head = {"id": base_id, "created": int(time.time()), "model": engine.model_name}
            if req.stream:
                chunks = (_chat_stream if chat else _completion_stream)(gen, head, req.include_usage)
                response: Response = _SSEResponse(chunks, on_close=gen.abort)
            else:
                try:
                    response = JSONResponse(await _collect(gen, head, chat, request.is_disconnected))
                finally:
                    gen.abort()
        except APIError as e:
            response = error_response(e)
        except ClientDisconnected:
            response = Response(status_code=499)  # nginx's "client closed request"; nobody reads it
        except Exception as e:
            response = error_response(_internal_error(e))
        metrics.http_requests.labels(endpoint, str(response.status_code)).inc()
        return response

    @app.post("/v1/completions")
    async def completions(request: fastapi.Request) -> Response:
        return await serve(request, "completions", CompletionRequest)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: fastapi.Request) -> Response:
        return await serve(request, "chat_completions", ChatCompletionRequest)

    @app.get("/v1/models")
    async def models() -> dict:
        return {"object": "list", "data": [{"id": engine.model_name, "object": "model", "created": 0,
                                            "owned_by": "dspark-jax", "max_model_len": engine.max_model_len}]}

    @app.get("/health")
    async def health() -> Response:
        try:
            ok = bool(engine.health())
        except Exception:
            ok = False
        return JSONResponse({"status": "ok"} if ok else {"status": "unhealthy"}, status_code=200 if ok else 503)

    @app.get("/metrics")
    async def prometheus() -> Response:
        return Response(metrics.render(), media_type="text/plain; version=0.0.4; charset=utf-8")

    return app


def _internal_error(e: Exception) -> APIError:
    log.exception("unexpected error while serving a request", exc_info=e)
    return APIError(f"internal server error: {type(e).__name__}: {e}", status=500, type="server_error")


async def _collect(gen: Generation, head: dict, chat: bool, is_disconnected) -> dict:
    """Waits for every choice; the non-streamed response body."""
    async for index, _, finish in gen.events(is_disconnected):
        if finish == "abort":
            raise gen.engine_error(index)
    choices = []
    for c in gen.choices:
        if chat:
            choices.append({"index": c.index, "message": {"role": "assistant", "content": c.text.text},
                            "logprobs": None, "finish_reason": c.finish_reason})
        else:
            choices.append({"index": c.index, "text": c.text.text, "logprobs": None, "finish_reason": c.finish_reason})
    obj = "chat.completion" if chat else "text_completion"
    return {**head, "object": obj, "choices": choices, "usage": gen.usage()}


async def _completion_stream(gen: Generation, head: dict, include_usage: bool) -> AsyncIterator[str]:
    head = {**head, "object": "text_completion"}
    async for index, delta, finish in gen.events():
        if finish == "abort":
            yield _sse(gen.engine_error(index).body())
            break
        yield _sse({**head, "choices": [{"index": index, "text": delta, "logprobs": None, "finish_reason": finish}]})
    else:
        if include_usage:
            yield _sse({**head, "choices": [], "usage": gen.usage()})
    yield "data: [DONE]\n\n"


async def _chat_stream(gen: Generation, head: dict, include_usage: bool) -> AsyncIterator[str]:
    head = {**head, "object": "chat.completion.chunk"}

    def chunk(index, delta, finish=None):
        return _sse({**head, "choices": [{"index": index, "delta": delta, "logprobs": None, "finish_reason": finish}]})

    for c in gen.choices:  # OpenAI opens every choice with the role and empty content
        yield chunk(c.index, {"role": "assistant", "content": ""})
    async for index, delta, finish in gen.events():
        if finish == "abort":
            yield _sse(gen.engine_error(index).body())
            break
        if delta:
            yield chunk(index, {"content": delta})
        if finish is not None:
            yield chunk(index, {}, finish)
    else:
        if include_usage:
            yield _sse({**head, "choices": [], "usage": gen.usage()})
    yield "data: [DONE]\n\n"


class _Server(uvicorn.Server):
    """uvicorn.Server that reports its URL once it listens."""

    def __init__(self, config: uvicorn.Config, on_ready: Callable[[str], None] | None = None):
        super().__init__(config)
        self.on_ready = on_ready
        self.url: str | None = None

    async def startup(self, sockets=None) -> None:
        await super().startup(sockets)
        if self.started:
            host, port = self.servers[0].sockets[0].getsockname()[:2]
            self.url = f"http://{f'[{host}]' if ':' in host else host}:{port}"
            if self.on_ready is not None:
                self.on_ready(self.url)


def serve_forever(app: fastapi.FastAPI, host: str = "127.0.0.1", port: int = 8000, *, log_level: str = "info",
                  on_ready: Callable[[str], None] | None = None) -> None:
    """Serves `app` until SIGINT/SIGTERM; calls `on_ready(url)` once listening."""
    config = uvicorn.Config(app, host=host, port=port, log_level=log_level, timeout_graceful_shutdown=5)
    _Server(config, on_ready).run()


class ServerThread:
    """Runs `app` with uvicorn in a daemon thread (tests): `with ServerThread(app) as s: s.base_url`.

    Port 0 picks a free port. Entering waits until the server listens; leaving shuts it down.
    """

    def __init__(self, app: fastapi.FastAPI, host: str = "127.0.0.1", port: int = 0, *, log_level: str = "warning",
                 startup_timeout_s: float = 30.0):
        self.app, self.host, self.port, self.log_level = app, host, port, log_level
        self.startup_timeout_s = startup_timeout_s
        self.base_url: str | None = None
        self._ready = threading.Event()

    def __enter__(self) -> ServerThread:
        config = uvicorn.Config(self.app, host=self.host, port=self.port, log_level=self.log_level,
                                timeout_graceful_shutdown=2)
        self._server = _Server(config, on_ready=lambda url: self._ready.set())
        self._thread = threading.Thread(target=self._server.run, name="uvicorn", daemon=True)
        self._thread.start()
        deadline = time.monotonic() + self.startup_timeout_s
        while not self._ready.wait(0.05):
            if not self._thread.is_alive() or time.monotonic() > deadline:
                self._server.should_exit = True
                raise RuntimeError(f"uvicorn did not start on {self.host}:{self.port}")
        self.base_url = self._server.url
        return self

    def __exit__(self, *exc) -> None:
        self._server.should_exit = True
        self._thread.join(timeout=10)

