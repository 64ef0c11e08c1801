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

It also bounds how long a client may take to send a request (slowloris):
uvicorn times only the silence between two requests on a kept-alive
connection, so a client that opens a connection and never completes a head,
or trickles a body a byte at a time, would hold its connection and buffers
forever. A request must arrive within `read_timeout_s` of its first byte (of
the connection, for the first request), extended by a second for every
`MIN_READ_RATE` bytes received, so that a large upload on a slow but honest
link is never cut. Time during which the server itself stopped reading (its
app had not yet taken the body already buffered, or had not yet asked for
the body a client waits to send on `Expect: 100-continue`) does not count.
Past the deadline a client that sent something gets a 408 with an OpenAI
error body; one that sent nothing is closed quietly, as an unused
pre-opened connection is. Either way the connection is closed, and a
handler still waiting for the body sees the client as gone. A body still
arriving after its request was answered (a 401 or a 413 before the body)
is read and dropped for at most `LINGER_S` more.
"""

from __future__ import annotations

import json
import logging

import h11
from uvicorn.protocols.http.flow_control import FlowControl
from uvicorn.protocols.http.h11_impl import H11Protocol

from gateway.errors import APIError, HeaderFieldsTooLarge, RequestTimeout

log = logging.getLogger(__name__)

# Bytes a second that buy a slow request another second past its read
# timeout: 1 KiB/s lets a 4 MiB body take 70 minutes and a 256 MiB upload
# three days, while a trickle of a few bytes a second is cut at the timeout.
MIN_READ_RATE = 1024
# How long a body may go on arriving after its request was answered (nginx's
# lingering_time): it is read and dropped, and holds the connection no longer.
LINGER_S = 30.0
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


class _PauseClock(FlowControl):
    """uvicorn's flow control, also keeping how long reading has been
    paused in all: the server stopping to read is not the client's delay."""

    def __init__(self, transport, clock) -> None:
        super().__init__(transport)
        self._clock = clock
        self._paused_total = 0.0
        self._paused_at: float | None = None

    def pause_reading(self) -> None:
        if not self.read_paused:
            self._paused_at = self._clock()
        super().pause_reading()

    def resume_reading(self) -> None:
        if self.read_paused and self._paused_at is not None:
            self._paused_total += self._clock() - self._paused_at
            self._paused_at = None
        super().resume_reading()

    def paused_s(self) -> float:
        """Seconds spent paused so far, the current pause included."""
        current = 0.0 if self._paused_at is None else self._clock() - self._paused_at
        return self._paused_total + current


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
        self._paused_before = 0.0  # the flow's paused seconds when the clock started
        self._linger_until: float | None = None  # the answer went out: the rest of the body gets this long

    def connection_made(self, transport) -> None:
        super().connection_made(transport)
        self.flow = _PauseClock(transport, self.loop.time)
        self._start_clock(0)
        self._arm()

    def data_received(self, data: bytes) -> None:
        cycle = self.cycle
        draining = self.conn.their_state is h11.SEND_BODY and cycle is not None and cycle.response_complete
        if self._read_timer is None:  # the first byte of a request on a kept-alive connection
            self._start_clock(0)
        self._read_bytes += len(data)
        super().data_received(data)
        if draining and (self.conn.their_state is h11.IDLE or self.cycle is not cycle):
            # The body left after its answer ended: that request is over, and
            # the connection is between requests (or in a pipelined one).
            self._between_requests()
        elif self.conn.their_state not in _RECEIVING or self.transport.is_closing():
            self._stop_read_timer()
        else:
            self._arm()

    def on_response_complete(self) -> None:
        super().on_response_complete()  # may start a pipelined request already buffered
        state = self.conn.their_state
        if state not in _RECEIVING or self.transport.is_closing():  # DONE: the next request is whole
            self._stop_read_timer()
        elif state is h11.SEND_BODY and self.cycle.response_complete:
            # Answered before its body was read (a 401, a 413): the rest is
            # read and dropped for a short while only, as nginx's lingering_time.
            self._linger_until = self.loop.time() + min(self.read_timeout_s or LINGER_S, LINGER_S)
            self._arm()
        else:
            self._between_requests()

    def connection_lost(self, exc) -> None:
        self._stop_read_timer()
        super().connection_lost(exc)

    def _between_requests(self) -> None:
        """The last request is over. A next one begun but not whole starts
        its own clock; a next one already whole is being answered, and its
        answer's end arms the keep-alive timer; otherwise uvicorn's
        keep-alive timer closes the silent connection (armed here when a
        drained body ended the request, since its data_received disarmed it)."""
        self._stop_read_timer()
        self._linger_until = None
        if self.transport.is_closing():
            return
        if self.conn.their_state is h11.SEND_BODY or self.conn.trailing_data[0]:
            self._start_clock(len(self.conn.trailing_data[0]))
            self._arm()
        elif self.conn.their_state is h11.IDLE and self.timeout_keep_alive_task is None:
            # Not under a next request that came whole in the same read as
            # the old body's end: its client, waiting for the answer, sends
            # nothing that would disarm the timer, which would close the
            # connection mid-response.
            self.timeout_keep_alive_task = self.loop.call_later(self.timeout_keep_alive,
                                                                self.timeout_keep_alive_handler)

    def _start_clock(self, received: int) -> None:
        self._read_since, self._read_bytes = self.loop.time(), received
        self._paused_before = self.flow.paused_s()

    def _arm(self) -> None:
        if self.read_timeout_s is not None and self._read_timer is None:
            self._read_timer = self.loop.call_at(self._read_deadline(), self._on_read_deadline)

    def _read_deadline(self) -> float:
        paused = self.flow.paused_s() - self._paused_before
        deadline = self._read_since + self.read_timeout_s + self._read_bytes / MIN_READ_RATE + paused
        return deadline if self._linger_until is None else min(deadline, self._linger_until)

    def _stop_read_timer(self) -> None:
        if self._read_timer is not None:
            self._read_timer.cancel()
            self._read_timer = None

    def _on_read_deadline(self) -> None:
        self._read_timer = None
        if self.conn.their_state not in _RECEIVING or self.transport.is_closing():
            return
        cycle = self.cycle if self.conn.their_state is h11.SEND_BODY else None
        if cycle is not None and cycle.waiting_for_100_continue and not cycle.response_started:
            # The client waits for our 100 Continue, which goes out when the
            # handler first asks for the body: that wait is ours, not theirs.
            self._start_clock(self._read_bytes)
        if self.loop.time() < self._read_deadline() or self.flow.read_paused:
            self._read_timer = self.loop.call_at(max(self._read_deadline(), self.loop.time() + 1.0),
                                                 self._on_read_deadline)
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
            peer = "%s:%d" % self.client if self.client else "a client"
            log.info("%s did not send its request in time (%s); closing the connection", peer, limit)
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
