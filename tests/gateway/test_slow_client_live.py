"""Slow clients (slowloris), against a real uvicorn server on the tiny Llama:
a connection that never completes its head, or trickles its body, is
answered 408 and closed at the read deadline instead of being held forever,
while an honest request that arrives slowly but steadily is served
(gateway/http_protocol.py). The deadline here is 1 s, so the tests are short;
the rule is the default's."""

from __future__ import annotations

import json
import logging
import socket
import time

import httpx
import pytest

from engine.config import EngineConfig
from gateway.config import GatewayConfig
from gateway.http_protocol import MIN_READ_RATE
from gateway.tenancy import Tier
from tests.gateway.live import build_in_process_gateway, seed_tenants, start_live_server

READ_TIMEOUT_S = 1.0


@pytest.fixture(scope="module")
def live(tiny_llama_dir, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("live-slow")
    db_url = f"sqlite+aiosqlite:///{tmp / 'loragw.db'}"
    keys = seed_tenants(db_url, {"slow": Tier.STANDARD})
    engine = EngineConfig.from_flat(model=str(tiny_llama_dir), max_num_seqs=4, num_kv_blocks=64,
                                    data_dir=str(tmp / "data"))
    config = GatewayConfig(db_url=db_url, engine=engine, data_dir=tmp / "data", request_read_timeout_s=READ_TIMEOUT_S)
    server = start_live_server(build_in_process_gateway(config))
    server.key = keys["slow"]
    server.port = int(server.url.rsplit(":", 1)[1])
    yield server
    server.stop()


def connect(live) -> socket.socket:
    return socket.create_connection(("127.0.0.1", live.port), timeout=15)


def read_until_closed(sock: socket.socket) -> tuple[bytes, float]:
    """Everything the server sends until it closes, and how long that took."""
    start, received = time.monotonic(), b""
    try:
        while chunk := sock.recv(65536):
            received += chunk
    except ConnectionResetError:
        pass
    return received, time.monotonic() - start


def completion_head(live, length: int) -> bytes:
    return (f"POST /v1/completions HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {live.key}\r\n"
            f"Content-Type: application/json\r\nContent-Length: {length}\r\n\r\n").encode()


def completion_body(live, pad_to: int = 0) -> bytes:
    body = json.dumps({"model": live.gateway.served_model_name, "prompt": "Hello", "max_tokens": 2}).encode()
    return body + b" " * max(0, pad_to - len(body))  # JSON allows trailing blanks


def assert_408(answer: bytes) -> None:
    head, _, body = answer.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 408 "), answer[:200]
    assert b"connection: close" in head.lower()
    error = json.loads(body)["error"]
    assert error["code"] == "request_timeout" and error["type"] == "timeout_error"


def completion_works(live) -> bool:
    r = httpx.post(f"{live.url}/v1/completions", headers={"Authorization": f"Bearer {live.key}"}, timeout=60,
                   json={"model": live.gateway.served_model_name, "prompt": "Hello", "max_tokens": 2})
    return r.status_code == 200


def test_a_connection_that_sends_nothing_is_closed_quietly(live):
    with connect(live) as sock:
        answer, waited = read_until_closed(sock)
    assert answer == b"" and READ_TIMEOUT_S * 0.9 <= waited < READ_TIMEOUT_S + 3


def test_a_head_never_completed_gets_408(live):
    with connect(live) as sock:
        sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\n")
        answer, waited = read_until_closed(sock)
    assert_408(answer)
    assert waited < READ_TIMEOUT_S + 3


def test_a_trickled_head_is_cut_at_the_deadline(live):
    """A byte every 0.2 s keeps the line busy but buys almost nothing."""
    head = completion_head(live, 10)
    with connect(live) as sock:
        start = time.monotonic()
        try:
            for byte in head[:-4]:
                sock.sendall(bytes([byte]))
                time.sleep(0.2)
                if time.monotonic() - start > READ_TIMEOUT_S + 5:
                    pytest.fail("the trickle was never cut")
        except (BrokenPipeError, ConnectionResetError):
            pass
        answer, _ = read_until_closed(sock)
    assert_408(answer)
    assert time.monotonic() - start < READ_TIMEOUT_S + 3


def test_a_stalled_body_gets_408_and_its_handler_logs_no_error(live, caplog):
    body = completion_body(live)
    uvicorn_log = logging.getLogger("uvicorn")  # it does not propagate to the root logger caplog watches
    uvicorn_log.addHandler(caplog.handler)
    try:
        with caplog.at_level(logging.WARNING), connect(live) as sock:
            sock.sendall(completion_head(live, len(body) + 100) + body[:20])  # then nothing
            answer, waited = read_until_closed(sock)
    finally:
        uvicorn_log.removeHandler(caplog.handler)
    assert_408(answer)
    assert waited < READ_TIMEOUT_S + 3
    assert not [r.getMessage() for r in caplog.records if r.levelno >= logging.ERROR]
    assert completion_works(live)


def test_a_slow_but_steady_body_is_served(live):
    """Twice the minimum rate, for well past the bare timeout: each KiB
    received buys a second, so an honest slow upload is never cut."""
    pieces = 6
    piece = MIN_READ_RATE
    body = completion_body(live, pad_to=pieces * piece)
    with connect(live) as sock:
        sock.sendall(completion_head(live, len(body)))
        start = time.monotonic()
        for i in range(pieces):
            sock.sendall(body[i * piece:(i + 1) * piece])
            time.sleep(0.5)
        assert time.monotonic() - start > 2 * READ_TIMEOUT_S
        answer = b""
        while b"\r\n\r\n" not in answer or not answer.endswith(b"}"):
            chunk = sock.recv(65536)
            assert chunk, answer
            answer += chunk
    assert answer.startswith(b"HTTP/1.1 200 "), answer[:300]


def test_a_body_refused_before_it_arrives_does_not_hold_the_connection(live):
    """The 413 goes out before the body; a body that then never comes used
    to keep the connection open for as long as the client liked."""
    with connect(live) as sock:
        sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Length: 104857600\r\n\r\n")
        answer, waited = read_until_closed(sock)
    assert answer.startswith(b"HTTP/1.1 413 "), answer[:200]
    assert waited < READ_TIMEOUT_S + 3


def read_response(sock: socket.socket) -> bytes:
    """One whole response with a Content-Length, read off a kept-alive connection."""
    data = b""
    while b"\r\n\r\n" not in data:
        data += sock.recv(65536) or pytest.fail(f"closed mid-head: {data!r}")
    head, _, body = data.partition(b"\r\n\r\n")
    lengths = [line.split(b":")[1] for line in head.split(b"\r\n") if line.lower().startswith(b"content-length")]
    length = int(lengths[0])
    while len(body) < length:
        body += sock.recv(65536) or pytest.fail("closed mid-body")
    return head + b"\r\n\r\n" + body


def test_a_kept_alive_connection_starts_the_clock_at_each_request(live):
    """A pause between requests longer than the read timeout (but shorter
    than uvicorn's keep-alive) does not count against the next request, nor
    does the first request's time: the second one's body comes half a
    timeout after its head, and is served."""
    body = completion_body(live)
    with connect(live) as sock:
        sock.sendall(completion_head(live, len(body)) + body)
        assert read_response(sock).startswith(b"HTTP/1.1 200 ")
        time.sleep(READ_TIMEOUT_S * 2)
        sock.sendall(completion_head(live, len(body)))
        time.sleep(READ_TIMEOUT_S / 2)
        sock.sendall(body)
        assert read_response(sock).startswith(b"HTTP/1.1 200 ")


def test_a_body_that_drains_after_an_early_answer_leaves_a_quiet_kept_alive_connection(live):
    """Answered 401 before its body, the body then sent whole: the request is
    over, and the idle connection is closed by the keep-alive timer, not
    answered with an unasked-for 408 by a deadline left over from it."""
    with connect(live) as sock:
        sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Length: 2048\r\n\r\n")
        assert read_response(sock).startswith(b"HTTP/1.1 401 ")
        sock.sendall(b" " * 2048)
        rest, waited = read_until_closed(sock)
    assert rest == b"", rest[:200]
    assert waited < 5 + 3  # uvicorn's keep-alive timeout is 5 s


def test_a_body_still_trickling_in_after_its_answer_is_cut_short(live):
    """Refused (413) before its body, a client that then sends the body at a
    rate that would earn it hours is read and dropped for LINGER_S at most
    (here the read timeout, which is shorter)."""
    with connect(live) as sock:
        sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Length: 104857600\r\n\r\n")
        answer = read_response(sock)
        assert answer.startswith(b"HTTP/1.1 413 ")
        start = time.monotonic()
        try:
            while time.monotonic() - start < READ_TIMEOUT_S + 5:
                sock.sendall(b" " * 16384)  # 80 KiB/s: 80 more seconds of credit each second
                time.sleep(0.2)
            pytest.fail("the connection was held past the linger time")
        except (BrokenPipeError, ConnectionResetError):
            pass
    assert time.monotonic() - start < READ_TIMEOUT_S + 3
