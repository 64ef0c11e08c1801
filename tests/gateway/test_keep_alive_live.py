"""The keep-alive timer and a request answered before its body
(gateway/http_protocol.py), on a real uvicorn server with the gateway's
protocol and a raw socket, so that the bytes arrive exactly as a busy
client's do.

A 401, a 413 or a 429 refused before parse goes out before the body is
read. A client (httpx, under load) has sent that body already and reuses the
connection for its next request at once, so the server can read the end of
the old body and the whole next request in one read. The protocol then took
the connection for idle and armed uvicorn's keep-alive timer under the new
request: when it fired, mid-response, the stream was cut ("incomplete
chunked read"), seen in `benchmarks/tiers.py` as premium requests cut after
their first token. The app here is a stand-in for the gateway's, so the
keep-alive timeout can be short; the protocol is the gateway's own.
"""

from __future__ import annotations

import asyncio
import functools
import socket
import threading
import time

import pytest
import uvicorn

from gateway.http_protocol import GatewayH11Protocol

# Also how long the client may take between the early answer and its next
# write: long enough that a client stalled under load does not lose the
# connection (which would read as the defect), short enough for a quick test.
KEEP_ALIVE_S = 1.5
CHUNKS, CHUNK_GAP_S = 8, 0.5  # the slow answer lasts over twice the keep-alive timeout


async def app(scope, receive, send):
    if scope["type"] != "http":
        return
    if scope["path"] == "/early":  # answered without reading the body, as a 429 before parse is
        await send({"type": "http.response.start", "status": 429, "headers": [(b"content-length", b"0")]})
        await send({"type": "http.response.body", "body": b""})
        return
    await send({"type": "http.response.start", "status": 200, "headers": [(b"content-type", b"text/plain")]})
    for i in range(CHUNKS):
        await asyncio.sleep(CHUNK_GAP_S)
        await send({"type": "http.response.body", "body": b"%d;" % i, "more_body": True})
    await send({"type": "http.response.body", "body": b""})


@pytest.fixture(scope="module")
def port():
    config = uvicorn.Config(app, host="127.0.0.1", port=0, lifespan="off", log_level="warning", access_log=False,
                            timeout_keep_alive=KEEP_ALIVE_S, h11_max_incomplete_event_size=16 * 1024,
                            http=functools.partial(GatewayH11Protocol, read_timeout_s=30.0))
    server = uvicorn.Server(config)
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 30
    while not server.started:
        assert thread.is_alive() and time.monotonic() < deadline, "the server did not start"
        time.sleep(0.02)
    yield server.servers[0].sockets[0].getsockname()[1]
    server.should_exit = True
    thread.join(10)


def read_response(sock: socket.socket, end: bytes) -> bytes:
    """Bytes up to and including `end`, or what came before the server closed."""
    data = b""
    while not data.endswith(end):
        chunk = sock.recv(65536)
        if not chunk:
            break
        data += chunk
    return data


@pytest.mark.parametrize("body_bytes", [16, 0])
def test_a_request_behind_an_early_answer_is_served_whole_past_the_keep_alive_timeout(port, body_bytes):
    """With body_bytes=0 nothing is left over from the first request: the
    plain keep-alive path, as a control."""
    with socket.create_connection(("127.0.0.1", port), timeout=15) as sock:
        sock.sendall(b"POST /early HTTP/1.1\r\nHost: x\r\nContent-Length: %d\r\n\r\n" % body_bytes)
        assert read_response(sock, b"\r\n\r\n").startswith(b"HTTP/1.1 429 ")
        # The rest of the old body and the next request, in one write (one read on the server).
        sock.sendall(b" " * body_bytes + b"GET /slow HTTP/1.1\r\nHost: x\r\n\r\n")
        answer = read_response(sock, b"0\r\n\r\n")
    assert answer.startswith(b"HTTP/1.1 200 "), answer[:200]
    assert answer.endswith(b"0\r\n\r\n"), f"cut mid-stream: {answer!r}"
    assert answer.count(b";") == CHUNKS
