"""One HTTP request's engine requests (one per choice) and the bridge from the engine thread into asyncio.

The engine calls each request's `on_output` from its own thread; `loop.call_soon_threadsafe` moves every
`RequestOutput` onto the Generation's asyncio.Queue, and `events()` turns them into text deltas per choice
(`ChoiceText`: incremental detokenization and stop strings). A stop string aborts that choice's engine
request; `abort()` aborts all unfinished ones and is what every early exit of a request calls.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence

from serve.protocol import APIError
from serve.stream import ChoiceText
from serve.types import EngineLike, EngineRequest, RequestOutput, SamplingParams

DISCONNECT_POLL_S = 0.25  # how often a non-streamed request checks that its client is still there
log = logging.getLogger(__name__)


class ClientDisconnected(Exception):
    """The client went away before its (non-streamed) answer was ready."""


@dataclasses.dataclass
class _Choice:
    index: int
    request_id: str
    text: ChoiceText
    submitted: bool = False
    engine_done: bool = False  # the engine sent its final report
    finish_reason: str | None = None  # as the client sees it
    error: str | None = None


class Generation:
    """The engine requests behind one HTTP request, and their outputs as asyncio events.

    Must be created inside the event loop that consumes `events()`.
    """

    def __init__(self, engine: EngineLike, prompt_ids: list[int], params: Sequence[SamplingParams], *,
                 base_id: str, decode: Callable[[Sequence[int]], str], stop: Sequence[str]):
        self.engine, self.prompt_ids, self.params = engine, prompt_ids, list(params)
        self.loop = asyncio.get_running_loop()
        self.queue: asyncio.Queue[tuple[int, RequestOutput]] = asyncio.Queue()
        self.choices = [_Choice(i, f"{base_id}-{i}", ChoiceText(decode, stop)) for i in range(len(self.params))]

    def submit(self) -> None:
        """Queues every choice; a ValueError from the engine aborts those already queued and is a 400."""
        for c, p in zip(self.choices, self.params, strict=True):
            req = EngineRequest(request_id=c.request_id, prompt_ids=list(self.prompt_ids), params=p,
                                on_output=self._callback(c.index))
            try:
                self.engine.add_request(req)
            except ValueError as e:
                self.abort()  # the choices already queued
                raise APIError(f"the engine rejected the request: {e}") from None
            except BaseException:
                self.abort()
                raise
            c.submitted = True

    def _callback(self, index: int) -> Callable[[RequestOutput], None]:
        def on_output(out: RequestOutput) -> None:  # runs on the engine thread
            try:
                self.loop.call_soon_threadsafe(self.queue.put_nowait, (index, out))
            except RuntimeError:  # the event loop is closed: the server has shut down, nobody listens
                pass

        return on_output

    def abort(self) -> None:
        """Aborts every engine request that has not finished (idempotent; frees their pages)."""
        for c in self.choices:
            if c.submitted and not c.engine_done:
                try:
                    self.engine.abort(c.request_id)
                except Exception:  # cleanup must reach every choice
                    log.exception("engine.abort(%s) failed", c.request_id)

    async def events(self, is_disconnected: Callable[[], Awaitable[bool]] | None = None
                     ) -> AsyncIterator[tuple[int, str, str | None]]:
        """Yields (choice index, text delta, finish reason or None) until every choice has finished.

        With `is_disconnected` (non-streamed requests), checks it every DISCONNECT_POLL_S and raises
        ClientDisconnected once the client is gone; the caller then aborts.
        """
        pending = len(self.choices)
        next_check = self.loop.time() + DISCONNECT_POLL_S
        while pending:
            if is_disconnected is None:
                index, out = await self.queue.get()
            else:
                # Checked on a clock, not only when idle: outputs may keep arriving for a client long gone.
                if self.loop.time() >= next_check:
                    if await is_disconnected():
                        raise ClientDisconnected
                    next_check = self.loop.time() + DISCONNECT_POLL_S
                try:
                    index, out = await asyncio.wait_for(self.queue.get(), next_check - self.loop.time())
                except TimeoutError:
                    continue
            c = self.choices[index]
            final = out.finish_reason is not None
            c.engine_done |= final
            if c.finish_reason is not None:  # e.g. the engine's "abort" report after a stop string
                continue
            delta = c.text.add(out.token_ids, final=final)
            if c.text.stopped:
                c.finish_reason = "stop"
                if not c.engine_done:
                    self.engine.abort(c.request_id)
            elif final:
                c.finish_reason, c.error = out.finish_reason, out.error
            if c.finish_reason is not None:
                pending -= 1
            if delta or c.finish_reason is not None:
                yield index, delta, c.finish_reason

    def usage(self) -> dict:
        completion = sum(len(c.text.ids) for c in self.choices)
        prompt = len(self.prompt_ids)
        return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion}

    def engine_error(self, index: int) -> APIError:
        c = self.choices[index]
        return APIError(f"the engine aborted the request: {c.error or 'no reason given'}", status=500,
                        type="server_error", code="engine_abort")
