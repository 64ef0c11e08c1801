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
import logging

import h11
from uvicorn.protocols.http.h11_impl import H11Protocol

from gateway.errors import APIError, HeaderFieldsTooLarge, RequestTimeout

log = logging.getLogger(__name__)

# Bytes a second that buy a slow request another second past its read
# timeout: 1 KiB/s lets a 4 MiB body take 70 minutes and a 256 MiB upload
# three days, while a trickle of a few bytes a second is cut at the timeout.
MIN_READ_RATE = 1024
# The other side's states in which the server waits on it: a head not yet
# complete (IDLE), or a body (SEND_BODY).
_RECEIVING = (h11.IDLE, h11.SEND_BODY)


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
    """uvicorn's h11 protocol with the head limit measured on whole heads,
    the 431 and 408 answered with OpenAI bodies, and a deadline on reading
    each request. Built by `gateway.server` with `functools.partial` to pass
    `read_timeout_s` (None: no deadline)."""

    def __init__(self, config, server_state, app_state, _loop=None, *, read_timeout_s: float | None = None) -> None:
        super().__init__(config, server_state, app_state, _loop)
        self.conn = _Connection(h11.SERVER, config.h11_max_incomplete_event_size)
        self.read_timeout_s = read_timeout_s
        self._read_timer = None
        self._read_since = 0.0  # the loop's time when the request (or the connection) began
        self._read_bytes = 0  # received since then

    def connection_made(self, transport) -> None:
        super().connection_made(transport)
        self._watch_reading(new_request=True)

    def data_received(self, data: bytes) -> None:
        if self._read_timer is None:  # the first byte of a request on a kept-alive connection
            self._read_since, self._read_bytes = self.loop.time(), 0
        self._read_bytes += len(data)
        super().data_received(data)
        self._watch_reading(new_request=False)

    def on_response_complete(self) -> None:
        super().on_response_complete()
        if self.conn.their_state is h11.IDLE and not self.conn.trailing_data[0]:
            return  # between requests: uvicorn's keep-alive timer closes a silent connection
        # A body still arriving (its request's clock runs on), or a pipelined request.
        self._watch_reading(new_request=True)

    def connection_lost(self, exc) -> None:
        self._stop_read_timer()
        super().connection_lost(exc)

    def _watch_reading(self, *, new_request: bool) -> None:
        """Arm the deadline while the server waits on the client; disarm it
        once the request is whole (or the connection is going)."""
        if self.read_timeout_s is None:
            return
        if self.conn.their_state not in _RECEIVING or self.transport.is_closing():
            self._stop_read_timer()
        elif self._read_timer is None:
            if new_request:  # data_received has already started the clock at this request's first byte
                self._read_since, self._read_bytes = self.loop.time(), len(self.conn.trailing_data[0])
            self._read_timer = self.loop.call_at(self._read_deadline(), self._on_read_deadline)

    def _read_deadline(self) -> float:
        return self._read_since + self.read_timeout_s + self._read_bytes / MIN_READ_RATE

    def _stop_read_timer(self) -> None:
        if self._read_timer is not None:
            self._read_timer.cancel()
            self._read_timer = None

    def _on_read_deadline(self) -> None:
        self._read_timer = None
        if self.conn.their_state not in _RECEIVING or self.transport.is_closing():
            return
        now = self.loop.time()
        if self.flow.read_paused:  # the server stopped reading, not the client: its clock starts again
            self._read_since, self._read_bytes = now, 0
        if now < self._read_deadline():
            self._read_timer = self.loop.call_at(self._read_deadline(), self._on_read_deadline)
            return
        self._time_out_reading()

    def _time_out_reading(self) -> None:
        receiving_body = self.conn.their_state is h11.SEND_BODY
        cycle = self.cycle if receiving_body else None
        answered = cycle is not None and cycle.response_started
        if cycle is not None and not cycle.response_complete:
            # The handler waiting on the body now sees the client as gone; it answers nothing.
            cycle.disconnected = True
            cycle.message_event.set()
        if not answered and (receiving_body or self._read_bytes or self.conn.trailing_data[0]):
            limit = f"{self.read_timeout_s:g} seconds plus one a KiB received"
            log.info("a request did not arrive in time (%s); closing its connection", limit)
            error = RequestTimeout(f"the request did not arrive within this server's limit of {limit}")
            head_only = cycle is not None and cycle.scope["method"] == "HEAD"
            try:
                self._send_error(error, b"Request Timeout", head_only=head_only)
            except h11.LocalProtocolError:  # h11 will not answer in this state: closing is the answer
                pass
        self.transport.close()  # also when nothing was sent, or the answer already went out

    def send_400_response(self, msg: str) -> None:
        if self.conn.error_status != 431:
            super().send_400_response(msg)
            return
        limit = self.config.h11_max_incomplete_event_size
        error = HeaderFieldsTooLarge(f"the request line and headers are over this server's limit of {limit} bytes")
        self._send_error(error, b"Request Header Fields Too Large", head_only=self.conn.refused_head_request)

    def _send_error(self, error: APIError, reason: bytes, *, head_only: bool) -> None:
        """Answer `error` from the protocol, not the app, and close."""
        body = json.dumps(error.body()).encode()
        # A length, not chunks: past a whole head h11 would otherwise chunk the body.
        headers = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode()),
                   (b"connection", b"close")]
        events = [h11.Response(status_code=error.status, headers=headers, reason=reason)]
        if not head_only:
            events.append(h11.Data(data=body))
        for event in (*events, h11.EndOfMessage()):
            self.transport.write(self.conn.send(event))
        self.transport.close()
