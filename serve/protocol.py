"""OpenAI request models for `/v1/completions` and `/v1/chat/completions`, and the OpenAI error shape.

Requests are pydantic v2 models in strict mode (a JSON int is accepted where a float is expected, nothing
else is coerced: `"5"` is not an int, `1` is not a bool). Unknown fields are ignored, as OpenAI does.
Every failure becomes an `APIError`, which the server renders as

    {"error": {"message": ..., "type": "invalid_request_error", "param": ..., "code": ...}}

with status 400 (never FastAPI's 422); an unknown model is 404 with code "model_not_found".

Sampling fields follow OpenAI, plus vLLM's `top_k`, `stop_token_ids` and `ignore_eos`:
  * temperature in [0, 2] (0 = greedy), top_p in (0, 1], top_k >= 0 (0 or -1 = off);
  * max_tokens >= 1 (chat also accepts `max_completion_tokens`); omitted, the server picks a default;
  * stop: a string or up to 4 strings (the server truncates the text before the first match);
  * n in 1..8 choices, each its own engine request with seed seed+i.
"""

from __future__ import annotations

import json
from typing import Any, Literal

import pydantic
from pydantic import BaseModel, ConfigDict, Field, field_validator

MAX_N = 8
MAX_STOP = 4


class APIError(Exception):
    """An error the server answers with OpenAI's JSON error shape."""

    def __init__(self, message: str, *, status: int = 400, type: str = "invalid_request_error",
                 param: str | None = None, code: str | None = None):
        super().__init__(message)
        self.message, self.status, self.type, self.param, self.code = message, status, type, param, code

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


class StreamOptions(BaseModel):
    model_config = ConfigDict(strict=True, extra="ignore")

    include_usage: bool | None = None


class _Request(BaseModel):
    """Fields shared by both endpoints."""

    model_config = ConfigDict(strict=True, extra="ignore")

    model: str
    max_tokens: int | None = Field(None, ge=1)
    temperature: float | None = Field(None, ge=0.0, le=2.0)
    top_p: float | None = Field(None, gt=0.0, le=1.0)
    top_k: int | None = Field(None, ge=-1)
    seed: int | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    n: int | None = Field(None, ge=1, le=MAX_N)
    stream: bool | None = None
    stream_options: StreamOptions | None = None
    ignore_eos: bool | None = None
    user: Any = None  # accepted and ignored

    @field_validator("stop", mode="after")
    @classmethod
    def _check_stop(cls, v):
        if isinstance(v, list) and len(v) > MAX_STOP:
            raise ValueError(f"at most {MAX_STOP} stop sequences are allowed, got {len(v)}")
        if v is not None and any(s == "" for s in ([v] if isinstance(v, str) else v)):
            raise ValueError("stop sequences must be non-empty strings")
        return v

    @field_validator("stop_token_ids", mode="after")
    @classmethod
    def _check_stop_ids(cls, v):
        if v is not None and any(i < 0 for i in v):
            raise ValueError("stop_token_ids must be non-negative token ids")
        return v

    def stop_strings(self) -> tuple[str, ...]:
        if self.stop is None:
            return ()
        return (self.stop,) if isinstance(self.stop, str) else tuple(self.stop)

    @property
    def include_usage(self) -> bool:
        return bool(self.stream and self.stream_options and self.stream_options.include_usage)


class CompletionRequest(_Request):
    """`POST /v1/completions`: `prompt` is a string, a list of one string, or a list of token ids."""

    prompt: str | list[int] | list[str]

    @field_validator("prompt", mode="before")
    @classmethod
    def _check_prompt(cls, v):
        if isinstance(v, str):
            return v
        if isinstance(v, list) and v and all(isinstance(x, int) and not isinstance(x, bool) for x in v):
            if any(x < 0 for x in v):
                raise ValueError("prompt token ids must be non-negative")
            return v
        if isinstance(v, list) and v and all(isinstance(x, str) for x in v):
            if len(v) != 1:
                raise ValueError(f"only one prompt per request is supported, got {len(v)}")
            return v
        raise ValueError("prompt must be a string, a list of one string, or a non-empty list of token ids")


class ContentPart(BaseModel):
    model_config = ConfigDict(strict=True, extra="ignore")

    type: Literal["text"]
    text: str


class ChatMessage(BaseModel):
    model_config = ConfigDict(strict=True, extra="ignore")

    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[ContentPart] | None = None

    def text(self) -> str:
        """The content as one string (text parts concatenated)."""
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        return "".join(part.text for part in self.content)


class ChatCompletionRequest(_Request):
    """`POST /v1/chat/completions`: `messages` are rendered by the model's chat template."""

    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = Field(None, ge=1)

    def max_new_tokens(self) -> int | None:
        # OpenAI deprecated max_tokens for chat in favour of max_completion_tokens; the newer one wins.
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens

    def message_dicts(self) -> list[dict[str, str]]:
        return [{"role": m.role, "content": m.text()} for m in self.messages]


def parse_request(body: bytes, model_cls: type[_Request]):
    """Parses a raw request body into `model_cls`; raises APIError (400) for malformed JSON or bad fields."""
    try:
        data = json.loads(body)
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise APIError(f"malformed JSON in request body: {e}", code="invalid_json") from None
    if not isinstance(data, dict):
        raise APIError(f"request body must be a JSON object, got {type(data).__name__}", code="invalid_json")
    try:
        return model_cls.model_validate(data)
    except pydantic.ValidationError as e:
        raise validation_error(e) from None


def validation_error(e: pydantic.ValidationError) -> APIError:
    """The first validation error as an APIError naming the offending field (`messages.0.content`)."""
    err = e.errors(include_url=False)[0]
    # Union members add their type name to the location (`stop.list[str].0`); keep only real field names.
    loc = [str(p) for p in err["loc"] if isinstance(p, int) or "[" not in str(p) and p not in ("str", "int")]
    param = ".".join(loc) or None
    msg = err["msg"].removeprefix("Value error, ")
    if err["type"] == "missing":
        msg = f"'{param}' is a required property"
    elif param and err["type"] != "value_error":  # our own messages already say what is wrong
        got = err.get("input")
        shown = json.dumps(got)[:80] if _is_json(got) else type(got).__name__
        msg = f"invalid value for '{param}': {msg} (got {shown})"
    return APIError(msg, param=param, code="invalid_value" if err["type"] != "missing" else "missing_required")


def _is_json(x) -> bool:
    try:
        json.dumps(x)
        return True
    except (TypeError, ValueError):
        return False
