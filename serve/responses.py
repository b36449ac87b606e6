"""OpenAI response bodies and stream chunks, logprobs included, and their pydantic models (for /openapi.json).

`collect` waits for a `Generation` and builds the non-streamed body; `completion_stream` / `chat_stream` turn
its events into SSE chunks (`data: {...}`, an error event if the request fails midway, then `data: [DONE]`).
They build plain dicts (cheaper than models on every chunk); the models below describe exactly those dicts, and
the fuzzer (scripts/fuzz_api.py) checks every response against them.

Logprobs come from the engine as `TokenLogprob`s (serve/types.py) and are rendered in OpenAI's shapes:
  completions: choices[i].logprobs = {tokens, token_logprobs, top_logprobs: [{token: logprob}], text_offset},
               top_logprobs holding the k alternatives plus the chosen token (so up to k + 1 entries, as OpenAI
               and vLLM answer), text_offset the character where each token's text starts; with `echo` the
               prompt's tokens come first, the first of them with null for its logprob and its alternatives;
  chat:        choices[i].logprobs = {content: [{token, logprob, bytes, top_logprobs: [{token, logprob, bytes}]}]}.
A token's string is its decoding alone (a byte-level token holding part of a character reads U+FFFD, as in
vLLM); `bytes` are that string's UTF-8. JSON has no -inf: a logprob below LOGPROB_FLOOR is reported as it.
"""

from __future__ import annotations

import functools
import json
import math
from collections.abc import AsyncIterator, Callable, Sequence
from typing import Literal

from pydantic import BaseModel

from serve.generation import Generation
from serve.protocol import APIError
from serve.types import TokenLogprob

LOGPROB_FLOOR = -9999.0  # vLLM's value for log(0)


class Usage(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int


class CompletionLogprobs(BaseModel):
    tokens: list[str]
    token_logprobs: list[float | None]  # null: an echoed prompt's first token, which nothing predicts
    top_logprobs: list[dict[str, float] | None]
    text_offset: list[int]


class CompletionChoice(BaseModel):
    index: int
    text: str
    logprobs: CompletionLogprobs | None
    finish_reason: Literal["stop", "length"] | None


class CompletionResponse(BaseModel):
    id: str
    object: Literal["text_completion"]
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: Usage | None = None


class CompletionChunkChoice(BaseModel):
    index: int
    text: str
    logprobs: CompletionLogprobs | None
    finish_reason: Literal["stop", "length"] | None


class CompletionChunk(BaseModel):
    """One SSE `data:` event of a streamed completion; with stream_options.include_usage the last one has no
    choices and the usage."""

    id: str
    object: Literal["text_completion"]
    created: int
    model: str
    choices: list[CompletionChunkChoice]
    usage: Usage | None = None


class TopLogprob(BaseModel):
    token: str
    logprob: float
    bytes: list[int] | None


class ChatTokenLogprob(TopLogprob):
    top_logprobs: list[TopLogprob]


class ChatLogprobs(BaseModel):
    content: list[ChatTokenLogprob] | None


class AssistantMessage(BaseModel):
    role: Literal["assistant"]
    content: str | None


class ChatChoice(BaseModel):
    index: int
    message: AssistantMessage
    logprobs: ChatLogprobs | None
    finish_reason: Literal["stop", "length"] | None


class ChatCompletionResponse(BaseModel):
    id: str
    object: Literal["chat.completion"]
    created: int
    model: str
    choices: list[ChatChoice]
    usage: Usage | None = None


class ChatDelta(BaseModel):
    role: Literal["assistant"] | None = None
    content: str | None = None


class ChatChunkChoice(BaseModel):
    index: int
    delta: ChatDelta
    logprobs: ChatLogprobs | None
    finish_reason: Literal["stop", "length"] | None


class ChatCompletionChunk(BaseModel):
    """One SSE `data:` event of a streamed chat completion (the first per choice carries the role)."""

    id: str
    object: Literal["chat.completion.chunk"]
    created: int
    model: str
    choices: list[ChatChunkChoice]
    usage: Usage | None = None


class ModelCard(BaseModel):
    id: str
    object: Literal["model"]
    created: int
    owned_by: str
    max_model_len: int


class ModelList(BaseModel):
    object: Literal["list"]
    data: list[ModelCard]


class TokenizeResponse(BaseModel):
    count: int
    max_model_len: int
    tokens: list[int]
    token_strs: list[str] | None = None


class DetokenizeResponse(BaseModel):
    prompt: str


class TokenizerInfo(BaseModel):
    """GET /tokenizer_info (vLLM's): what a client needs to tokenize as the server does (lm-eval's remote
    tokenizer reads it)."""

    tokenizer_class: str
    eos_token: str | None
    bos_token: str | None
    pad_token: str | None
    unk_token: str | None
    chat_template: str | None
    model_max_length: int


class ErrorDetail(BaseModel):
    message: str
    type: str
    param: str | None
    code: str | None


class ErrorResponse(BaseModel):
    error: ErrorDetail


class HealthStatus(BaseModel):
    status: Literal["ok", "unhealthy"]


class Version(BaseModel):
    """GET /version (vLLM's): the server's package version."""

    version: str


class TokenStrings:
    """token id -> its text alone, cached (logprobs name every alternative by its string)."""

    def __init__(self, decode: Callable[[Sequence[int]], str]):
        self._one = functools.lru_cache(maxsize=1 << 16)(lambda i: decode([i]))

    def __call__(self, token_id: int) -> str:
        return self._one(int(token_id))


def sse_doc(chunk: type[BaseModel]) -> dict:
    """The OpenAPI description of an SSE response whose events carry `chunk`s (schema = one event, OpenAPI 3.1)."""
    data = {"anyOf": [{"type": "string", "contentMediaType": "application/json",
                       "contentSchema": {"anyOf": [{"$ref": f"#/components/schemas/{chunk.__name__}"},
                                                   {"$ref": "#/components/schemas/ErrorResponse"}]}},
                      {"type": "string", "enum": ["[DONE]"]}],
            "description": f"a JSON {chunk.__name__}, or an ErrorResponse if the request fails midway; the last "
                           "event is the literal [DONE]"}
    return {"text/event-stream": {"schema": {"type": "object", "properties": {"data": data, "event": {
        "type": "string"}, "id": {"type": "string"}}, "required": ["data"]}}}


def _lp(x: float) -> float:
    x = float(x)
    return LOGPROB_FLOOR if math.isnan(x) or x < LOGPROB_FLOOR else x


def completion_logprobs(entries: Sequence[tuple[TokenLogprob, int]], name: TokenStrings) -> dict:
    """OpenAI's completions logprobs object for (logprob, text offset) entries."""
    out = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
    for lp, offset in entries:
        chosen = name(lp.token_id)
        out["tokens"].append(chosen)
        out["text_offset"].append(offset)
        if lp.logprob is None:  # an echoed prompt's first token
            out["token_logprobs"].append(None)
            out["top_logprobs"].append(None)
            continue
        out["token_logprobs"].append(_lp(lp.logprob))
        top = {name(t): _lp(v) for t, v in lp.top}
        top.setdefault(chosen, _lp(lp.logprob))
        out["top_logprobs"].append(top)
    return out


def chat_logprobs(entries: Sequence[tuple[TokenLogprob, int]], name: TokenStrings) -> dict:
    """OpenAI's chat logprobs object: {content: [{token, logprob, bytes, top_logprobs}]}."""

    def one(token_id: int, logprob: float) -> dict:
        s = name(token_id)
        return {"token": s, "logprob": _lp(logprob), "bytes": list(s.encode("utf-8", errors="replace"))}

    return {"content": [{**one(lp.token_id, lp.logprob), "top_logprobs": [one(t, v) for t, v in lp.top]}
                        for lp, _ in entries]}


def _sse(obj) -> str:
    return f"data: {json.dumps(obj, separators=(',', ':'), allow_nan=False)}\n\n"


async def collect(gen: Generation, head: dict, chat: bool, want_logprobs: bool, names: TokenStrings,
                   is_disconnected) -> dict:
    """Waits for every choice; the non-streamed response body."""
    entries: list[list] = [[] for _ in gen.choices]
    async for ev in gen.events(is_disconnected):
        entries[ev.index] += ev.logprobs
        if gen.choices[ev.index].error is not None:
            raise gen.choices[ev.index].error
    choices = []
    for c in gen.choices:
        if chat:
            lp = chat_logprobs(entries[c.index], names) if want_logprobs else None
            choices.append({"index": c.index, "message": {"role": "assistant", "content": c.text.text},
                            "logprobs": lp, "finish_reason": c.finish_reason})
        else:
            lp = completion_logprobs(entries[c.index], names) if want_logprobs else None
            choices.append({"index": c.index, "text": gen.text(c.index), "logprobs": lp,
                            "finish_reason": c.finish_reason})
    obj = "chat.completion" if chat else "text_completion"
    return {**head, "object": obj, "choices": choices, "usage": gen.usage()}


async def completion_stream(gen: Generation, head: dict, include_usage: bool, want_logprobs: bool,
                             names: TokenStrings) -> AsyncIterator[str]:
    head = {**head, "object": "text_completion"}
    try:
        async for ev in gen.events():
            if (err := gen.choices[ev.index].error) is not None:
                yield _sse(err.body())
                break
            lp = completion_logprobs(ev.logprobs, names) if want_logprobs else None
            yield _sse({**head, "choices": [{"index": ev.index, "text": ev.text, "logprobs": lp,
                                             "finish_reason": ev.finish_reason}]})
        else:
            if include_usage:
                yield _sse({**head, "choices": [], "usage": gen.usage()})
    except APIError as e:  # the deadline, a dead engine
        yield _sse(e.body())
    yield "data: [DONE]\n\n"


async def chat_stream(gen: Generation, head: dict, include_usage: bool, want_logprobs: bool,
                       names: TokenStrings) -> AsyncIterator[str]:
    head = {**head, "object": "chat.completion.chunk"}

    def chunk(index, delta, finish=None, logprobs=None):
        return _sse({**head, "choices": [{"index": index, "delta": delta, "logprobs": logprobs,
                                          "finish_reason": finish}]})

    for c in gen.choices:  # OpenAI opens every choice with the role and empty content
        yield chunk(c.index, {"role": "assistant", "content": ""})
    try:
        async for ev in gen.events():
            if (err := gen.choices[ev.index].error) is not None:
                yield _sse(err.body())
                break
            if ev.text or ev.logprobs:
                lp = chat_logprobs(ev.logprobs, names) if want_logprobs else None
                yield chunk(ev.index, {"content": ev.text}, logprobs=lp)
            if ev.finish_reason is not None:
                yield chunk(ev.index, {}, ev.finish_reason)
        else:
            if include_usage:
                yield _sse({**head, "choices": [], "usage": gen.usage()})
    except APIError as e:
        yield _sse(e.body())
    yield "data: [DONE]\n\n"
