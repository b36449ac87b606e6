"""OpenAI request models for `/v1/completions`, `/v1/chat/completions`, `/tokenize` and `/detokenize` (vLLM's
extension), the body checks, and the error shape.

Validation policy: every field is checked here, at the protocol boundary, before anything reaches the engine.
  * The body: JSON only (`Content-Type: application/json`, else 415), at most the server's body cap (413),
    nesting at most MAX_JSON_DEPTH levels, no NaN/Infinity literals, an object at the top (400).
  * Types are strict (pydantic strict mode: a JSON int is accepted where a float is expected, nothing else is
    coerced: `"5"` is not an int, `1` is not a bool).
  * Unknown fields are 400 naming the field (code "unknown_parameter"), as OpenAI answers: a field we do not
    know may change the output, and ignoring it would hand back an answer the client cannot tell is wrong.
  * Known fields we do not implement are accepted only at their neutral value, the one that leaves the output
    as if the field were absent; any other value is 400 naming it (code "unsupported_parameter"). See UNSUPPORTED:
    best_of = n, suffix empty,
    response_format {"type": "text"}, tools/functions absent, tool_choice/function_call "none",
    parallel_tool_calls absent; and vLLM's extras at vLLM's defaults: skip_special_tokens and
    spaces_between_special_tokens true, use_beam_search,
    stream_options.continuous_usage_stats false, and for chat continue_final_message, echo and
    add_special_tokens false.
  * vLLM's extras this server implements: completions `add_special_tokens` (default true: a string prompt gets the
    tokenizer's BOS, as vLLM encodes it), chat `add_generation_prompt` (default true) and `chat_template_kwargs`
    (more template variables, e.g. Qwen3's enable_thinking), top_k, min_p, stop_token_ids, ignore_eos, min_tokens
    (≤ max_tokens: the stop token ids, EOS unless ignore_eos, are banned and stop strings not looked for until
    min_tokens tokens are out), include_stop_str_in_output (the text ends after the stop string, or with the stop
    token id's text: that token is then one of the choice's tokens, in its logprobs with its text).
  * logit_bias (OpenAI's): at most LOGIT_BIAS_MAX token ids (as decimal strings, OpenAI's keys; in [0, vocab),
    checked by the server) mapped to biases in [-100, 100], added to the target's raw logits.
  * Penalties (dspark_jax/penalties.py, as vLLM applies them, after logit_bias): presence_penalty and
    frequency_penalty in [-2, 2] (0 off) on the generated tokens, vLLM's repetition_penalty in [0.01, 10] (1 off)
    on prompt and generated tokens.
  * Fields that never change the output are accepted and ignored: user, metadata, store, service_tier,
    prompt_cache_key, safety_identifier, priority (served first come, first served),
    stream_options.include_usage (honoured; stream_options only with stream true, as OpenAI), and a message's
    name / tool_call_id.
  * Ranges (OpenAI's, plus vLLM's top_k, min_p, stop_token_ids, ignore_eos): temperature in [0, 2] (below 1e-5 is
    greedy, 0), top_p in (0, 1], min_p in [0, 1] (0 off), top_k >= -1 (0 and -1 off; the server clamps values >=
    vocab to off, which is what keeping the whole vocabulary means), seed in int64, n in 1..MAX_N (choice i is
    seeded seed + i, wrapped in int64), max_tokens in 1..2^31-1 (and prompt + max_tokens <= the model's context,
    checked by the server; completions also take 0 with `echo`: the prompt scored, nothing generated), up to
    MAX_STOP stop strings of 1..MAX_STOP_CHARS characters (MAX_STOP_TOTAL_CHARS in all), up to MAX_STOP_TOKEN_IDS
    stop token ids, completions `logprobs` in 0..MAX_LOGPROBS, chat `logprobs` a bool and `top_logprobs` in
    0..MAX_LOGPROBS (only with logprobs true), at most MAX_MESSAGES messages. Token ids (prompt and stop_token_ids)
    must be in [0, vocab): the server checks them against `engine.vocab_size`. OpenAI caps completions `logprobs` at
    5; this server allows MAX_LOGPROBS (20), as vLLM does.
  * Completions `prompt`: a string, a list of token ids, or a batch of 1..MAX_PROMPTS strings or token-id
    lists; a batch gives prompts × n choices, choice i·n + j the j-th of prompt i (OpenAI's order). `echo`
    prepends each prompt to its choice's text and, with `logprobs`, the prompt tokens' logprobs (the first
    null) to its logprobs; the server bounds their cost (prompt tokens × (logprobs + 1), see serve/server.py).

Every failure is an `APIError`, which the server renders as

    {"error": {"message": ..., "type": "invalid_request_error", "param": ..., "code": ...}}

with status 400 (never FastAPI's 422); an unknown model is 404 with code "model_not_found".
"""

from __future__ import annotations

import json
import re
from typing import Annotated, Any, Literal

import numpy as np
import pydantic
from pydantic import BaseModel, ConfigDict, Field, WithJsonSchema, field_validator

from dspark_jax.penalties import PENALTY_RANGE, REPETITION_RANGE
from dspark_jax.sampling import LOGIT_BIAS_MAX
from serve.types import MAX_LOGPROBS

MAX_N = 128  # OpenAI's cap; choices beyond the server's --max-waiting are a 400 (too_many_choices)
MAX_PROMPTS = 128  # prompts in one completions request (a batch); choices = prompts × n
MAX_STOP = 64  # OpenAI allows 4; vLLM has no cap, and lm-eval sends a task's whole `until` list plus EOS
MAX_STOP_CHARS = 256
MAX_STOP_TOTAL_CHARS = 1024
MAX_STOP_TOKEN_IDS = 64
MAX_MESSAGES = 1024
MAX_JSON_DEPTH = 32
INT32_MAX = 2**31 - 1
INT64_MIN, INT64_MAX = -(2**63), 2**63 - 1


TokenId = Annotated[int, Field(ge=0)]  # and < vocab: the server checks that against the engine


def _only(neutral: dict, why: str) -> WithJsonSchema:
    """The JSON schema of a known-but-unimplemented field: its neutral value (or null) is all that is accepted.
    (Validation accepts OpenAI's type so that UNSUPPORTED can answer with a message that says why.)"""
    alternatives = [neutral] if neutral == {"type": "null"} else [neutral, {"type": "null"}]
    return WithJsonSchema({"anyOf": alternatives, "default": None, "description": why})


class APIError(Exception):
    """An error the server answers with OpenAI's JSON error shape (and `headers`, e.g. Retry-After)."""

    def __init__(self, message: str, *, status: int = 400, type: str | None = None, param: str | None = None,
                 code: str | None = None, headers: dict[str, str] | None = None):
        super().__init__(message)
        self.message, self.status, self.param, self.code = message, status, param, code
        self.type = type or ("invalid_request_error" if 400 <= status < 500 else "server_error")
        self.headers = headers

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


class _Strict(BaseModel):
    model_config = ConfigDict(strict=True, extra="forbid", allow_inf_nan=False)


class StreamOptions(_Strict):
    include_usage: bool | None = None
    continuous_usage_stats: Annotated[bool | None, _only({"type": "boolean", "enum": [False]}, "not implemented")] = \
        None  # vLLM's: usage in every chunk (not implemented; only false)


class _Request(_Strict):
    """Fields shared by both endpoints."""

    model: str = Field(max_length=256)
    max_tokens: int | None = Field(None, ge=1, le=INT32_MAX)
    temperature: float | None = Field(None, ge=0.0, le=2.0)
    top_p: float | None = Field(None, gt=0.0, le=1.0)
    top_k: int | None = Field(None, ge=-1, le=INT64_MAX)
    seed: int | None = Field(None, ge=INT64_MIN, le=INT64_MAX)
    stop: str | list[str] | None = None
    stop_token_ids: list[TokenId] | None = Field(None, max_length=MAX_STOP_TOKEN_IDS)
    n: int | None = Field(None, ge=1, le=MAX_N)
    stream: bool | None = None
    stream_options: StreamOptions | None = None
    ignore_eos: bool | None = None
    min_p: float | None = Field(None, ge=0.0, le=1.0)
    # OpenAI's presence/frequency penalties and vLLM's repetition_penalty (dspark_jax/penalties.py).
    presence_penalty: float | None = Field(None, ge=-PENALTY_RANGE, le=PENALTY_RANGE)
    frequency_penalty: float | None = Field(None, ge=-PENALTY_RANGE, le=PENALTY_RANGE)
    repetition_penalty: float | None = Field(None, ge=REPETITION_RANGE[0], le=REPETITION_RANGE[1])
    logit_bias: dict[str, Annotated[float, Field(ge=-100.0, le=100.0)]] | None = Field(None, max_length=LOGIT_BIAS_MAX)
    min_tokens: int | None = Field(None, ge=0, le=INT32_MAX)  # vLLM's; at most max_tokens (checked by the server)
    include_stop_str_in_output: bool | None = None  # vLLM's: the stop string (or stop token's text) ends the text
    # vLLM's sampling extras, known but unimplemented: accepted at the value vLLM defaults to (UNSUPPORTED).
    skip_special_tokens: Annotated[bool | None, _only({"type": "boolean", "enum": [True]}, "always true")] = None
    spaces_between_special_tokens: Annotated[bool | None, _only({"type": "boolean", "enum": [True]},
                                                                "always true")] = None
    use_beam_search: Annotated[bool | None, _only({"type": "boolean", "enum": [False]}, "not implemented")] = None
    # Harmless: never change the output.
    user: str | None = Field(None, max_length=256)
    metadata: dict[str, str] | None = Field(None, max_length=16)
    store: bool | None = None
    service_tier: str | None = Field(None, max_length=64)
    prompt_cache_key: str | None = Field(None, max_length=256)
    safety_identifier: str | None = Field(None, max_length=256)
    priority: int | None = Field(None, ge=INT64_MIN, le=INT64_MAX)  # vLLM's priority scheduling; served FCFS

    @field_validator("stop", mode="after")
    @classmethod
    def _check_stop(cls, v):
        stops = [v] if isinstance(v, str) else v or []
        if len(stops) > MAX_STOP:
            raise ValueError(f"at most {MAX_STOP} stop sequences are allowed, got {len(stops)}")
        if any(not 1 <= len(s) <= MAX_STOP_CHARS for s in stops):
            raise ValueError(f"stop sequences must have 1..{MAX_STOP_CHARS} characters")
        if sum(map(len, stops)) > MAX_STOP_TOTAL_CHARS:  # bounds the per-report stop search (serve/stream.py)
            raise ValueError(f"stop sequences may hold at most {MAX_STOP_TOTAL_CHARS} characters in all")
        return v

    def stop_strings(self) -> tuple[str, ...]:
        if self.stop is None:
            return ()
        return (self.stop,) if isinstance(self.stop, str) else tuple(self.stop)

    @property
    def include_usage(self) -> bool:
        return bool(self.stream and self.stream_options and self.stream_options.include_usage)

    def logprobs_k(self) -> int | None:
        """None: no logprobs; k: each token's logprob and its top k alternatives."""
        raise NotImplementedError

    def check_consistent(self) -> None:
        """Raises APIError (400) for fields that contradict each other."""
        self.logprobs_k()
        if self.stream_options is not None and not self.stream:
            raise APIError("'stream_options' is only allowed with 'stream': true", param="stream_options",
                           code="invalid_value")

    def check_supported(self) -> None:
        """Raises APIError (400) for a known parameter set to a value this server does not implement."""
        for name, (neutral, why) in UNSUPPORTED.items():
            v = getattr(self, name, None)
            if v is not None and not neutral(v, self):
                raise APIError(f"unsupported value for '{name}': {why}", param=name, code="unsupported_parameter")
        if self.stream_options is not None and self.stream_options.continuous_usage_stats:
            raise APIError("unsupported value for 'stream_options.continuous_usage_stats': usage comes in the last "
                           "chunk only (include_usage); only false is accepted",
                           param="stream_options.continuous_usage_stats", code="unsupported_parameter")


_NO_TOOLS = "tool calling is not implemented"

# field -> (is the value neutral?, what this server supports). A value that is not neutral would change the
# output or its format in a way this server does not implement.
UNSUPPORTED = {
    "best_of": (lambda v, r: v == (r.n or 1), "best_of is not implemented; it must equal n"),
    "suffix": (lambda v, r: v == "", "suffix (insertion) is not implemented"),
    "response_format": (lambda v, r: v.type == "text" and not v.model_extra,
                        'structured output is not implemented; only {"type": "text"} is accepted'),
    "tools": (lambda v, r: False, "tool calling is not implemented"),
    "functions": (lambda v, r: False, "function calling is not implemented"),
    "tool_choice": (lambda v, r: v == "none", 'tool calling is not implemented; only "none" is accepted'),
    "function_call": (lambda v, r: v == "none", 'function calling is not implemented; only "none" is accepted'),
    "parallel_tool_calls": (lambda v, r: False, "tool calling is not implemented"),
    "skip_special_tokens": (lambda v, r: v, "special tokens are always left out of the text; only true is accepted"),
    "spaces_between_special_tokens": (lambda v, r: v, "only true is accepted"),
    "use_beam_search": (lambda v, r: not v, "beam search is not implemented; only false is accepted"),
    "continue_final_message": (lambda v, r: not v, "continuing the final message is not implemented; only false "
                               "is accepted"),
    "echo": (lambda v, r: not v or not isinstance(r, ChatCompletionRequest),
             "chat echo is not implemented; only false is accepted"),
    "add_special_tokens": (lambda v, r: not v or not isinstance(r, ChatCompletionRequest),
                           "the chat template writes the special tokens; only false is accepted"),
}


TokenIds = Annotated[list[TokenId], Field(min_length=1)]


def _is_ids(v) -> bool:
    return isinstance(v, list) and bool(v) and all(isinstance(x, int) and not isinstance(x, bool) for x in v)


class CompletionRequest(_Request):
    """`POST /v1/completions`: `prompt` is a string, a list of token ids, or a batch (a list of 1..MAX_PROMPTS
    strings or token-id lists); `echo` prepends each prompt (and, with `logprobs`, its tokens' logprobs)."""

    prompt: (str | TokenIds | Annotated[list[str], Field(min_length=1, max_length=MAX_PROMPTS)]
             | Annotated[list[TokenIds], Field(min_length=1, max_length=MAX_PROMPTS)])
    max_tokens: int | None = Field(None, ge=0, le=INT32_MAX, description="0 only with echo: score the prompt")
    logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)
    echo: bool | None = None
    best_of: int | None = Field(None, ge=1, le=MAX_N, description="not implemented: must equal n")
    add_special_tokens: bool | None = Field(None, description="add the tokenizer's special tokens (e.g. BOS) to a "
                                            "string prompt; default true, as vLLM")
    suffix: Annotated[str | None, _only({"type": "string", "maxLength": 0}, "not implemented")] = \
        Field(None, max_length=MAX_STOP_CHARS)

    @field_validator("prompt", mode="before")
    @classmethod
    def _check_prompt(cls, v):
        if isinstance(v, str) or _is_ids(v):
            if isinstance(v, list) and any(x < 0 for x in v):
                raise ValueError("prompt token ids must be non-negative")
            return v
        if isinstance(v, list) and v and (all(isinstance(x, str) for x in v) or all(_is_ids(x) for x in v)):
            if len(v) > MAX_PROMPTS:
                raise ValueError(f"at most {MAX_PROMPTS} prompts per request are allowed, got {len(v)}")
            if any(isinstance(x, list) and min(x) < 0 for x in v):
                raise ValueError("prompt token ids must be non-negative")
            return v
        raise ValueError("prompt must be a string, a non-empty list of token ids, or a list of 1.."
                         f"{MAX_PROMPTS} strings or non-empty token-id lists")

    def prompts(self) -> list[str | list[int]]:
        """The prompts of the batch (one for a single string or token-id list)."""
        return [self.prompt] if isinstance(self.prompt, str) or _is_ids(self.prompt) else list(self.prompt)

    def logprobs_k(self) -> int | None:
        return self.logprobs

    def check_consistent(self) -> None:
        super().check_consistent()
        if self.max_tokens == 0 and not self.echo:
            raise APIError("'max_tokens': 0 generates nothing; it is only allowed with 'echo': true (scoring the "
                           "prompt)", param="max_tokens", code="invalid_value")


class ContentPart(_Strict):
    type: Literal["text"]
    text: str


class ChatMessage(_Strict):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[ContentPart] | None = None
    name: str | None = Field(None, max_length=256)  # harmless: templates that ignore it give the same prompt
    tool_call_id: str | None = Field(None, max_length=256)

    def text(self) -> str:
        """The content as one string (text parts concatenated)."""
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        return "".join(part.text for part in self.content)


class ResponseFormat(BaseModel):
    model_config = ConfigDict(strict=True, extra="allow")

    type: Literal["text", "json_object", "json_schema"]


# Template variables a request may not set through chat_template_kwargs: the server's own, and the tool and
# document inputs this server does not implement (the `tools` field is refused; neither may they come this way).
RESERVED_TEMPLATE_VARS = frozenset({"messages", "add_generation_prompt", "bos_token", "eos_token", "tools",
                                    "custom_tools", "builtin_tools", "functions", "tool_choice", "documents",
                                    "raise_exception", "strftime_now"})
TemplateValue = bool | int | float | Annotated[str, Field(max_length=MAX_STOP_CHARS)] | None


class _TemplateVars(_Strict):
    """What renders `messages` (the subclass's field): vLLM's `add_generation_prompt` and `chat_template_kwargs`
    (scalar values only)."""

    add_generation_prompt: bool | None = Field(None, description="end the prompt with the assistant's turn "
                                               "opening (default true)")
    chat_template_kwargs: dict[Annotated[str, Field(max_length=64)], TemplateValue] | None = \
        Field(None, max_length=32, description="more variables for the chat template, e.g. "
              "{\"enable_thinking\": false}; scalar values")

    def message_dicts(self) -> list[dict[str, str]]:
        return [{"role": m.role, "content": m.text(), **({"name": m.name} if m.name else {})} for m in self.messages]

    def template_kwargs(self) -> dict[str, Any]:
        """What the chat template renders with besides the messages (empty: the defaults)."""
        out = dict(self.chat_template_kwargs or {})
        if self.add_generation_prompt is not None:
            out["add_generation_prompt"] = self.add_generation_prompt
        return out

    def check_template_vars(self) -> None:
        reserved = RESERVED_TEMPLATE_VARS & set(self.chat_template_kwargs or ())
        if reserved:
            raise APIError(f"chat_template_kwargs may not set {sorted(reserved)}", param="chat_template_kwargs",
                           code="invalid_value")


class ChatCompletionRequest(_Request, _TemplateVars):
    """`POST /v1/chat/completions`: `messages` are rendered by the model's chat template."""

    messages: list[ChatMessage] = Field(min_length=1, max_length=MAX_MESSAGES)
    max_completion_tokens: int | None = Field(None, ge=1, le=INT32_MAX)
    logprobs: bool | None = None
    top_logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)
    response_format: Annotated[ResponseFormat | None, _only(
        {"type": "object", "properties": {"type": {"type": "string", "enum": ["text"]}}, "required": ["type"],
         "additionalProperties": False}, "structured output is not implemented")] = None
    tools: Annotated[list[dict[str, Any]] | None, _only({"type": "null"}, _NO_TOOLS)] = None
    functions: Annotated[list[dict[str, Any]] | None, _only({"type": "null"}, _NO_TOOLS)] = None
    tool_choice: Annotated[str | dict[str, Any] | None, _only({"type": "string", "enum": ["none"]}, _NO_TOOLS)] = None
    function_call: Annotated[str | dict[str, Any] | None, _only({"type": "string", "enum": ["none"]}, _NO_TOOLS)] = \
        None
    parallel_tool_calls: Annotated[bool | None, _only({"type": "null"}, _NO_TOOLS)] = None
    # vLLM's chat extras (add_generation_prompt and chat_template_kwargs: _TemplateVars).
    continue_final_message: Annotated[bool | None, _only({"type": "boolean", "enum": [False]}, "not implemented")] = \
        None
    add_special_tokens: Annotated[bool | None, _only({"type": "boolean", "enum": [False]},
                                                     "the chat template writes the special tokens")] = None
    echo: Annotated[bool | None, _only({"type": "boolean", "enum": [False]}, "not implemented")] = None

    def max_new_tokens(self) -> int | None:
        # OpenAI deprecated max_tokens for chat in favour of max_completion_tokens; the newer one wins.
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens

    def check_consistent(self) -> None:
        super().check_consistent()
        self.check_template_vars()

    def logprobs_k(self) -> int | None:
        if self.top_logprobs is not None and not self.logprobs:
            raise APIError("'top_logprobs' needs 'logprobs': true", param="top_logprobs", code="invalid_value")
        return (self.top_logprobs or 0) if self.logprobs else None


class TokenizeRequest(_TemplateVars):
    """`POST /tokenize` (vLLM's extension): a `prompt` as /v1/completions tokenizes it (the tokenizer's special
    tokens, e.g. BOS, unless `add_special_tokens` is false), or chat `messages` as /v1/chat/completions renders
    them (generation prompt included). `return_token_strs`: each token's text alone, as logprobs name tokens."""

    model: str | None = Field(None, max_length=256)
    prompt: str | None = None
    messages: list[ChatMessage] | None = Field(None, min_length=1, max_length=MAX_MESSAGES)
    add_special_tokens: bool | None = None
    return_token_strs: bool | None = None

    def check_supported(self) -> None:
        pass

    def check_consistent(self) -> None:
        if (self.prompt is None) == (self.messages is None):
            raise APIError("give exactly one of 'prompt' and 'messages'", param="prompt", code="invalid_value")
        if self.messages is not None and self.add_special_tokens:
            raise APIError("'add_special_tokens' applies to a prompt; the chat template writes its own",
                           param="add_special_tokens", code="invalid_value")
        if self.messages is None and (self.chat_template_kwargs is not None or self.add_generation_prompt is not None):
            raise APIError("'chat_template_kwargs' and 'add_generation_prompt' apply to 'messages'",
                           param="chat_template_kwargs", code="invalid_value")
        self.check_template_vars()


class DetokenizeRequest(_Strict):
    """`POST /detokenize` (vLLM's extension): token ids → text, decoded as completions text is."""

    model: str | None = Field(None, max_length=256)
    tokens: list[TokenId]

    def check_supported(self) -> None:
        pass

    def check_consistent(self) -> None:
        pass


def parse_request(body: bytes, model_cls: type[_Request]):
    """Parses a raw request body into `model_cls`; raises APIError (400) for malformed JSON or bad fields."""
    depth = json_depth(body)
    if depth > MAX_JSON_DEPTH:
        raise APIError(f"the request body nests {depth} levels deep; at most {MAX_JSON_DEPTH} are allowed",
                       code="invalid_json")
    try:
        data = json.loads(body, parse_constant=_no_constants)
    except (json.JSONDecodeError, UnicodeDecodeError, ValueError) as e:
        raise APIError(f"malformed JSON in request body: {e}", code="invalid_json") from None
    if _SURROGATE.search(body):  # "\ud800" parses to a str that no tokenizer accepts (it is not Unicode text)
        try:
            json.dumps(data, ensure_ascii=False).encode("utf-8")
        except UnicodeEncodeError:
            raise APIError("the request body holds an unpaired UTF-16 surrogate escape", code="invalid_json") from None
    if not isinstance(data, dict):
        raise APIError(f"request body must be a JSON object, got {type(data).__name__}", code="invalid_json")
    try:
        req = model_cls.model_validate(data)
    except pydantic.ValidationError as e:
        raise validation_error(e) from None
    req.check_supported()
    req.check_consistent()
    return req


def _no_constants(name: str):
    raise ValueError(f"{name} is not valid JSON")


_SURROGATE = re.compile(rb"\\u[dD][89a-fA-F]")
_STRING = re.compile(rb'"[^"\\]*(?:\\.[^"\\]*)*"')
_STEP = np.zeros(256, np.int8)
_STEP[[ord("["), ord("{")]], _STEP[[ord("]"), ord("}")]] = 1, -1


def json_depth(body: bytes) -> int:
    """The deepest nesting of [ and { in a JSON text (strings skipped), in C-speed passes: json.loads itself
    recurses once per level and overflows the stack (RecursionError) on a hostile body."""
    skeleton = _STRING.sub(b"", body)
    if not skeleton:
        return 0
    return int(np.cumsum(_STEP[np.frombuffer(skeleton, np.uint8)], dtype=np.int64).max(initial=0))


def validation_error(e: pydantic.ValidationError) -> APIError:
    """The first validation error as an APIError naming the offending field (`messages.0.content`)."""
    errors = e.errors(include_url=False)
    # An unknown field is the likeliest mistake to explain; report it before the type errors it may cause.
    err = next((x for x in errors if x["type"] == "extra_forbidden"), errors[0])
    # Union members add their type name to the location (`stop.list[str].0`); keep only real field names.
    loc = [str(p) for p in err["loc"] if isinstance(p, int) or "[" not in str(p) and p not in _UNION_TAGS]
    param = ".".join(loc) or None
    msg = err["msg"].removeprefix("Value error, ")
    code = "invalid_value"
    if err["type"] == "missing":
        msg, code = f"'{param}' is a required property", "missing_required"
    elif err["type"] == "extra_forbidden":
        msg, code = f"unrecognized request argument: '{param}'", "unknown_parameter"
    elif param and err["type"] != "value_error":  # our own messages already say what is wrong
        got = err.get("input")
        shown = json.dumps(got)[:80] if _is_json(got) else type(got).__name__
        msg = f"invalid value for '{param}': {msg} (got {shown})"
    return APIError(msg, param=param, code=code)


_UNION_TAGS = ("str", "int", "bool", "float", "ContentPart", "ResponseFormat")


def _is_json(x) -> bool:
    try:
        json.dumps(x, allow_nan=False)
        return True
    except (TypeError, ValueError):
        return False
