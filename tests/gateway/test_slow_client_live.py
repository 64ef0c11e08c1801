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
    assert error["code"] == "request_timeout" and error["type"] == "invalid_request_error"


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
    with caplog.at_level(logging.WARNING), connect(live) as sock:
        sock.sendall(completion_head(live, len(body) + 100) + body[:20])  # then nothing
        answer, waited = read_until_closed(sock)
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


def test_a_kept_alive_connection_starts_the_clock_at_each_request(live):
    """A pause between requests longer than the read timeout (but shorter
    than uvicorn's keep-alive) does not count against the next request."""
    with httpx.Client(base_url=live.url, headers={"Authorization": f"Bearer {live.key}"}, timeout=30) as client:
        body = {"model": live.gateway.served_model_name, "prompt": "Hello", "max_tokens": 2}
        first = client.post("/v1/completions", json=body)
        time.sleep(READ_TIMEOUT_S * 2)
        second = client.post("/v1/completions", json=body)
    assert (first.status_code, second.status_code) == (200, 200)
    assert first.extensions["network_stream"] is second.extensions["network_stream"]  # one connection
