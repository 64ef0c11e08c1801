"""Server-sent events for streamed completions.

The wire format is OpenAI's: `data: {chunk}\\n\\n` per update and a final
`data: [DONE]\\n\\n`. With `stream_options.include_usage` a last chunk with
`choices: []` carries the usage; every other chunk has `usage: null`. An
error after the stream began can no longer change the status code, so it
is sent as a `data: {"error": {...}}` event (which OpenAI clients raise).

`SSEResponse` watches for the client hanging up while it waits on the
engine (`run_until_disconnect`, which non-streamed requests use too), so a
dropped connection aborts the engine request at once instead of at the
next token, and its `on_close` runs exactly once however the stream ends.
"""

from __future__ import annotations

import json
from typing import AsyncIterator, Awaitable, Callable

import anyio
from starlette.responses import Response
from starlette.types import Receive, Scope, Send

from engine.outputs import RequestOutput
from gateway.errors import InternalError, to_api_error
from gateway.openai_format import ResponseFormat

DONE = b"data: [DONE]\n\n"


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
        done = [False] * n
        out: RequestOutput | None = first
        last = first
        while out is not None:
            on_output(check_output(out))
            for c in out.outputs:
                if done[c.index] or not (c.delta_text or c.delta_token_ids or c.finished):
                    continue
                yield sse_event(fmt.delta_chunk(c, text_sent[c.index]))
                text_sent[c.index] += len(c.delta_text)
                done[c.index] = c.finished
            last = out
            out = await anext(rest, None)
        if include_usage:
            yield sse_event(fmt.usage_chunk(last))
    except Exception as exc:  # noqa: BLE001 - mid-stream, an error can only be an event
        yield sse_event(to_api_error(exc).body())
    finally:
        await rest.aclose()  # leaving the engine's iterator early aborts the request
    yield DONE


class SSEResponse(Response):
    media_type = "text/event-stream"

    def __init__(self, events: AsyncIterator[bytes], *, on_close: Callable[[], None]):
        self.events = events
        self.on_close = on_close
        self.status_code = 200
        self.background = None
        self.init_headers({"cache-control": "no-cache", "x-accel-buffering": "no"})

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        async def stream() -> None:
            await send({"type": "http.response.start", "status": self.status_code, "headers": self.raw_headers})
            async for chunk in self.events:
                await send({"type": "http.response.body", "body": chunk, "more_body": True})
            await send({"type": "http.response.body", "body": b"", "more_body": False})

        try:
            await run_until_disconnect(receive, stream)
        except OSError:  # the client went away mid-send
            pass
        finally:
            await self.events.aclose()
            self.on_close()


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
