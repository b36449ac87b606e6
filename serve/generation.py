"""One HTTP request's engine requests (one per choice) and the bridge from the engine thread into asyncio.

A request holds one or more prompts (a completions batch) and n choices per prompt: choice i·n + j is the j-th
of prompt i. The engine calls each request's `on_output` from its own thread; a per-loop `_Mailbox` moves every
`RequestOutput` onto the Generation's asyncio.Queue (one wake-up of the event loop per batch of outputs, not one
per output: an engine step at 32 requests reports 32 outputs at once), and `events()` turns them into `Event`s:
text deltas per choice (`ChoiceText`: incremental detokenization and stop strings) with the logprobs of the tokens whose
text they complete. With `echo`, a choice's first event starts with its prompt's text and, when asked, the
prompt tokens' logprobs (from the engine's first report). A stop string aborts that choice's engine request;
`close()` aborts all unfinished ones and is what every exit of a request calls.

No wait is unbounded: `events()` wakes every POLL_S to check, besides new outputs, the request's deadline
(504), the engine's health (503: a dead engine never reports again) and, for non-streamed requests, whether
the client is still there. `Admission` counts engine requests that have not produced output yet, across the
server: beyond its bound a new request is refused with 429 before it reaches the engine.
"""

from __future__ import annotations

import asyncio
import collections
import dataclasses
import logging
import threading
import weakref
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence

from serve.protocol import APIError
from serve.stream import ChoiceText
from serve.types import EngineLike, EngineRequest, QueueFull, RequestOutput, SamplingParams, TokenLogprob

POLL_S = 0.25  # how often a waiting request checks its deadline, the engine and (non-streamed) its client
RETRY_AFTER_S = 1
log = logging.getLogger(__name__)


class _Mailbox:
    """Outputs handed from the engine thread to one event loop. `post` appends and wakes the loop only when the
    box was empty (`call_soon_threadsafe` writes to the loop's self-pipe: a system call and a wake-up each), and
    the loop drains everything posted by then into the owners' queues in one callback."""

    _boxes: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
    _boxes_lock = threading.Lock()

    def __init__(self, loop: asyncio.AbstractEventLoop):
        self.loop = loop
        self.items: collections.deque = collections.deque()
        self.lock = threading.Lock()
        self.scheduled = False

    @classmethod
    def of(cls, loop: asyncio.AbstractEventLoop) -> _Mailbox:
        with cls._boxes_lock:
            box = cls._boxes.get(loop)
            if box is None:
                box = cls._boxes[loop] = cls(loop)
            return box

    def post(self, queue: asyncio.Queue, item) -> None:
        """Runs on the engine thread. Raises RuntimeError when the loop is closed."""
        with self.lock:
            self.items.append((queue, item))
            if self.scheduled:
                return
            self.scheduled = True
        try:
            self.loop.call_soon_threadsafe(self._drain)
        except RuntimeError:
            with self.lock:
                self.scheduled = False
            raise

    def _drain(self) -> None:
        with self.lock:
            items, self.items = self.items, collections.deque()
            self.scheduled = False
        for queue, item in items:
            queue.put_nowait(item)


class ClientDisconnected(Exception):
    """The client went away before its (non-streamed) answer was ready."""


class Admission:
    """Engine requests submitted but not started (no output yet), bounded by `max_waiting`."""

    def __init__(self, max_waiting: int):
        self.max_waiting, self.waiting = max_waiting, 0

    def check(self, n: int) -> None:
        if self.waiting + n > self.max_waiting:
            raise APIError(f"the server is at capacity ({self.waiting} requests waiting); retry later", status=429,
                           type="rate_limit_error", code="server_busy", headers={"Retry-After": str(RETRY_AFTER_S)})


@dataclasses.dataclass(frozen=True)
class Prompt:
    """One prompt of a request: its token ids and, with `echo`, the text echoed before each of its choices'
    text and where each prompt token's text starts in it (`offsets`, aligned with `ids`)."""

    ids: list[int]
    echo: str | None = None
    offsets: tuple[int, ...] = ()


def echo_of(ids: Sequence[int], decode: Callable[[Sequence[int]], str], text: str | None = None) -> Prompt:
    """The echo of a prompt: its text (`text` when the client sent one, else the ids decoded) and where each
    token's text starts, from the same incremental decoding as generated text (serve/stream.py)."""
    t = ChoiceText(decode)
    decoded = t.add(ids, final=True)
    return Prompt(list(ids), decoded if text is None else text, tuple(t.start(i) for i in range(len(ids))))


@dataclasses.dataclass(frozen=True)
class Event:
    """New text of one choice; `logprobs`: (logprob, start of the token's text) of each token it completes."""

    index: int
    text: str
    finish_reason: str | None
    logprobs: list[tuple[TokenLogprob, int]]


@dataclasses.dataclass
class _Choice:
    index: int
    request_id: str
    text: ChoiceText
    prompt: Prompt
    prefix: str = ""  # the echoed prompt text, once sent (the choice's text starts with it)
    echoed: bool = False
    submitted: bool = False
    started: bool = False  # left the admission count (first output, or the end)
    engine_done: bool = False  # the engine sent its final report
    finish_reason: str | None = None  # as the client sees it
    error: APIError | None = None
    logprobs: list[TokenLogprob] = dataclasses.field(default_factory=list)
    released: int = 0  # logprobs handed out so far
    stop_token: TokenLogprob | None = None  # the EOS or stop token id that ended it (no text; usage, logprobs)


class Generation:
    """The engine requests behind one HTTP request, and their outputs as asyncio events.

    `params` holds one entry per choice, prompt by prompt (len(prompts) × n; choice k belongs to prompt k // n).
    Must be created inside the event loop that consumes `events()`. `timeout_s` bounds the whole request.
    """

    def __init__(self, engine: EngineLike, prompts: Sequence[Prompt], params: Sequence[SamplingParams], *,
                 base_id: str, decode: Callable[[Sequence[int]], str], stop: Sequence[str], admission: Admission,
                 timeout_s: float, include_stop: bool = False):
        self.engine, self.prompts, self.params = engine, list(prompts), list(params)
        if not self.prompts or len(self.params) % len(self.prompts):
            raise ValueError(f"{len(self.params)} choices for {len(self.prompts)} prompts")
        n = len(self.params) // len(self.prompts)
        self.admission = admission
        self.include_stop = include_stop  # vLLM's include_stop_str_in_output
        self.loop = asyncio.get_running_loop()
        self.deadline, self.timeout_s = self.loop.time() + timeout_s, timeout_s
        self._next_check = self.loop.time() + POLL_S
        self.queue: asyncio.Queue[tuple[int, RequestOutput]] = asyncio.Queue()
        self._mailbox = _Mailbox.of(self.loop)
        self.choices = []
        for i in range(len(self.params)):
            prompt = self.prompts[i // n]
            text = ChoiceText(decode, stop, context=prompt.ids if prompt.echo is not None else (),
                              min_tokens=self.params[i].min_tokens, include_stop=include_stop)
            self.choices.append(_Choice(i, f"{base_id}-{i}", text, prompt))

    def submit(self) -> None:
        """Queues every choice. The engine's ValueError is a 400 and QueueFull a 429; either aborts the choices
        already queued."""
        self.admission.check(len(self.choices))
        for c, p in zip(self.choices, self.params, strict=True):
            req = EngineRequest(request_id=c.request_id, prompt_ids=list(c.prompt.ids), params=p,
                                on_output=self._callback(c.index))
            try:
                self.engine.add_request(req)
            except ValueError as e:
                self.close()  # the choices already queued
                raise APIError(f"the engine rejected the request: {e}", param=getattr(e, "param", None),
                               code="engine_rejected") from None
            except QueueFull as e:
                self.close()
                raise APIError(f"the engine's queue is full; retry later ({e})", status=429, type="rate_limit_error",
                               code="queue_full", headers={"Retry-After": str(RETRY_AFTER_S)}) from None
            except BaseException:
                self.close()
                raise
            c.submitted = True
            self.admission.waiting += 1

    def _callback(self, index: int) -> Callable[[RequestOutput], None]:
        def on_output(out: RequestOutput) -> None:  # runs on the engine thread
            try:
                self._mailbox.post(self.queue, (index, out))
            except RuntimeError:  # the event loop is closed: the server has shut down, nobody listens
                pass

        return on_output

    def _start(self, c: _Choice) -> None:
        if c.submitted and not c.started:
            c.started = True
            self.admission.waiting -= 1

    def close(self) -> None:
        """Aborts every engine request that has not finished (idempotent; frees their pages)."""
        for c in self.choices:
            self._start(c)
            if c.submitted and not c.engine_done:
                c.engine_done = True  # the engine's final report, if any, is not awaited
                try:
                    self.engine.abort(c.request_id)
                except Exception:  # cleanup must reach every choice
                    log.exception("engine.abort(%s) failed", c.request_id)

    async def _next(self, is_disconnected: Callable[[], Awaitable[bool]] | None) -> tuple[int, RequestOutput]:
        """The next engine output; raises APIError at the deadline or when the engine dies, ClientDisconnected."""
        while True:
            now = self.loop.time()
            if now >= self.deadline:
                raise APIError(f"the request did not finish within the server's {self.timeout_s:g} s limit",
                               status=504, code="timeout")
            # Checked on a clock, not only when idle: outputs may keep arriving for a client long gone.
            if now >= self._next_check:
                self._next_check = now + POLL_S
                if is_disconnected is not None and await is_disconnected():
                    raise ClientDisconnected
                if self.queue.empty() and not _healthy(self.engine):  # a dead engine never reports again
                    raise APIError("the engine stopped while serving this request", status=503, code="engine_down")
            try:
                return await asyncio.wait_for(self.queue.get(), min(self._next_check, self.deadline) - now)
            except TimeoutError:
                pass

    async def events(self, is_disconnected: Callable[[], Awaitable[bool]] | None = None) -> AsyncIterator[Event]:
        """Yields Events until every choice has finished; raises APIError (deadline, dead engine) or
        ClientDisconnected (with `is_disconnected`, for non-streamed requests); the caller then closes."""
        pending = len(self.choices)
        while pending:
            index, out = await self._next(is_disconnected)
            c = self.choices[index]
            self._start(c)
            final = out.finish_reason is not None
            c.engine_done |= final
            if c.finish_reason is not None:  # e.g. the engine's "abort" report after a stop string
                continue
            first_echo = c.prompt.echo is not None and not c.echoed and out.finish_reason != "abort"
            if (missing := _missing_logprobs(self.params[index], out, len(c.prompt.ids) if first_echo else None)):
                # Never answer a logprobs request without them (an engine that does not implement them).
                c.finish_reason, c.error = "abort", APIError(f"the engine returned {missing}", status=500,
                                                             code="engine_logprobs")
                if not c.engine_done:
                    c.engine_done = True
                    self.engine.abort(c.request_id)
                pending -= 1
                yield Event(index, "", c.finish_reason, [])
                continue
            echo, echoed = self._echo(c, out) if first_echo else ("", [])
            tokens, logprobs = out.token_ids, out.logprobs or ()
            if self.include_stop and out.stop_token is not None:  # the stop token is the text's last token
                tokens, logprobs = tokens + (out.stop_token.token_id,), (*logprobs, out.stop_token)
                out = dataclasses.replace(out, stop_token=None)
            c.logprobs.extend(logprobs if self.params[index].logprobs is not None else ())
            delta = echo + c.text.add(tokens, final=final)
            if c.text.stopped:
                c.finish_reason = "stop"
                if not c.engine_done:
                    c.engine_done = True
                    self.engine.abort(c.request_id)
            elif final:
                c.finish_reason = out.finish_reason
                if out.finish_reason == "abort":
                    c.error = engine_error(out)
                elif out.finish_reason == "stop":
                    c.stop_token = out.stop_token
            if c.finish_reason is not None:
                pending -= 1
            logprobs = echoed + self._release(c, everything=c.finish_reason is not None)
            if delta or c.finish_reason is not None or logprobs:
                yield Event(index, delta, c.finish_reason, logprobs)

    def _echo(self, c: _Choice, out: RequestOutput) -> tuple[str, list[tuple[TokenLogprob, int]]]:
        """The echoed prompt (text, logprob entries) to send before the choice's first tokens (once)."""
        c.prefix, c.echoed = c.prompt.echo, True
        if self.params[c.index].prompt_logprobs is None:
            return c.prefix, []
        return c.prefix, list(zip(out.prompt_logprobs, c.prompt.offsets, strict=True))

    def _release(self, c: _Choice, *, everything: bool) -> list[tuple[TokenLogprob, int]]:
        """The logprobs of the tokens whose text has now been sent (all the visible ones once finished); their
        offsets count from the start of the choice's text, the echoed prompt included."""
        end = min(c.text.visible if everything else c.text.released(), len(c.logprobs))
        out = [(c.logprobs[i], len(c.prefix) + c.text.start(i)) for i in range(c.released, end)]
        c.released = max(c.released, end)
        if (everything and c.stop_token is not None and self.params[c.index].logprobs is not None
                and c.released == len(c.logprobs)):
            # vLLM lists the stop token (EOS or a stop token id) last, with no text: lm-eval's loglikelihood
            # (`echo`, max_tokens 1) counts on exactly one generated entry after the prompt's.
            out.append((c.stop_token, len(c.prefix) + c.text.length))
            c.released += 1  # listed once
        return out

    def text(self, index: int) -> str:
        """A choice's whole text: the echoed prompt, if any, then what was generated."""
        c = self.choices[index]
        return c.prefix + c.text.text

    def usage(self) -> dict:
        completion = sum(len(c.text.ids) + (c.stop_token is not None) for c in self.choices)
        prompt = sum(len(p.ids) for p in self.prompts)  # each prompt once, whatever n
        return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion}


def _missing_logprobs(params: SamplingParams, out: RequestOutput, prompt_len: int | None) -> str | None:
    """What an engine report lacks of the logprobs its request asked for ("": nothing); `prompt_len` when the
    report must carry the prompt's logprobs (the first report of an echo)."""
    if params.logprobs is not None and len(out.logprobs or ()) != len(out.token_ids):
        return f"{len(out.logprobs or ())} logprobs for {len(out.token_ids)} tokens"
    if params.logprobs is not None and out.stop_token is not None and out.stop_token.logprob is None:
        return "no logprob for the stop token"
    got = len(out.prompt_logprobs or ())
    if prompt_len is not None and params.prompt_logprobs is not None and got != prompt_len:
        return f"{got} prompt logprobs for a prompt of {prompt_len} tokens"
    return ""


def engine_error(out: RequestOutput) -> APIError:
    """An aborted engine request as the client sees it: `out.status` (4xx: the request's fault) or 500."""
    status = out.status if out.status is not None and 400 <= out.status <= 599 else 500
    return APIError(f"the engine aborted the request: {out.error or 'no reason given'}", status=status,
                    code="engine_abort")


def _healthy(engine: EngineLike) -> bool:
    try:
        return bool(engine.health())
    except Exception:
        return False
