"""The HTTP/1.1 protocol the gateway serves: uvicorn's h11 protocol, pinned
by `server.make_server` so that installing httptools (which uvicorn would
otherwise prefer, and which has no header size limit of its own) cannot
change the limits.

h11 refuses a request head (request line plus headers) larger than its
`max_incomplete_event_size` and says the status should be 431; uvicorn
answers every parse error with a bare 400. This subclass answers that one
with 431 and an OpenAI error body, then closes the connection, as it does
for any other malformed request. h11 counts only a head still incomplete in
its buffer: a larger one that arrives whole in one read (the kernel hands
over up to uvicorn's read size at once) is parsed, so the head of each
request is measured here too, against the same limit.
"""

from __future__ import annotations

import json

import h11
from uvicorn.protocols.http.h11_impl import H11Protocol

from gateway.errors import HeaderFieldsTooLarge


class _Connection(h11.Connection):
    """Remembers the status h11 suggests for the last malformed request, and
    refuses a whole request head over `max_head_bytes` as h11 refuses an
    incomplete one."""

    error_status = 400
    # A whole head refused after h11 parsed it: the answer to a HEAD request
    # has no body, and h11 will not send one.
    refused_head_request = False

    def __init__(self, our_role, max_head_bytes: int) -> None:
        super().__init__(our_role, max_head_bytes)
        self.max_head_bytes = max_head_bytes

    def next_event(self):
        try:
            event = super().next_event()
            if isinstance(event, h11.Request) and _head_bytes(event) > self.max_head_bytes:
                self.refused_head_request = event.method == b"HEAD"
                raise h11.RemoteProtocolError("the request head is over the limit", error_status_hint=431)
            return event
        except h11.RemoteProtocolError as exc:
            self.error_status = exc.error_status_hint
            raise


def _head_bytes(request: h11.Request) -> int:
    """The head's size on the wire, give or take the blanks h11 strips
    around header values: "METHOD TARGET HTTP/1.1\r\n", "name: value\r\n"
    each, and the blank line."""
    line = len(request.method) + len(request.target) + len(b"  HTTP/1.1\r\n")
    return line + sum(len(name) + len(value) + 4 for name, value in request.headers) + 2


class GatewayH11Protocol(H11Protocol):
    def __init__(self, config, server_state, app_state, _loop=None) -> None:
        super().__init__(config, server_state, app_state, _loop)
        self.conn = _Connection(h11.SERVER, config.h11_max_incomplete_event_size)

    def send_400_response(self, msg: str) -> None:
        if self.conn.error_status != 431:
            super().send_400_response(msg)
            return
        limit = self.config.h11_max_incomplete_event_size
        error = HeaderFieldsTooLarge(f"the request line and headers are over this server's limit of {limit} bytes")
        body = json.dumps(error.body()).encode()
        # A length, not chunks: past a whole head h11 would otherwise chunk the body.
        headers = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode()),
                   (b"connection", b"close")]
        events = [h11.Response(status_code=error.status, headers=headers, reason=b"Request Header Fields Too Large")]
        if not self.conn.refused_head_request:
            events.append(h11.Data(data=body))
        for event in (*events, h11.EndOfMessage()):
            self.transport.write(self.conn.send(event))
        self.transport.close()
