"""Malformed input is a 400 naming what is wrong, never a 500, on both stores:
JSON nested past any sane depth, NUL bytes bound for PostgreSQL, lone
surrogates, integers past their column, and dates past datetime's range."""

from __future__ import annotations

import json

import pytest

from adapters.registry import AdapterRegistry
from gateway.json_body import MAX_JSON_DEPTH
from gateway.schemas.admin import MAX_KEY_LIFETIME_S, MAX_LIMIT
from tests.gateway.admin_app import ADMIN, admin_client, call_store
from tests.gateway.test_admin_api import assert_error, make_tenant

V1 = ("/v1/chat/completions", "/v1/completions")


@pytest.fixture
def client(db_url, tmp_path, tiny_base_config):
    with admin_client(db_url, AdapterRegistry(tmp_path / "adapters", base_config=tiny_base_config)) as client:
        make_tenant(client)
        key = client.post("/admin/tenants/acme/keys", json={}, headers=ADMIN).json()["key"]
        client.tenant_headers = {"Authorization": f"Bearer {key}", "Content-Type": "application/json"}
        yield client


def post_raw(client, path: str, raw: bytes):
    headers = client.tenant_headers if path.startswith("/v1") else {**ADMIN, "Content-Type": "application/json"}
    return client.post(path, content=raw, headers=headers)


def chat(model: str = "tiny-llama", **fields) -> dict:
    return {"model": model, "messages": [{"role": "user", "content": "hi"}], **fields}


@pytest.mark.parametrize("path", [*V1, "/admin/tenants"])
def test_deeply_nested_json_is_a_bad_request(client, path):
    # 100k levels: json.loads itself runs out of recursion (the old 500).
    assert_error(post_raw(client, path, b"[" * 100_000 + b"]" * 100_000), 400, "nested deeper")
    assert_error(post_raw(client, path, b'{"a":' * 100_000 + b"1" + b"}" * 100_000), 400, "nested deeper")
    # Parsable, but deeper than the bound: refused before any validator walks it.
    deep = json.dumps({"name": "x", "model": "m", "metadata": json.loads("[" * 200 + "]" * 200)}).encode()
    assert_error(post_raw(client, path, deep), 400, "nested deeper")


def test_json_at_the_depth_bound_is_still_parsed(client):
    # metadata is an ignored OpenAI field: at exactly the bound the body gets
    # past parsing and fails on what it says (an unknown model), not its shape.
    nested = json.loads("[" * (MAX_JSON_DEPTH - 1) + "]" * (MAX_JSON_DEPTH - 1))
    response = post_raw(client, "/v1/chat/completions", json.dumps(chat("no-such-model", metadata=nested)).encode())
    assert_error(response, 404, param="model")


@pytest.mark.parametrize("path", V1)
def test_nul_byte_in_model_is_a_bad_request(client, path):
    body = chat("tiny\x00lora") if "chat" in path else {"model": "tiny\x00lora", "prompt": "hi"}
    assert_error(client.post(path, json=body, headers=client.tenant_headers), 400, "NUL", param="model")
    body["model"], body["user"] = "tiny-lora", "end\x00user"
    assert_error(client.post(path, json=body, headers=client.tenant_headers), 400, "NUL", param="user")


@pytest.mark.parametrize("path", V1)
def test_an_adapter_version_past_int_s_digit_limit_is_not_a_server_error(client, path):
    """int() refuses more than 4,300 digits: such a version used to be a 500."""
    model = "some-adapter@" + "9" * 5000
    body = chat(model) if "chat" in path else {"model": model, "prompt": "hi"}
    assert_error(client.post(path, json=body, headers=client.tenant_headers), 404, param="model")
    assert_error(client.delete(f"/admin/adapters/{model}", headers=ADMIN), 400, "invalid adapter reference")


def test_nul_byte_in_tenant_name_is_a_bad_request(client):
    assert_error(client.post("/admin/tenants", json={"name": "ac\x00me"}, headers=ADMIN), 400, param="name")
    for method, path in [("GET", "/admin/tenants/ac%00me"), ("PATCH", "/admin/tenants/ac%00me"),
                         ("DELETE", "/admin/tenants/ac%00me"), ("GET", "/admin/tenants/ac%00me/keys"),
                         ("POST", "/admin/tenants/ac%00me/keys"), ("GET", "/admin/usage?tenant=ac%00me")]:
        assert_error(client.request(method, path, headers=ADMIN), 400, "NUL", param="tenant")
    assert_error(client.delete("/admin/keys/k%00", headers=ADMIN), 400, "NUL", param="key_id")
    assert_error(client.post("/admin/tenants/acme/keys", json={"name": "ci\x00"}, headers=ADMIN), 400, "NUL",
                 param="name")
    assert [t["name"] for t in client.get("/admin/tenants", headers=ADMIN).json()["data"]] == ["acme"]


@pytest.mark.parametrize("path", [*V1, "/admin/tenants"])
def test_lone_surrogate_is_a_bad_request(client, path):
    # Valid JSON, but no UTF-8 encoder (asyncpg, the tokenizer, the response) takes it.
    raw = b'{"model": "\\ud800", "name": "\\udfff", "messages": [], "prompt": "x"}'
    assert_error(post_raw(client, path, raw), 400, "surrogate")
    # A surrogate pair is an ordinary character (here an emoji) and gets past parsing.
    paired = post_raw(client, path, b'{"model": "\\ud83d\\ude00", "name": "\\ud83d\\ude00", "prompt": "x"}')
    assert paired.status_code in (400, 404) and "surrogate" not in paired.text


@pytest.mark.parametrize("path", [*V1, "/admin/tenants"])
@pytest.mark.parametrize("encode", [
    lambda text: text.encode("utf-8", "surrogatepass"),  # CESU-8: the surrogate's own three bytes
    lambda text: text.encode("utf-16", "surrogatepass"),
], ids=["cesu-8", "utf-16"])
def test_a_body_that_is_not_utf_8_is_a_bad_request(client, path, encode):
    """json.loads would take both (it guesses UTF-16 from the NULs, and
    passes surrogates through): a lone surrogate could then reach an
    encoder, and RFC 8259 has JSON between systems in UTF-8."""
    raw = encode('{"model": "m", "name": "a\ud800b", "prompt": "x", "messages": []}')
    assert_error(post_raw(client, path, raw), 400, "UTF-8")


def test_a_leading_byte_order_mark_is_ignored(client):
    raw = b'\xef\xbb\xbf' + json.dumps({"name": "bom"}).encode()
    assert post_raw(client, "/admin/tenants", raw).status_code == 201
    assert "bom" in [t["name"] for t in client.get("/admin/tenants", headers=ADMIN).json()["data"]]


@pytest.mark.parametrize("path", [*V1, "/admin/tenants"])
@pytest.mark.parametrize("raw", [b'{"temperature": NaN}', b'{"temperature": Infinity}',
                                 b'{"seed": ' + b"9" * 5000 + b"}"], ids=["nan", "infinity", "5000-digits"])
def test_non_json_numbers_are_a_bad_request(client, path, raw):
    assert_error(post_raw(client, path, raw), 400, "not valid JSON")


@pytest.mark.parametrize("value", [MAX_LIMIT + 1, 2**63, 2**64])
@pytest.mark.parametrize("field", ["max_concurrent", "requests_per_minute", "tokens_per_minute"])
def test_admin_integers_past_their_column_are_a_bad_request(client, field, value):
    param = f"limits.{field}"
    assert_error(client.post("/admin/tenants", json={"name": "big", "limits": {field: value}}, headers=ADMIN),
                 400, param=param)
    assert_error(client.patch("/admin/tenants/acme", json={"limits": {field: value}}, headers=ADMIN), 400,
                 param=param)
    # The column's own maximum is stored and read back exactly on both stores.
    created = make_tenant(client, f"edge-{field.replace('_', '-')}", limits={field: MAX_LIMIT})
    assert created["limits"][field] == MAX_LIMIT
    assert getattr(call_store(client, "get_tenant", created["name"]).limits, field) == MAX_LIMIT


@pytest.mark.parametrize("value", ["5", 5.0, True])
def test_admin_integers_are_integers_as_sent(client, value):
    assert_error(client.post("/admin/tenants", json={"name": "typed", "limits": {"max_concurrent": value}},
                             headers=ADMIN), 400, param="limits.max_concurrent")
    assert_error(client.post("/admin/tenants/acme/keys", json={"expires_in": value}, headers=ADMIN), 400,
                 param="expires_in")


@pytest.mark.parametrize("body, param", [
    ({"expires_in": 2**63}, "expires_in"),
    ({"expires_in": MAX_KEY_LIFETIME_S + 1}, "expires_in"),
    ({"expires_at": "9999-12-31T23:00:00-05:00"}, "expires_at"),  # past datetime.max in UTC
])
def test_huge_expires_in_is_a_bad_request(client, body, param):
    assert_error(client.post("/admin/tenants/acme/keys", json=body, headers=ADMIN), 400, param=param)
    issued = client.post("/admin/tenants/acme/keys", json={"expires_in": MAX_KEY_LIFETIME_S}, headers=ADMIN)
    assert issued.status_code == 201, issued.text


@pytest.mark.parametrize("query, param", [
    ("since=0001-01-01T00:00:00%2B01:00", "since"),  # before datetime.min in UTC
    ("until=9999-12-31T23:59:59-01:00", "until"),  # after datetime.max in UTC
    ("since=99999-01-01", "since"),
    ("until=2026-01-01%00", "until"),
    ("group_by=week", "group_by"),
    ("group_by=", "group_by"),  # found by the fuzzer: an empty value was taken as the default
    ("since=2000-01-01&tenat=acme", "tenat"),  # found by the fuzzer: a misspelt filter was ignored
])
def test_extreme_since_is_a_bad_request(client, query, param):
    assert_error(client.get(f"/admin/usage?{query}", headers=ADMIN), 400, param=param)
    edges = client.get("/admin/usage?since=0001-01-01&until=9999-12-31T23:59:59.999999", headers=ADMIN)
    assert edges.status_code == 200 and edges.json()["data"] == []
    assert client.get("/admin/usage?since=&until=", headers=ADMIN).status_code == 200  # empty: no bound


def test_usage_query_parameters_are_the_ones_the_openapi_document_declares():
    from gateway.routes.admin import USAGE_QUERY
    from gateway.routes.openapi import build_document

    declared = build_document()["paths"]["/admin/usage"]["get"]["parameters"]
    assert [(p["name"], p["in"]) for p in declared] == [(name, "query") for name in USAGE_QUERY]
