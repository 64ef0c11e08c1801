"""The request body limit: every route refuses a body past its limit with
413, counted while the body arrives, so an oversized body is never held in
memory.

A Content-Length over the limit is answered before a byte of the body is
read (a client that sent `Expect: 100-continue` then never sends it).
A body without one (chunked) is counted as the app reads it: the read that
passes the limit raises PayloadTooLarge inside the handler, which the one
error mapping turns into the 413. uvicorn reads the rest of such a body and
drops it (it pauses reading past 64 KiB until the app asks for more), so
the client still gets its answer on the same connection.
"""

from __future__ import annotations

from starlette.types import ASGIApp, Message, Receive, Scope, Send

from gateway.errors import PayloadTooLarge, error_response


class BodyLimitMiddleware:
    """`limit` bytes for every route, except the (method, path) pairs in
    `route_limits`, which have their own (the adapter upload's is larger)."""

    def __init__(self, app: ASGIApp, *, limit: int, route_limits: dict[tuple[str, str], int] | None = None):
        self.app = app
        self.limit = limit
        self.route_limits = dict(route_limits or {})

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        limit = self.route_limits.get((scope["method"], scope["path"]), self.limit)
        declared = _content_length(scope)
        if declared is not None and declared > limit:
            too_large = PayloadTooLarge(f"the request body ({declared} bytes) is over the limit of "
                                        f"{limit} bytes")
            await error_response(too_large)(scope, receive, send)
            return
        received = 0

        async def counted_receive() -> Message:
            nonlocal received
            message = await receive()
            if message["type"] == "http.request":
                received += len(message.get("body", b""))
                if received > limit:
                    raise PayloadTooLarge(f"the request body is over the limit of {limit} bytes")
            return message

        await self.app(scope, counted_receive, send)


def _content_length(scope: Scope) -> int | None:
    for name, value in scope["headers"]:
        if name == b"content-length":
            # h11 has already refused a malformed or conflicting one.
            return int(value) if value.isdigit() else None
    return None
