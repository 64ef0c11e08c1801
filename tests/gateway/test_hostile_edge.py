"""Issue 12, defect 1 and findings 10a/10e: bounds at the edge. Body and
header limits, the tenant's rate limits before any parsing, a prompt too
long for the context refused before it is tokenized, count and length
limits on request lists, and no redirect built from the Host header.

These run on a gateway app with a model-free engine that counts its
tokenizer calls (and on both stores, since auth is involved); the live
server tests (real uvicorn, tiny Llama) are in test_hostile_edge_live.py.
"""

from __future__ import annotations

import contextlib
import functools
import json
import threading

import pydantic
import pytest
from starlette.testclient import TestClient

from adapters.registry import AdapterRegistry
from engine.errors import ValidationError
from gateway.admission import AdmissionController
from gateway.app import Gateway, create_app
from gateway.config import GatewayConfig, TierLimits
from gateway.errors import InvalidRequest
from gateway.prepare import parse_body, prepare_chat, prepare_completion
from gateway.schemas.openai import MAX_MESSAGES, MAX_STOP_CHARS, ChatCompletionRequest, CompletionRequest
from gateway.store.sql import SqlStore
from gateway.tenancy import TenantLimits, Tier
from tests.gateway.admin_app import ADMIN, ADMIN_TOKEN, adapter_files, call_store, now, upload_form
from tests.gateway.fakes import FakeEngineClient

MODEL = "tiny-llama"
CHARS_PER_TOKEN = 4  # the counting engine's tokens are at most this long


class CountingEngine(FakeEngineClient):
    """A tokenizer of one token per character whose vocabulary's longest
    entry is CHARS_PER_TOKEN characters, so its floor is len / 4; it counts
    the calls that tokenize and the threads they ran on."""

    def __init__(self, registry=None):
        super().__init__(registry)
        self.tokenized = 0
        self.threads: set[str] = set()

    def tokenize(self, prompt):
        self.tokenized += 1
        self.threads.add(threading.current_thread().name)
        if isinstance(prompt, str):
            return super().tokenize(prompt)
        if any(t < 0 or t >= 50_000 for t in prompt):
            raise ValidationError("prompt", "token ids must be in [0, 50000)")
        return list(prompt)

    def apply_chat_template(self, messages, tools=None):
        self.tokenized += 1
        self.threads.add(threading.current_thread().name)
        return super().tokenize("".join(m["content"] for m in messages))

    def token_floor(self, text: str) -> int:
        return -(-len(text) // CHARS_PER_TOKEN)

    def chat_token_floor(self, messages, tools=None) -> int:
        return self.token_floor("".join(m["content"] for m in messages))


class FrozenClock:
    def __init__(self):
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


@contextlib.contextmanager
def edge_client(db_url: str, registry=None, *, tenant: str = "acme", **config):
    """A TestClient on a gateway with admission control, serving MODEL, with
    a new tenant (limits from `config.pop("limits")`) whose key is
    `client.key`."""
    limits = config.pop("limits", TenantLimits())
    engine = CountingEngine(registry)
    clock = FrozenClock()
    admission = AdmissionController({Tier.PREMIUM: TierLimits(), Tier.STANDARD: TierLimits()},
                                    lambda: engine.kv_capacity, clock=clock)
    gateway = Gateway(config=GatewayConfig(admin_token=ADMIN_TOKEN, served_model_name=MODEL, **config), store=SqlStore.from_url(db_url),
                      engine=engine, admission=admission, clock=clock)
    with TestClient(create_app(gateway)) as client:
        client.gateway = gateway
        call_store(client, "create_tenant", tenant, Tier.STANDARD, limits)
        issued = call_store(client, "create_key", tenant, now=now())
        client.key = issued.secret
        client.tenant_headers = {"Authorization": f"Bearer {issued.secret}"}
        yield client


def assert_error(response, status: int, code: str, param: str | None = "any") -> dict:
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert error["code"] == code, error
    if param != "any":
        assert error["param"] == param, error
    return error


def chunked(body: bytes, size: int = 4096):
    """The body as a generator, so the client sends it without a Content-Length."""
    return (body[i:i + size] for i in range(0, len(body), size))


# ---- defect 1: the body limit ----


def test_body_over_the_limit_is_413_on_v1_before_auth_and_while_reading(db_url):
    with edge_client(db_url, max_request_bytes=1024) as client:
        body = json.dumps({"model": MODEL, "prompt": "x" * 2000}).encode()
        # A declared Content-Length over the limit: refused before auth and before a byte is read.
        assert_error(client.post("/v1/completions", content=body), 413, "payload_too_large")
        # Chunked: counted while the handler reads it.
        r = client.post("/v1/completions", content=chunked(body), headers=client.tenant_headers)
        assert_error(r, 413, "payload_too_large")
        assert client.gateway.engine.tokenized == 0
        # Just under the limit is read and parsed as usual (here: a 400 for the unknown field value).
        small = json.dumps({"model": MODEL, "prompt": "hi", "n": "2"}).encode()
        assert_error(client.post("/v1/completions", content=chunked(small), headers=client.tenant_headers), 400,
                     "invalid_request", param="n")


def test_body_over_the_limit_is_413_on_admin(db_url):
    with edge_client(db_url, max_request_bytes=1024) as client:
        body = json.dumps({"name": "beta", "pad": "x" * 2000}).encode()
        assert_error(client.post("/admin/tenants", content=body, headers=ADMIN), 413, "payload_too_large")
        r = client.post("/admin/tenants", content=chunked(body), headers={**ADMIN, "content-type": "application/json"})
        assert_error(r, 413, "payload_too_large")
        assert client.get("/admin/tenants/beta", headers=ADMIN).status_code == 404


def test_adapter_upload_has_its_own_larger_body_limit(db_url, tmp_path, tiny_base_config, tiny_adapter_dir):
    registry = AdapterRegistry(tmp_path / "adapters", base_config=tiny_base_config)
    config, weights = adapter_files(tiny_adapter_dir)
    assert len(weights) > 1024
    with edge_client(db_url, registry, max_request_bytes=1024, max_upload_bytes=len(weights) * 4) as client:
        data, files = upload_form("bot", config, weights)
        r = client.post("/admin/adapters", data=data, files=files, headers=ADMIN)
        assert r.status_code == 201, r.text
    with edge_client(db_url, registry, tenant="beta", max_upload_bytes=len(weights) // 2) as client:
        data, files = upload_form("bot2", config, weights)
        r = client.post("/admin/adapters", data=data, files=files, headers=ADMIN)
        assert_error(r, 413, "payload_too_large")


# ---- defect 1: the tenant's rate limits come before any parsing ----


def test_rate_limit_before_parse_a_tenant_over_its_rpm_gets_429_for_any_body(db_url):
    with edge_client(db_url, max_request_bytes=4096, limits=TenantLimits(requests_per_minute=1)) as client:
        engine = client.gateway.engine
        # Refused requests take nothing from the budget: two bad bodies are two 400s.
        for _ in range(2):
            assert_error(client.post("/v1/completions", content=b"{not json", headers=client.tenant_headers), 400,
                         "invalid_request")
        # Spend the one request a minute (the clock is frozen, so it never refills).
        principal = call_store(client, "authenticate", client.key, now=now())
        client.portal.call(functools.partial(client.gateway.admission.admit, principal, prompt_tokens=1,
                                             max_tokens=1))

        malformed = client.post("/v1/completions", content=b"{not json", headers=client.tenant_headers)
        assert_error(malformed, 429, "requests_per_minute")
        assert malformed.headers["retry-after"]
        # A body past the limit, sent chunked, is never read: 429, not 413.
        huge = chunked(b"x" * 100_000)
        assert_error(client.post("/v1/chat/completions", content=huge, headers=client.tenant_headers), 429,
                     "requests_per_minute")
        # A prompt that would have to be tokenized is not.
        long_prompt = {"model": MODEL, "prompt": "y" * 3000}
        assert_error(client.post("/v1/completions", json=long_prompt, headers=client.tenant_headers), 429,
                     "requests_per_minute")
        assert engine.tokenized == 0


def test_rate_limit_before_parse_a_tenant_at_its_concurrency_limit_gets_429(db_url):
    with edge_client(db_url, limits=TenantLimits(max_concurrent=1)) as client:
        principal = call_store(client, "authenticate", client.key, now=now())
        ticket = client.portal.call(functools.partial(client.gateway.admission.admit, principal, prompt_tokens=1,
                                                      max_tokens=1))
        assert_error(client.post("/v1/completions", content=b"[]", headers=client.tenant_headers), 429, "max_concurrent")
        ticket.release()
        assert_error(client.post("/v1/completions", content=b"[]", headers=client.tenant_headers), 400, "invalid_request")


def test_a_full_tier_queue_refuses_before_parse_whatever_the_body(db_url):
    with edge_client(db_url) as client:
        engine = client.gateway.engine
        principal = call_store(client, "authenticate", client.key, now=now())
        admit = functools.partial(client.gateway.admission.admit, principal, prompt_tokens=1, max_tokens=1)
        tickets = [client.portal.call(admit) for _ in range(TierLimits().max_waiting)]  # the queue is full
        for body in (b"{not json", json.dumps({"model": "no-such-model", "prompt": "hi"}).encode(),
                     json.dumps({"model": MODEL, "prompt": "y" * 3000}).encode()):
            r = client.post("/v1/completions", content=body, headers=client.tenant_headers)
            assert_error(r, 429, "tier_queue_full")
            assert int(r.headers["retry-after"]) >= 1
        assert engine.tokenized == 0
        tickets[0].started()  # a place frees: the body is read again, and judged
        assert_error(client.post("/v1/completions", content=b"{not json", headers=client.tenant_headers), 400,
                     "invalid_request")
        rejected = client.gateway.admission.snapshot()["standard"]["rejected"]
        assert rejected == {"max_waiting": 3}


# ---- defect 1: a prompt too long for the context, refused before tokenizing ----


def test_prompt_floor_refuses_a_text_prompt_without_tokenizing(db_url):
    with edge_client(db_url) as client:
        engine = client.gateway.engine
        limit = engine.max_model_len
        # At least 2048 tokens (8192 characters of at most 4 each): no room to generate.
        r = client.post("/v1/completions", json={"model": MODEL, "prompt": "z" * (limit * CHARS_PER_TOKEN)},
                        headers=client.tenant_headers)
        error = assert_error(r, 400, "context_length_exceeded", param="prompt")
        assert "at least 2048 tokens" in error["message"]
        # At least 1000 tokens plus max_tokens past the context.
        r = client.post("/v1/completions", json={"model": MODEL, "prompt": "z" * 4000, "max_tokens": 1100},
                        headers=client.tenant_headers)
        assert_error(r, 400, "context_length_exceeded", param="max_tokens")
        messages = [{"role": "user", "content": "z" * (limit * CHARS_PER_TOKEN)}]
        r = client.post("/v1/chat/completions", json={"model": MODEL, "messages": messages}, headers=client.tenant_headers)
        assert_error(r, 400, "context_length_exceeded", param="messages")
        assert engine.tokenized == 0


def test_prompt_floor_never_refuses_a_prompt_that_fits():
    engine = CountingEngine()
    limit = engine.max_model_len
    # The floor is 511 tokens; the real count (one per character) is 2044, which fits with 4 to spare.
    req = CompletionRequest.model_validate({"model": MODEL, "prompt": "z" * (limit - 4), "max_tokens": 4})
    assert len(prepare_completion(req, engine).prompt_ids) == limit - 4
    chat = ChatCompletionRequest.model_validate(
        {"model": MODEL, "messages": [{"role": "user", "content": "z" * (limit - 1)}], "max_tokens": 1})
    assert len(prepare_chat(chat, engine).prompt_ids) == limit - 1
    # One more character does not fit: found by the exact count, after tokenizing.
    req = CompletionRequest.model_validate({"model": MODEL, "prompt": "z" * (limit - 3), "max_tokens": 4})
    with pytest.raises(InvalidRequest, match=f"prompt \\({limit - 3} tokens\\)"):
        prepare_completion(req, engine)


def test_prompt_floor_token_id_prompts_are_measured_before_their_ids_are_checked():
    engine = CountingEngine()
    ids = [-1] * engine.max_model_len  # every id out of the vocabulary, and too many of them
    req = CompletionRequest.model_validate({"model": MODEL, "prompt": ids})
    with pytest.raises(InvalidRequest) as raised:
        prepare_completion(req, engine)
    assert raised.value.code == "context_length_exceeded" and engine.tokenized == 0
    short = CompletionRequest.model_validate({"model": MODEL, "prompt": [-1] * 10})
    with pytest.raises(ValidationError, match="token ids"):
        prepare_completion(short, engine)


def test_prepare_runs_on_a_worker_thread_not_the_event_loop(db_url):
    with edge_client(db_url) as client:
        r = client.post("/v1/completions", json={"model": MODEL, "prompt": "z" * 3000}, headers=client.tenant_headers)
        assert_error(r, 400, "context_length_exceeded")  # 3000 tokens, found by tokenizing
        engine = client.gateway.engine
        assert engine.tokenized == 1
        loop_thread = client.portal.call(lambda: threading.current_thread().name)
        assert engine.threads and loop_thread not in engine.threads


# ---- 10e: stop strings and messages have limits ----


def test_stop_and_messages_limits_are_400s_naming_the_parameter(db_url):
    with edge_client(db_url) as client:
        def post(path, **body):
            return client.post(path, json={"model": MODEL, **body}, headers=client.tenant_headers)

        chat = [{"role": "user", "content": "hi"}]
        assert_error(post("/v1/completions", prompt="hi", stop="s" * (MAX_STOP_CHARS + 1)), 400,
                     "invalid_request", param="stop")
        assert_error(post("/v1/completions", prompt="hi", stop=["ok", "s" * (MAX_STOP_CHARS + 1)]), 400,
                     "invalid_request", param="stop")
        assert_error(post("/v1/chat/completions", messages=chat, stop=["a"] * 5), 400, "invalid_request",
                     param="stop")
        error = assert_error(post("/v1/chat/completions", messages=chat * (MAX_MESSAGES + 1)), 400, "invalid_request",
                             param="messages")
        assert str(MAX_MESSAGES) in error["message"]
        assert client.gateway.engine.tokenized == 0


def test_stop_and_messages_limits_admit_the_largest_allowed():
    body = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}] * MAX_MESSAGES,
            "stop": ["s" * MAX_STOP_CHARS] * 4}
    req = parse_body(json.dumps(body).encode(), ChatCompletionRequest)
    assert len(req.messages) == MAX_MESSAGES and req.stop == ["s" * MAX_STOP_CHARS] * 4


@pytest.mark.parametrize("body", [
    {"prompt": [1] + [{}] * 200_000},
    {"prompt": ["a"] * 200_000},
    {"prompt": [[1]] * 200_000},
    {"stop": [1] * 200_000, "prompt": "hi"},
    {"messages": [1] * 200_000},
    {"messages": [{"role": "user", "content": [1] * 200_000}]},
])
def test_request_lists_stop_at_their_first_bad_item(body):
    """pydantic reports every bad item by default: hundreds of thousands of
    errors are seconds of CPU with the GIL held, which no worker thread hides."""
    schema = ChatCompletionRequest if "messages" in body else CompletionRequest
    with pytest.raises(pydantic.ValidationError) as raised:
        schema.model_validate({"model": MODEL, **body})
    assert raised.value.error_count() <= 4


# ---- 10a: no redirect built from the Host header ----


@pytest.mark.parametrize("method,path", [("GET", "/v1/models/"), ("POST", "/v1/completions/"), ("GET", "/health/")])
def test_trailing_slash_is_a_404_not_a_redirect_to_the_host_header(db_url, method, path):
    with edge_client(db_url) as client:
        r = client.request(method, path, headers={**client.tenant_headers, "Host": "evil.example"}, follow_redirects=False)
        assert "location" not in r.headers
        assert_error(r, 404, "not_found")


# ---- robustness test 2: the HTTP parser and its head limit are pinned ----


def test_the_http_parser_is_pinned_to_h11_with_the_header_limit(tmp_path):
    """uvicorn's default ("auto") would take httptools when it is installed,
    which has no head limit of its own; the 431 itself is tested live."""
    from gateway.http_protocol import GatewayH11Protocol
    from gateway.server import make_server

    gateway = Gateway(config=GatewayConfig(max_header_bytes=12_345, request_read_timeout_s=7.5), store=None,
                      engine=CountingEngine(), admission=None)
    config = make_server(gateway).config
    assert config.http.func is GatewayH11Protocol and config.http.keywords == {"read_timeout_s": 7.5}
    assert config.h11_max_incomplete_event_size == 12_345
