"""The OpenAI-compatible API's errors and HTTP-level guarantees against a
live uvicorn server: every error as the official client's typed exception,
authentication that no header trick bypasses, request ids, health and
draining, aborts when a client hangs up.
"""

from __future__ import annotations

import json
import logging
import socket
import threading
import time

import httpx
import openai
import pytest

from tests.gateway.openai_live import CHAT, PROMPT, client, complete, openai_gateway


@pytest.fixture(scope="module")
def live(tiny_llama_dir, tiny_adapter_dir, tmp_path_factory):
    with openai_gateway(tiny_llama_dir, tiny_adapter_dir, tmp_path_factory.mktemp("live-openai-errors")) as server:
        yield server


# ---- typed errors ----


@pytest.mark.parametrize("key", ["wrong", "revoked", "expired"])
def test_bad_keys_are_authentication_errors(live, key):
    api_key = "lgw-not-a-real-key" if key == "wrong" else live.keys[key]
    c = openai.OpenAI(base_url=f"{live.url}/v1", api_key=api_key, max_retries=0)
    with pytest.raises(openai.AuthenticationError) as err:
        c.completions.create(model=live.model, prompt=PROMPT, max_tokens=2)
    assert err.value.code == "invalid_api_key"
    assert err.value.response.headers["x-request-id"]


def test_missing_key_is_an_authentication_error(live):
    with pytest.raises(openai.AuthenticationError, match="missing API key"):
        client(live).models.list(extra_headers={"Authorization": ""})


def test_another_tenants_adapter_is_not_found_like_an_unknown_model(live):
    with pytest.raises(openai.NotFoundError) as theirs:
        client(live, "rival").completions.create(model="tiny-lora", prompt=PROMPT, max_tokens=2)
    with pytest.raises(openai.NotFoundError) as unknown:
        client(live, "rival").completions.create(model="no-such-lora", prompt=PROMPT, max_tokens=2)
    assert theirs.value.code == unknown.value.code == "model_not_found"
    assert theirs.value.message.replace("tiny-lora", "X") == unknown.value.message.replace("no-such-lora", "X")
    with pytest.raises(openai.NotFoundError):
        complete(live, model="tiny-lora@9")
    with pytest.raises(openai.NotFoundError):
        complete(live, model="../etc/passwd")


@pytest.mark.parametrize("kwargs, param", [
    ({"max_tokens": 5000}, "max_tokens"),
    ({"prompt": ""}, "prompt"),
    ({"prompt": []}, "prompt"),
    ({"n": 17}, "n"),
    ({"stop": ["a", "b", "c", "d", "e"]}, "stop"),
    ({"temperature": 2.5}, "temperature"),
    ({"top_p": 0}, "top_p"),
    ({"logprobs": 21}, "logprobs"),
    ({"extra_body": {"min_tokens": 9}}, "min_tokens"),  # more than max_tokens
    ({"extra_body": {"top_k": 2**63}}, "top_k"),  # past the engine's 64-bit wire
    ({"echo": True}, "echo"),
    ({"prompt": [[1, 2], [3]]}, "prompt"),
    ({"prompt": [10**9]}, "prompt"),
])
def test_invalid_completion_requests_are_bad_requests(live, kwargs, param):
    with pytest.raises(openai.BadRequestError) as err:
        complete(live, **kwargs)
    assert err.value.param == param, err.value.message
    assert isinstance(err.value.code, str)


@pytest.mark.parametrize("kwargs, param", [
    ({"max_completion_tokens": 5000}, "max_completion_tokens"),
    ({"top_logprobs": 21, "logprobs": True}, "top_logprobs"),
    ({"top_logprobs": 2}, "top_logprobs"),  # without logprobs
    ({"messages": []}, "messages"),
    ({"messages": [{"role": "wizard", "content": "hi"}]}, "messages[0].role"),
    ({"messages": [{"role": "user"}]}, "messages[0]"),
    ({"messages": [{"role": "user", "content": None}]}, "messages[0]"),
    ({"messages": [*CHAT, {"role": "assistant", "content": None}]}, "messages[1]"),
    ({"n": 17}, "n"),
    ({"temperature": -1}, "temperature"),
    ({"stream_options": {"include_usage": True}}, "stream_options"),  # without stream
    ({"functions": [{"name": "f"}]}, "functions"),  # the legacy form of tools
    ({"tools": [{"type": "function", "function": {"name": "f g"}}]}, "tools[0].function.name"),
])
def test_invalid_chat_requests_are_bad_requests(live, kwargs, param):
    args = {"model": live.model, "messages": CHAT, "max_tokens": 4, **kwargs}
    with pytest.raises(openai.BadRequestError) as err:
        client(live).chat.completions.create(**args)
    assert err.value.param == param, err.value.message


def test_prompt_over_the_context_is_a_bad_request(live):
    ids = [42] * 2048
    with pytest.raises(openai.BadRequestError) as err:
        complete(live, prompt=ids, max_tokens=None)
    assert err.value.code == "context_length_exceeded" and err.value.param == "prompt"


def test_bad_json_and_wrong_types_are_bad_requests(live):
    headers = {"Authorization": f"Bearer {live.keys['acme']}"}
    for body in (b"{not json", b"[1, 2]", b'{"model": "m", "prompt": "x", "n": "2"}',
                 b'{"model": "m", "prompt": "x", "max_tokens": true}'):
        r = httpx.post(f"{live.url}/v1/completions", content=body, headers=headers)
        assert r.status_code == 400, body
        assert r.json()["error"]["type"] == "invalid_request_error"
    # The no-op values of fields we do not implement are as strict as any field's type.
    for field, value in (("best_of", True), ("best_of", 1.0), ("echo", 0), ("echo", 0.0)):
        r = httpx.post(f"{live.url}/v1/completions", headers=headers,
                       json={"model": live.model, "prompt": "x", "max_tokens": 1, field: value})
        assert r.status_code == 400 and r.json()["error"]["param"] == field, (field, value, r.text)
    for field, value in (("best_of", 1), ("echo", False), ("n", None)):
        r = httpx.post(f"{live.url}/v1/completions", headers=headers,
                       json={"model": live.model, "prompt": "x", "max_tokens": 1, field: value})
        assert r.status_code == 200, (field, value, r.text)


def test_admission_rejection_is_a_rate_limit_error_with_retry_after(live):
    c = client(live, "limited")
    stream = c.completions.create(model=live.model, prompt=PROMPT, max_tokens=200, stream=True)
    next(iter(stream))  # the one allowed request is now running
    with pytest.raises(openai.RateLimitError) as err:
        c.completions.create(model=live.model, prompt=PROMPT, max_tokens=2)
    assert err.value.response.headers["retry-after"] == "1"
    assert err.value.code == "max_concurrent" and "concurrent" in err.value.message

    # The client honours Retry-After: its retry, a second later, finds the
    # slot that closing the stream freed.
    result = {}

    def retrying():
        retrying_client = client(live, "limited", max_retries=3)
        start = time.monotonic()
        result["resp"] = retrying_client.completions.create(model=live.model, prompt=PROMPT, max_tokens=2)
        result["elapsed"] = time.monotonic() - start

    t = threading.Thread(target=retrying)
    t.start()
    time.sleep(0.3)
    stream.close()
    t.join(timeout=30)
    assert result["resp"].usage.completion_tokens == 2
    assert result["elapsed"] >= 0.9


def test_client_disconnect_aborts_the_engine_request(live):
    stream = client(live).completions.create(model=live.model, prompt=PROMPT, max_tokens=1500,
                                             extra_body={"min_tokens": 1500}, stream=True)
    next(iter(stream))
    assert live.gateway.in_flight >= 1
    stream.close()
    _assert_engine_idle_soon(live)


def _assert_engine_idle_soon(live):
    """Within 5 s, far less than the 1500 tokens asked for would take."""
    deadline = time.monotonic() + 5
    while live.gateway.in_flight and time.monotonic() < deadline:
        time.sleep(0.02)
    assert live.gateway.in_flight == 0
    llm_engine = live.gateway.engine._engine.engine
    while llm_engine.has_unfinished() and time.monotonic() < deadline:
        time.sleep(0.02)
    assert not llm_engine.has_unfinished()


# ---- HTTP-level guarantees ----


@pytest.mark.parametrize("host", ["localhost", "127.0.0.1", "internal.admin", "evil.example:80"])
def test_a_crafted_host_header_does_not_bypass_auth(live, host):
    r = httpx.get(f"{live.url}/v1/models", headers={"Host": host})
    assert r.status_code == 401
    r = httpx.get(f"{live.url}/admin/tenants", headers={"Host": host,
                                                        "Authorization": f"Bearer {live.keys['acme']}"})
    assert r.status_code == 401
    r = httpx.post(f"{live.url}/v1/completions", headers={"Host": host, "X-Forwarded-For": "127.0.0.1"},
                   json={"model": live.model, "prompt": "x"})
    assert r.status_code == 401


def test_every_response_has_a_request_id(live):
    auth = {"Authorization": f"Bearer {live.keys['acme']}"}
    for method, path, kwargs in [
        ("GET", "/health", {}), ("GET", "/ready", {}), ("GET", "/openapi.json", {}),
        ("GET", "/v1/models", {"headers": auth}), ("GET", "/v1/models", {}),
        ("GET", "/v1/nope", {"headers": auth}), ("DELETE", "/v1/models", {"headers": auth}),
        ("POST", "/v1/completions", {"headers": auth, "json": {"model": "nope", "prompt": "x"}}),
        ("POST", "/v1/completions", {"headers": auth, "json": {"model": live.model, "prompt": "x",
                                                               "max_tokens": 2, "stream": True}}),
    ]:
        r = httpx.request(method, f"{live.url}{path}", **kwargs)
        assert len(r.headers.get("x-request-id", "")) >= 16, (method, path, r.status_code)
    r = httpx.get(f"{live.url}/health", headers={"x-request-id": "trace-abc-123"})
    assert r.headers["x-request-id"] == "trace-abc-123"


def _exchange(sock, request: bytes) -> tuple[bytes, bytes]:
    """One request and its whole answer (a Content-Length body) on `sock`."""
    sock.sendall(request)
    received = b""
    while b"\r\n\r\n" not in received:
        received += sock.recv(65536)
    head, _, body = received.partition(b"\r\n\r\n")
    fields = dict(line.split(b": ", 1) for line in head.split(b"\r\n")[1:])
    length = int(next(value for name, value in fields.items() if name.lower() == b"content-length"))
    while len(body) < length:
        body += sock.recv(65536)
    return head, body


def test_an_unexpected_error_is_a_500_with_a_request_id_on_a_connection_that_stays_open(live, monkeypatch, caplog):
    """Starlette's last-resort handler answers without the middleware's
    request id and re-raises, after which uvicorn drops the connection
    unannounced; the gateway answers such a 500 itself."""
    def broken(prompt):
        raise RuntimeError("a bug")

    monkeypatch.setattr(live.gateway.engine, "tokenize", broken)
    body = json.dumps({"model": live.model, "prompt": PROMPT, "max_tokens": 2}).encode()
    request = (b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
               b"Authorization: Bearer " + live.keys["acme"].encode() + b"\r\nContent-Length: "
               + str(len(body)).encode() + b"\r\n\r\n" + body)
    host, port = live.url.removeprefix("http://").split(":")
    with socket.create_connection((host, int(port)), timeout=30) as sock:
        head, answer = _exchange(sock, request)
        assert head.startswith(b"HTTP/1.1 500 ") and b"x-request-id: " in head.lower(), head
        assert json.loads(answer)["error"]["code"] == "internal_error"
        assert b"connection: close" not in head.lower()
        monkeypatch.undo()
        head, answer = _exchange(sock, request)  # the same connection
        assert head.startswith(b"HTTP/1.1 200 "), head
    assert any("unhandled error" in r.getMessage() for r in caplog.records)


def test_an_unknown_model_name_is_echoed_only_in_part(live):
    with pytest.raises(openai.NotFoundError) as err:
        complete(live, model="m" * 100_000)
    assert "m" * 128 + "..." in err.value.message and len(err.value.message) < 300


def test_a_disallowed_method_is_a_405_that_says_which_are_allowed(live):
    r = httpx.get(f"{live.url}/v1/completions", headers={"Authorization": f"Bearer {live.keys['acme']}"})
    assert r.status_code == 405 and r.json()["error"]["code"] == "method_not_allowed"
    assert r.headers["allow"] == "POST"


def test_a_client_that_hangs_up_mid_body_is_no_error(live, caplog):
    """Content-Length promises more than is sent, then the client closes:
    a 499 nobody reads, not an unhandled error in the logs."""
    host, port = live.url.removeprefix("http://").split(":")
    with socket.create_connection((host, int(port)), timeout=10) as sock:
        sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                     b"Authorization: Bearer " + live.keys["acme"].encode()
                     + b"\r\nContent-Length: 100\r\n\r\n" + b'{"model": ')
    time.sleep(1.0)  # the server sees the hang-up within milliseconds; nothing marks its end from here
    assert not [r for r in caplog.records if r.levelno >= logging.ERROR], [r.getMessage() for r in caplog.records]
    assert httpx.get(f"{live.url}/health").status_code == 200


def test_health_ready_and_openapi(live):
    assert httpx.get(f"{live.url}/health").json() == {"status": "ok", "workers": {"0": "ready"}}
    assert httpx.get(f"{live.url}/ready").json()["status"] == "ready"
    doc = httpx.get(f"{live.url}/openapi.json").json()
    assert doc["openapi"].startswith("3.1")
    for path in ("/v1/chat/completions", "/v1/completions", "/v1/models", "/admin/tenants",
                 "/admin/adapters", "/admin/keys/{key_id}"):
        assert path in doc["paths"]
    schemas = doc["components"]["schemas"]
    assert {"ChatCompletionRequest", "ChatCompletion", "ChatCompletionChunk", "TenantCreate"} <= set(schemas)
    n = schemas["CompletionRequest"]["properties"]["n"]  # an integer, or null for the default
    assert next(s for s in n["anyOf"] if s.get("type") == "integer")["maximum"] == 16
    assert {"type": "null"} in n["anyOf"]


def test_draining_refuses_new_requests_but_health_answers(live):
    live.gateway.draining = True
    try:
        with pytest.raises(openai.InternalServerError) as err:
            complete(live, max_tokens=2)
        assert err.value.status_code == 503 and err.value.code == "draining"
        assert httpx.get(f"{live.url}/health").status_code == 200
        assert httpx.get(f"{live.url}/ready").status_code == 503
    finally:
        live.gateway.draining = False


def test_a_client_that_hangs_up_on_a_non_streamed_request_aborts_it(live):
    body = {"model": live.model, "prompt": PROMPT, "max_tokens": 1500, "min_tokens": 1500}
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(f"{live.url}/v1/completions", json=body, timeout=0.5,
                   headers={"Authorization": f"Bearer {live.keys['acme']}"})
    _assert_engine_idle_soon(live)


def test_health_answers_fast_while_the_engine_is_saturated(live):
    # Long enough to outlast the probes however warm the engine is (60 tokens
    # did not, once earlier tests had warmed it).
    body = {"model": live.model, "prompt": PROMPT, "max_tokens": 400, "min_tokens": 400, "stream": True}
    headers = {"Authorization": f"Bearer {live.keys['acme']}"}

    def drain_stream():
        with httpx.stream("POST", f"{live.url}/v1/completions", json=body, headers=headers, timeout=60) as r:
            for _ in r.iter_lines():
                pass

    load = [threading.Thread(target=drain_stream) for _ in range(12)]
    for t in load:
        t.start()
    _wait_until(lambda: live.gateway.in_flight >= 8)
    with httpx.Client(base_url=live.url) as probe:
        latencies = []
        for _ in range(20):
            start = time.perf_counter()
            assert probe.get("/health").status_code == 200
            latencies.append(time.perf_counter() - start)
            time.sleep(0.01)
    busy = live.gateway.in_flight
    for t in load:
        t.join(timeout=60)
    assert busy >= 1, "the load finished before the probes did"
    assert max(latencies) < 0.1, sorted(latencies)[-3:]


def _wait_until(predicate, timeout_s: float = 10.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.01)
