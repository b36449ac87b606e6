"""The contract between the HTTP layer (serve/server.py) and the engine (serve/engine.py).

The server validates OpenAI requests, tokenizes, and submits one `EngineRequest` per choice (a batch of
prompts with n each gives prompts × n requests, the j-th choice of a prompt seeded seed + j). The engine runs
in its own thread and reports tokens through the request's `on_output` callback, from that thread; the server
bridges them into asyncio. Stop *strings* are the server's job (it detokenizes incrementally, truncates, and
calls `abort`); stop *token ids* (EOS and `stop_token_ids`) and `max_tokens` are the engine's.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Protocol


@dataclasses.dataclass(frozen=True, kw_only=True)
class SamplingParams:
    """Per-request sampling: temperature 0 is greedy; top_k 0, top_p 1.0 and min_p 0 disable those filters
    (min_p filters the target's distribution only: drafts are drawn without it, which stays lossless). max_tokens
    0 scores the prompt only (with prompt_logprobs): the request ends after its prefill, with no token."""

    max_tokens: int = 16
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    # OpenAI's {token id: bias in [-100, 100]} (≤ sampling.LOGIT_BIAS_MAX entries; the engine normalises it to
    # int ids), added to the target's raw logits; drafts are drawn without it, as for min_p.
    logit_bias: dict | None = None
    # vLLM's min_tokens (≤ max_tokens): the request's stop ids (EOS unless ignore_eos, and stop_token_ids) are
    # banned from the target's distribution until this many tokens are out; the server defers stop strings.
    min_tokens: int = 0
    # vLLM's penalties (dspark_jax/penalties.py), on the target's logits after logit_bias: presence and frequency
    # in [-2, 2] (0: off) on the generated tokens, repetition in [0.01, 10] (1: off) on prompt and generated ones.
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    seed: int | None = None
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    logprobs: int | None = None  # None: off; k in 0..MAX_LOGPROBS: each emitted token's logprob and the top k
    # None: off; k in 0..MAX_LOGPROBS: each prompt token's logprob and the top k (echo; from the target's prefill)
    prompt_logprobs: int | None = None


MAX_LOGPROBS = 20


class InvalidRequest(ValueError):
    """A request the engine refuses, with a message meant for the client and, where one field is at fault, its
    name in the HTTP body (`param`, as OpenAI's error object names it)."""

    def __init__(self, message: str, param: str | None = None):
        super().__init__(message)
        self.param = param


@dataclasses.dataclass(frozen=True, kw_only=True)
class TokenLogprob:
    """The target's log-probability of one emitted token (raw model distribution: log_softmax of the logits,
    before temperature and filtering, as vLLM reports by default) and the `top` most likely alternatives
    (token id, logprob), most likely first. Lossless verification makes these exactly target-only values.
    A prompt token's logprob is the same quantity at its prompt position; the first prompt token has none
    (nothing precedes it): `logprob` None and no alternatives."""

    token_id: int
    logprob: float | None
    top: tuple[tuple[int, float], ...] = ()


@dataclasses.dataclass(frozen=True, kw_only=True)
class RequestOutput:
    """New tokens of one request since its last report. `finish_reason` is set exactly once, on the last
    report: "stop" (EOS or a stop token id: that token is not in `token_ids` but in `stop_token`), "length"
    (max_tokens or the model's context) or "abort" (cancelled or failed; then `error` may hold a message)."""

    request_id: str
    token_ids: tuple[int, ...]
    finish_reason: str | None = None
    error: str | None = None
    logprobs: tuple[TokenLogprob, ...] | None = None  # aligned with token_ids when the request asked for them
    # Aligned with prompt_ids, on the first report only, when the request asked for prompt_logprobs.
    prompt_logprobs: tuple[TokenLogprob, ...] | None = None
    status: int | None = None  # with error: the HTTP status the failure maps to (4xx: the request's fault)
    # With finish_reason "stop" from EOS or a stop token id: that token, with its logprob when the request asked
    # for logprobs (else logprob None). The server reports it as vLLM does: counted in usage and listed in
    # logprobs, its text left out.
    stop_token: TokenLogprob | None = None


@dataclasses.dataclass(kw_only=True)
class EngineRequest:
    request_id: str
    prompt_ids: list[int]
    params: SamplingParams
    on_output: Callable[[RequestOutput], None]


class QueueFull(Exception):
    """The engine's waiting queue is at its bound; the server answers 429 with Retry-After."""


class EngineLike(Protocol):
    """What the server needs from an engine."""

    model_name: str
    max_model_len: int  # prompt + max_tokens must fit; the server answers 400 otherwise
    vocab_size: int  # token ids (prompts, stop_token_ids) must be in [0, vocab_size)

    def add_request(self, request: EngineRequest) -> None:
        """Queues a request (thread-safe). Raises ValueError (→ 400) for a request it can never serve: empty
        prompt, a token id outside [0, vocab_size), prompt + max_tokens over max_model_len, bad sampling values.
        With `params.prompt_logprobs` its first report carries the prompt's logprobs (`RequestOutput`).
        Raises `QueueFull` (→ 429) when its bounded waiting queue is full."""

    def abort(self, request_id: str) -> None:
        """Cancels a request (thread-safe, idempotent); its pages are freed at once. It gets a final
        RequestOutput with finish_reason "abort" unless it already finished."""

    def metrics(self) -> dict:
        """Counters and gauges for /metrics: requests_total, requests_running, requests_waiting,
        prompt_tokens_total, generation_tokens_total, steps_total, tokens_per_step (mean emitted per row-step =
        τ), acceptance_per_position (list), verify_tokens_per_pass (mean), sps_table ({bucket: steps/s}),
        free_pages, total_pages."""

    def health(self) -> bool:
        """True while the engine loop is alive."""
