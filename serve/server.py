"""The OpenAI-compatible HTTP server: FastAPI app over an `EngineLike` (serve/types.py).

Endpoints: POST /v1/completions, POST /v1/chat/completions (JSON, or SSE `data: {...}` chunks ending with
`data: [DONE]` when `stream` is true), GET /v1/models, GET /health, GET /metrics (Prometheus text), vLLM's
GET /version, POST /tokenize, POST /detokenize and GET /tokenizer_info (the server's own tokenizer, so clients such as
lm-eval count and split tokens as the server does), and the OpenAPI schema of all of them at /openapi.json
(request bodies from serve/protocol.py, responses from serve/responses.py; /docs renders it).

A POST passes, in order: the API key (401, when the server has one), the body checks (415 not JSON, 413 over
`max_body_bytes`, 408 not sent within BODY_TIMEOUT_S), parsing and validation (400, serve/protocol.py), the model
(404), the engine's health (503), admission (429 beyond `max_waiting` requests not yet started, or the engine's
QueueFull), then tokenization and the chat template in a worker thread (the event loop never blocks on a long
prompt), the context, vocabulary and prompt-logprob checks (400), and the engine. One HTTP request becomes one
`Generation` (serve/generation.py): prompts × n engine requests (one per choice, seeds seed+j for the j-th
choice of a prompt) whose outputs reach the event loop from the engine thread.

Evaluation (`echo`): the prompt logprobs are the target's, from its prefill (whatever the drafter), computed
only for requests that ask (echo with logprobs). Their cost is bounded per request: Σ over choices of prompt
tokens × (logprobs + 1) at most `max_prompt_logprobs` (400 past it); a batch at most MAX_PROMPTS prompts and
at most `max_waiting` choices. Every way a request ends early (client disconnect during a stream or while waiting for a
non-streamed answer, task cancellation, `request_timeout_s` (504), a dead engine (503), an error) aborts its
unfinished engine requests, which frees their KV pages. A request the engine fails answers the status the engine
gives it (4xx: the request's fault; else 500), as an error event in a stream.
"""

from __future__ import annotations

import asyncio
import dataclasses
import hmac
import inspect
import logging
import threading
import time
import uuid
from collections.abc import Callable

import fastapi
import jinja2
import uvicorn
from fastapi.exceptions import RequestValidationError
from fastapi.openapi.utils import get_openapi
from fastapi.responses import JSONResponse, Response, StreamingResponse
from fastapi.security import HTTPBearer
from starlette.exceptions import HTTPException as StarletteHTTPException

import dspark_jax
from dspark_jax.sampling import check_logit_bias, check_params
from serve import responses as R
from serve.generation import Admission, ClientDisconnected, Generation, Prompt, echo_of
from serve.metrics import ServerMetrics
from serve.protocol import (
    INT64_MAX,
    APIError,
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    TokenizeRequest,
    parse_request,
)
from serve.text import TokenizerAdapter, as_text_tokenizer
from serve.types import EngineLike, SamplingParams

DEFAULT_COMPLETION_TOKENS = 16  # OpenAI's default max_tokens for /v1/completions
MAX_BODY_BYTES = 4 << 20
BODY_TIMEOUT_S = 30.0
PARSE_INLINE_BYTES = 64 << 10  # larger bodies are parsed in a worker thread
# Echo with logprobs: at most this many prompt-logprob entries per request, Σ over its choices of prompt tokens ×
# (logprobs + 1) (each token's logprob and its alternatives). 2^17 holds, say, 64 prompts of 1000 tokens at
# logprobs=1 (lm-eval's loglikelihood batches) or one 6000-token prompt at logprobs=20.
MAX_PROMPT_LOGPROBS = 1 << 17
log = logging.getLogger(__name__)

_ERRORS = {s: {"model": R.ErrorResponse, "description": d} for s, d in {
    400: "Invalid request (OpenAI error JSON naming the parameter)", 401: "Missing or wrong API key",
    404: "Unknown model", 408: "Body not received in time", 413: "Body too large", 415: "Body is not JSON",
    429: "Server at capacity (Retry-After)", 500: "Internal error", 503: "Engine not running",
    504: "Request exceeded the server's time limit"}.items()}


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


def error_response(e: APIError) -> JSONResponse:
    return JSONResponse(e.body(), status_code=e.status, headers=e.headers)


async def read_body(request: fastapi.Request, max_bytes: int) -> bytes:
    """The body of a JSON request: 415 unless `Content-Type: application/json`, 413 over `max_bytes` (by the
    declared length or while reading), 408 unless it arrives within BODY_TIMEOUT_S."""
    ctype = request.headers.get("content-type", "")
    if ctype.split(";")[0].strip().lower() != "application/json":
        raise APIError(f"the request body must be JSON with Content-Type: application/json (got {ctype!r})",
                       status=415, code="unsupported_media_type")
    declared = request.headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > max_bytes:
        raise APIError(f"the request body has {declared} bytes; at most {max_bytes} are allowed", status=413,
                       code="body_too_large")
    chunks, size = [], 0
    try:
        async with asyncio.timeout(BODY_TIMEOUT_S):
            async for chunk in request.stream():
                size += len(chunk)
                if size > max_bytes:
                    raise APIError(f"the request body exceeds {max_bytes} bytes", status=413, code="body_too_large")
                chunks.append(chunk)
    except TimeoutError:
        raise APIError(f"the request body did not arrive within {BODY_TIMEOUT_S:g} s", status=408,
                       code="timeout") from None
    return b"".join(chunks)


def _takes_kwargs(fn) -> bool:
    try:
        return any(p.kind is inspect.Parameter.VAR_KEYWORD for p in inspect.signature(fn).parameters.values())
    except (TypeError, ValueError):
        return False


def build_app(engine: EngineLike, tokenizer, *, chat_template: Callable[..., list[int]],
              api_key: str | None = None, max_waiting: int = 256, request_timeout_s: float = 600.0,
              max_body_bytes: int = MAX_BODY_BYTES, max_prompt_logprobs: int = MAX_PROMPT_LOGPROBS) -> fastapi.FastAPI:
    """The FastAPI app serving `engine`.

    Args:
      engine: satisfies `EngineLike` (`model_name`, `max_model_len`, `vocab_size`, `add_request`, `abort`,
        `metrics`, `health`); its thread calls each request's `on_output`.
      tokenizer: the target's tokenizer: a `tokenizers.Tokenizer`, a transformers tokenizer, or anything with
        `encode(text) -> list[int]` and `decode(ids) -> str`.
      chat_template: OpenAI messages (dicts with role, content) -> prompt token ids, generation prompt
        included (e.g. `serve.text.ChatFormatter`); one that takes **kwargs also gets the requests' template
        variables (`add_generation_prompt`, vLLM's `chat_template_kwargs`).
      api_key: when set, every /v1/* route needs `Authorization: Bearer <api_key>` (401 otherwise).
      max_waiting: engine requests admitted but not yet started, across the server; beyond it 429.
      request_timeout_s: a request running longer is aborted (504, or an error event in a stream).
      max_body_bytes: request bodies above it are refused (413).
      max_prompt_logprobs: most prompt-logprob entries one echo request may ask for, Σ over its choices of
        prompt tokens × (logprobs + 1); beyond it 400.
    """
    tok = as_text_tokenizer(tokenizer)
    names = R.TokenStrings(tok.decode)
    vocab = int(engine.vocab_size)
    admission = Admission(max_waiting)
    metrics = ServerMetrics(engine, admission)
    app = fastapi.FastAPI(title="dspark-jax", description="OpenAI-compatible DSpark speculative decoding server")
    app.state.engine = engine
    bearer = HTTPBearer(auto_error=False, description="The server's --api-key")

    async def require_key(request: fastapi.Request,
                          creds=fastapi.Security(bearer)) -> None:  # noqa: B008 (FastAPI's idiom)
        given = creds.credentials if creds is not None else ""
        if not hmac.compare_digest(given.encode(), api_key.encode()):
            raise APIError("Incorrect or missing API key: send 'Authorization: Bearer <key>'.", status=401,
                           code="invalid_api_key", headers={"WWW-Authenticate": "Bearer"})

    v1 = [fastapi.Depends(require_key)] if api_key else []

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

    takes_kwargs = _takes_kwargs(chat_template)

    def chat_ids(messages: list[dict], template_kwargs: dict | None = None) -> list[int]:
        if template_kwargs and not takes_kwargs:
            raise APIError("this server's chat template takes no variables (chat_template_kwargs, "
                           "add_generation_prompt)", param="chat_template_kwargs", code="unsupported_parameter")
        try:
            return list(chat_template(messages, **template_kwargs) if template_kwargs else chat_template(messages))
        except (ValueError, jinja2.TemplateError) as e:  # e.g. the template's raise_exception("...")
            raise APIError(f"cannot apply the chat template: {e}", param="messages", code="invalid_value") from None

    def encode(text: str, special: bool | None) -> list[int]:
        """A string prompt's ids: with the tokenizer's special tokens (e.g. BOS) unless `special` is False, as
        vLLM encodes completions and /tokenize prompts (a tokenizer without them: as it encodes)."""
        if isinstance(tok, TokenizerAdapter):
            return tok.encode(text, add_special_tokens=special is not False)
        if special:
            raise APIError("this server's tokenizer cannot add special tokens", param="add_special_tokens",
                           code="invalid_value")
        return tok.encode(text)

    def check_ids(ids: list[int], param: str, what: str = "the prompt") -> list[int]:
        if not ids:
            raise APIError(f"{what} is empty", param=param, code="invalid_value")
        if max(ids) >= vocab:
            raise APIError(f"{what}: token id {max(ids)} is outside the vocabulary [0, {vocab})", param=param,
                           code="invalid_value")
        return ids

    def prompts_of(req) -> list[Prompt]:
        """Runs in a worker thread: tokenization, templates and echo texts cost O(prompt)."""
        if isinstance(req, ChatCompletionRequest):
            return [Prompt(check_ids(chat_ids(req.message_dicts(), req.template_kwargs()), "messages"))]
        prompts = req.prompts()
        out = []
        for i, p in enumerate(prompts):
            what = "the prompt" if len(prompts) == 1 else f"prompt {i}"
            ids = check_ids(list(p) if isinstance(p, list) else encode(p, req.add_special_tokens), "prompt", what)
            out.append(echo_of(ids, tok.decode, p if isinstance(p, str) else None) if req.echo else Prompt(ids))
        return out

    def check_prompt_logprobs(prompts: list[Prompt], params: list[SamplingParams]) -> None:
        k = params[0].prompt_logprobs
        if k is None:
            return
        n = len(params) // len(prompts)
        tokens = n * sum(len(p.ids) for p in prompts)
        if tokens * (k + 1) > max_prompt_logprobs:
            raise APIError(f"echo with logprobs={k} over {tokens} prompt tokens (prompts × n) asks for "
                           f"{tokens * (k + 1)} prompt logprobs (tokens × (logprobs + 1)); this server returns at "
                           f"most {max_prompt_logprobs} per request. Send fewer or shorter prompts or a smaller "
                           "logprobs.", param="prompt", code="prompt_logprobs_too_large")

    def sampling_of(req, prompt_len: int, what: str = "the prompt") -> list[SamplingParams]:
        chat = isinstance(req, ChatCompletionRequest)
        limit, param = engine.max_model_len, "messages" if chat else "prompt"
        remaining = limit - prompt_len
        max_tokens = req.max_new_tokens() if chat else req.max_tokens
        if max_tokens is None:
            if remaining < 1:
                raise APIError(f"This model's maximum context length is {limit} tokens, but {what} has "
                               f"{prompt_len} tokens, leaving no room for a completion. Shorten the prompt.",
                               param=param, code="context_length_exceeded")
            max_tokens = remaining if chat else min(DEFAULT_COMPLETION_TOKENS, remaining)
        elif prompt_len + max_tokens > limit:
            raise APIError(f"This model's maximum context length is {limit} tokens. However, you requested "
                           f"{prompt_len + max_tokens} tokens ({prompt_len} in {what}, {max_tokens} for the "
                           f"completion). Reduce the prompt or max_tokens.", param=param,
                           code="context_length_exceeded")
        stop_ids = tuple(req.stop_token_ids or ())
        if stop_ids and max(stop_ids) >= vocab:
            raise APIError(f"stop token id {max(stop_ids)} is outside the vocabulary [0, {vocab})",
                           param="stop_token_ids", code="invalid_value")
        try:  # the body's bounds are checked already (serve/protocol.py); this normalises them as the engine does
            temperature, top_k, top_p = check_params(1.0 if req.temperature is None else req.temperature,
                                                     req.top_k or 0, 1.0 if req.top_p is None else req.top_p,
                                                     vocab=vocab)
        except ValueError as e:
            raise APIError(str(e), param="temperature/top_k/top_p", code="invalid_value") from None
        try:
            logit_bias = check_logit_bias(req.logit_bias, vocab) or None
        except ValueError as e:
            raise APIError(str(e), param="logit_bias", code="invalid_value") from None
        min_tokens = req.min_tokens or 0
        if min_tokens > max_tokens:
            raise APIError(f"min_tokens ({min_tokens}) must be at most max_tokens ({max_tokens})",
                           param="min_tokens", code="invalid_value")
        k = req.logprobs_k()
        base = SamplingParams(max_tokens=max_tokens, temperature=temperature, top_p=top_p, top_k=top_k,
                              min_p=req.min_p or 0.0, logit_bias=logit_bias, min_tokens=min_tokens, seed=req.seed,
                              presence_penalty=req.presence_penalty or 0.0,
                              frequency_penalty=req.frequency_penalty or 0.0,
                              repetition_penalty=1.0 if req.repetition_penalty is None else req.repetition_penalty,
                              stop_token_ids=stop_ids, ignore_eos=bool(req.ignore_eos), logprobs=k,
                              prompt_logprobs=k if not chat and req.echo else None)
        return [dataclasses.replace(base, seed=None if req.seed is None else _wrap_int64(req.seed + i))
                for i in range(req.n or 1)]

    async def serve(request: fastapi.Request, model_cls) -> Response:
        gen = None
        try:
            body = await read_body(request, max_body_bytes)
            # A multi-megabyte body takes a fraction of a second to check and parse: not on the event loop.
            req = (await asyncio.to_thread(parse_request, body, model_cls) if len(body) > PARSE_INLINE_BYTES
                   else parse_request(body, model_cls))
            if req.model != engine.model_name:
                raise APIError(f"The model '{req.model}' does not exist; this server serves '{engine.model_name}'.",
                               status=404, param="model", code="model_not_found")
            if not engine.health():
                raise APIError("the engine is not running", status=503, code="engine_down")
            chat = model_cls is ChatCompletionRequest
            choices = (1 if chat else len(req.prompts())) * (req.n or 1)
            if choices > admission.max_waiting:  # could never be admitted
                raise APIError(f"{choices} choices (prompts × n) in one request; this server takes at most "
                               f"{admission.max_waiting}", param="prompt", code="too_many_choices")
            admission.check(choices)
            prompts = await asyncio.to_thread(prompts_of, req)
            many = len(prompts) > 1
            params = [q for i, p in enumerate(prompts)
                      for q in sampling_of(req, len(p.ids), f"prompt {i}" if many else "the prompt")]
            check_prompt_logprobs(prompts, params)
            base_id = f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex}"
            gen = Generation(engine, prompts, params, base_id=base_id, decode=tok.decode, stop=req.stop_strings(),
                             include_stop=bool(req.include_stop_str_in_output),
                             admission=admission, timeout_s=request_timeout_s)
            gen.submit()
            head = {"id": base_id, "created": int(time.time()), "model": engine.model_name}
            want_logprobs = params[0].logprobs is not None
            if req.stream:
                stream = R.chat_stream if chat else R.completion_stream
                response: Response = _SSEResponse(stream(gen, head, req.include_usage, want_logprobs, names),
                                                  on_close=gen.close)
                gen = None  # the response closes it
            else:
                response = JSONResponse(await R.collect(gen, head, chat, want_logprobs, names, request.is_disconnected))
        except APIError as e:
            response = error_response(e)
        except ClientDisconnected:
            response = Response(status_code=499)  # nginx's "client closed request"; nobody reads it
        except Exception as e:
            response = error_response(_internal_error(e))
        finally:
            if gen is not None:
                gen.close()
        return response

    def body_doc(model) -> dict:
        return {"requestBody": {"required": True, "content": {
            "application/json": {"schema": {"$ref": f"#/components/schemas/{model.__name__}"}}}}}

    @app.post("/v1/completions", dependencies=v1, response_model=R.CompletionResponse, openapi_extra=body_doc(
        CompletionRequest), responses={200: {"content": R.sse_doc(R.CompletionChunk)}, **_ERRORS})
    async def completions(request: fastapi.Request) -> Response:
        """Text completion (OpenAI `POST /v1/completions`); SSE chunks when `stream` is true."""
        return await serve(request, CompletionRequest)

    @app.post("/v1/chat/completions", dependencies=v1, response_model=R.ChatCompletionResponse, openapi_extra=body_doc(
        ChatCompletionRequest), responses={200: {"content": R.sse_doc(R.ChatCompletionChunk)}, **_ERRORS})
    async def chat_completions(request: fastapi.Request) -> Response:
        """Chat completion (OpenAI `POST /v1/chat/completions`); SSE chunks when `stream` is true."""
        return await serve(request, ChatCompletionRequest)

    async def parse_small(request: fastapi.Request, model_cls):
        body = await read_body(request, max_body_bytes)
        req = (await asyncio.to_thread(parse_request, body, model_cls) if len(body) > PARSE_INLINE_BYTES
               else parse_request(body, model_cls))
        if req.model is not None and req.model != engine.model_name:
            raise APIError(f"The model '{req.model}' does not exist; this server serves '{engine.model_name}'.",
                           status=404, param="model", code="model_not_found")
        return req

    def tokenize(req: TokenizeRequest) -> dict:
        ids = (chat_ids(req.message_dicts(), req.template_kwargs()) if req.messages is not None
               else encode(req.prompt, req.add_special_tokens))
        return {"count": len(ids), "max_model_len": engine.max_model_len, "tokens": ids,
                "token_strs": [names(i) for i in ids] if req.return_token_strs else None}

    def detokenize(req: DetokenizeRequest) -> dict:
        if req.tokens and max(req.tokens) >= vocab:
            raise APIError(f"token id {max(req.tokens)} is outside the vocabulary [0, {vocab})", param="tokens",
                           code="invalid_value")
        return {"prompt": tok.decode(req.tokens)}

    tokenize_errors = {s: _ERRORS[s] for s in (400, 401, 404, 408, 413, 415, 500)}

    @app.post("/tokenize", dependencies=v1, response_model=R.TokenizeResponse, openapi_extra=body_doc(
        TokenizeRequest), responses=tokenize_errors)
    async def tokenize_route(request: fastapi.Request) -> dict:
        """Token ids of a prompt (or chat messages) as the server tokenizes them (vLLM's `POST /tokenize`)."""
        req = await parse_small(request, TokenizeRequest)
        return await asyncio.to_thread(tokenize, req)

    @app.post("/detokenize", dependencies=v1, response_model=R.DetokenizeResponse, openapi_extra=body_doc(
        DetokenizeRequest), responses=tokenize_errors)
    async def detokenize_route(request: fastapi.Request) -> dict:
        """The text of token ids, decoded as completions text is (vLLM's `POST /detokenize`)."""
        req = await parse_small(request, DetokenizeRequest)
        return await asyncio.to_thread(detokenize, req)

    info = tokenizer_info(tokenizer, engine.max_model_len)

    @app.get("/tokenizer_info", dependencies=v1, response_model=R.TokenizerInfo, responses={401: _ERRORS[401]})
    async def tokenizer_info_route() -> dict:
        """The tokenizer's class, special tokens and chat template (vLLM's `GET /tokenizer_info`)."""
        return info

    @app.get("/v1/models", dependencies=v1, response_model=R.ModelList, responses={401: _ERRORS[401]})
    async def models() -> dict:
        return {"object": "list", "data": [{"id": engine.model_name, "object": "model", "created": 0,
                                            "owned_by": "dspark-jax", "max_model_len": engine.max_model_len}]}

    @app.get("/version", response_model=R.Version)
    async def version() -> dict:
        return {"version": dspark_jax.__version__}

    @app.get("/health", response_model=R.HealthStatus, responses={503: {"model": R.HealthStatus}})
    async def health() -> Response:
        try:
            ok = bool(engine.health())
        except Exception:
            ok = False
        return JSONResponse({"status": "ok"} if ok else {"status": "unhealthy"}, status_code=200 if ok else 503)

    @app.get("/metrics", response_class=Response, responses={200: {"content": {"text/plain": {}}}})
    async def prometheus() -> Response:
        return Response(metrics.render(), media_type="text/plain; version=0.0.4; charset=utf-8")

    def openapi() -> dict:
        """FastAPI's schema plus the request bodies the routes parse themselves, token ids bounded by the vocab."""
        if app.openapi_schema is None:
            schema = get_openapi(title=app.title, version=app.version, description=app.description, routes=app.routes)
            components = schema.setdefault("components", {}).setdefault("schemas", {})
            for model in (CompletionRequest, ChatCompletionRequest, TokenizeRequest, DetokenizeRequest,
                          R.CompletionChunk, R.ChatCompletionChunk):
                doc = model.model_json_schema(ref_template="#/components/schemas/{model}")
                components.update(doc.pop("$defs", {}))
                components[model.__name__] = doc
            _bound_token_ids(components["CompletionRequest"]["properties"]["prompt"], vocab)
            _bound_token_ids(components["DetokenizeRequest"]["properties"]["tokens"], vocab)
            for model in (CompletionRequest, ChatCompletionRequest):
                _bound_token_ids(components[model.__name__]["properties"]["stop_token_ids"], vocab)
            app.openapi_schema = schema
        return app.openapi_schema

    app.openapi = openapi
    app.add_middleware(metrics.middleware)
    return app


def _bound_token_ids(prop: dict, vocab: int) -> None:
    for alt in prop.get("anyOf", [prop]):
        if alt.get("type") == "array" and alt.get("items", {}).get("type") == "integer":
            alt["items"]["maximum"] = vocab - 1
        elif alt.get("type") == "array" and alt.get("items", {}).get("type") == "array":  # a batch of id lists
            _bound_token_ids(alt["items"], vocab)


def tokenizer_info(tokenizer, max_model_len: int) -> dict:
    """/tokenizer_info's body: the special tokens and chat template a transformers tokenizer carries (None
    where the tokenizer has none, e.g. a bare `tokenizers.Tokenizer`)."""

    def attr(name):
        v = getattr(tokenizer, name, None)
        return v if isinstance(v, str) else None

    return {"tokenizer_class": type(tokenizer).__name__, "eos_token": attr("eos_token"),
            "bos_token": attr("bos_token"), "pad_token": attr("pad_token"), "unk_token": attr("unk_token"),
            "chat_template": attr("chat_template"), "model_max_length": max_model_len}


def _wrap_int64(x: int) -> int:
    return (x + INT64_MAX + 1) % (1 << 64) - INT64_MAX - 1


def _internal_error(e: Exception) -> APIError:
    log.exception("unexpected error while serving a request", exc_info=e)
    return APIError(f"internal server error: {type(e).__name__}: {e}", status=500)


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


def serve_forever(app, host: str = "127.0.0.1", port: int = 8000, *, log_level: str = "info",
                  on_ready: Callable[[str], None] | None = None) -> None:
    """Serves `app` until SIGINT/SIGTERM; calls `on_ready(url)` once listening."""
    config = uvicorn.Config(app, host=host, port=port, log_level=log_level, timeout_graceful_shutdown=5)
    _Server(config, on_ready).run()


class ServerThread:
    """Runs `app` with uvicorn in a daemon thread (tests): `with ServerThread(app) as s: s.base_url`.

    Port 0 picks a free port. Entering waits until the server listens; leaving shuts it down.
    """

    def __init__(self, app, host: str = "127.0.0.1", port: int = 0, *, log_level: str = "warning",
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
