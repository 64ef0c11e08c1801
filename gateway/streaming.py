"""Server-sent events for streamed completions.

The wire format is OpenAI's: `data: {chunk}\\n\\n` per update and a final
`data: [DONE]\\n\\n`. With `stream_options.include_usage` a last chunk with
`choices: []` carries the usage; every other chunk has `usage: null`. An
error after the stream began can no longer change the status code, so it
is sent as a `data: {"error": {...}}` event (which OpenAI clients raise).

The engine's outputs are deltas (engine/outputs.py): a chunk carries what
its choice produced since the previous chunk, several engine steps merged
when the client reads slower than the engine writes, so a slow reader
costs the server O(the request's output). `collect_output` folds the
deltas into the whole output for a non-streamed response.

`SSEResponse` watches for the client hanging up while it waits on the
engine (`run_until_disconnect`, which non-streamed requests use too), so a
dropped connection aborts the engine request at once instead of at the
next token, and its `on_close` runs exactly once however the stream ends.
It also bounds the stream's duration: past `max_seconds` the request is
aborted and the stream ends with an error event and `[DONE]`, so a reader
that stalls (or trickles) cannot hold a sequence slot and its output forever.
A client that asked for usage gets its usage chunk just before that error
event: what it was billed for the tokens made until the abort.
"""

from __future__ import annotations

import dataclasses
import json
import math
from typing import AsyncIterator, Awaitable, Callable

import anyio
from starlette.responses import Response
from starlette.types import Receive, Scope, Send

from engine.outputs import RequestOutput
from gateway.errors import InternalError, StreamDeadlineExceeded, to_api_error
from gateway.openai_format import ResponseFormat

DONE = b"data: [DONE]\n\n"
# How long a stream past its deadline may take to hand over its error event.
# A reader that stalled may never take it: the connection is then dropped.
_DEADLINE_GRACE_S = 1.0


def sse_event(payload: dict) -> bytes:
    return b"data: " + json.dumps(payload, separators=(",", ":")).encode() + b"\n\n"


def check_output(out: RequestOutput) -> RequestOutput:
    """The output, or the error the engine ended it with."""
    if out.error is not None:
        raise InternalError(f"the engine failed this request: {out.error}", code="engine_error")
    return out


async def completion_events(first: RequestOutput, rest: AsyncIterator[RequestOutput], fmt: ResponseFormat, *,
                            n: int, include_usage: bool,
                            on_output: Callable[[RequestOutput], None]) -> AsyncIterator[bytes]:
    """The SSE body of one streamed completion whose first output is `first`."""
    try:
        role = fmt.role_chunk(n)
        if role is not None:
            yield sse_event(role)
        text_sent = [0] * n
        out: RequestOutput | None = first
        last = first
        while out is not None:
            on_output(out)  # an error output too: the record then says error
            check_output(out)
            for c in out.outputs:  # only the choices that changed, each finishing once
                chunk = fmt.delta_chunk(c, text_sent[c.index])
                if chunk is not None:  # None: a tool call held until it is whole, or a delta of nothing
                    yield sse_event(chunk)
                text_sent[c.index] += len(c.text)
            last = out
            out = await anext(rest, None)
        if include_usage:
            yield sse_event(fmt.usage_chunk(last))
    except Exception as exc:  # noqa: BLE001 - mid-stream, an error can only be an event
        yield sse_event(to_api_error(exc).body())
    finally:
        await rest.aclose()  # leaving the engine's iterator early aborts the request
    yield DONE


async def collect_output(first: RequestOutput, rest: AsyncIterator[RequestOutput], *,
                         on_output: Callable[[RequestOutput], None]) -> RequestOutput:
    """The whole output of a request: `first` (already handed on) with every
    delta of `rest` folded in, each handed to `on_output` as it arrives."""
    whole = dataclasses.replace(first, outputs=[])
    whole.add(first)  # copies: the caller's `first` stays as it was
    async for out in rest:
        on_output(out)
        check_output(out)
        whole.add(out)
    return whole


class SSEResponse(Response):
    media_type = "text/event-stream"

    def __init__(self, events: AsyncIterator[bytes], *, on_close: Callable[[], None],
                 max_seconds: float | None = None, on_deadline: Callable[[], None] = lambda: None,
                 usage: Callable[[], dict | None] = lambda: None):
        self.events = events
        self.on_close = on_close
        self.max_seconds = max_seconds
        self.on_deadline = on_deadline  # the server, not the client, ended the stream
        self.usage = usage  # the usage chunk sent before the deadline's error event, if the client asked
        self.status_code = 200
        self.background = None
        self.init_headers({"cache-control": "no-cache", "x-accel-buffering": "no"})

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        started = False

        async def stream() -> None:
            nonlocal started
            await send({"type": "http.response.start", "status": self.status_code, "headers": self.raw_headers})
            started = True
            async for chunk in self.events:
                await send({"type": "http.response.body", "body": chunk, "more_body": True})
            await send({"type": "http.response.body", "body": b"", "more_body": False})

        try:
            with anyio.move_on_after(math.inf if self.max_seconds is None else self.max_seconds) as deadline:
                await run_until_disconnect(receive, stream)
            if deadline.cancelled_caught:
                self.on_deadline()
                await self.events.aclose()  # aborts the engine request before anything else waits
                await self._end_past_deadline(send, started)
        except OSError:  # the client went away mid-send
            pass
        finally:
            await self.events.aclose()
            self.on_close()

    async def _end_past_deadline(self, send: Send, started: bool) -> None:
        error = StreamDeadlineExceeded(f"the stream ran past the server's limit of {self.max_seconds:g} seconds")
        usage = self.usage()
        ending = (b"" if usage is None else sse_event(usage)) + sse_event(error.body()) + DONE
        with anyio.move_on_after(_DEADLINE_GRACE_S):
            if not started:
                await send({"type": "http.response.start", "status": self.status_code,
                            "headers": self.raw_headers})
            await send({"type": "http.response.body", "body": ending, "more_body": True})
            await send({"type": "http.response.body", "body": b"", "more_body": False})


async def run_until_disconnect(receive: Receive, work: Callable[[], Awaitable[None]]) -> bool:
    """Await `work()` unless the client hangs up first (then `work` is
    cancelled). True if it completed. Call once the request body was read:
    from then on `receive` only ever reports the disconnect."""
    completed = False
    try:
        async with anyio.create_task_group() as tg:

            async def run() -> None:
                nonlocal completed
                await work()
                completed = True
                tg.cancel_scope.cancel()

            async def watch() -> None:
                while (await receive())["type"] != "http.disconnect":
                    pass
                tg.cancel_scope.cancel()

            tg.start_soon(run)
            tg.start_soon(watch)
    except BaseExceptionGroup as group:  # only `work` raises; let its error through as itself
        raise group.exceptions[0] from None
    return completed
