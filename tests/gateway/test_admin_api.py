"""The admin REST API: tenants, keys and adapters through HTTP, on both stores."""

from __future__ import annotations

import datetime as dt

import httpx
import pytest
from safetensors.torch import load, save

from adapters.errors import CONFIG_FILE, WEIGHTS_FILE
from adapters.registry import AdapterRegistry
from gateway.store.base import NotFound
from tests.gateway.admin_app import (ADMIN, adapter_files, admin_client, call_store, now, pickle_weights,
                                     spoil_config, upload_form)

ROUTES = [
    ("GET", "/admin/tenants"), ("POST", "/admin/tenants"), ("GET", "/admin/tenants/acme"),
    ("PATCH", "/admin/tenants/acme"), ("DELETE", "/admin/tenants/acme"), ("GET", "/admin/tenants/acme/keys"),
    ("POST", "/admin/tenants/acme/keys"), ("DELETE", "/admin/keys/k"), ("GET", "/admin/adapters"),
    ("POST", "/admin/adapters"), ("GET", "/admin/adapters/bot"), ("DELETE", "/admin/adapters/bot"),
    ("GET", "/admin/usage"),
]


@pytest.fixture
def registry(tmp_path, tiny_base_config):
    return AdapterRegistry(tmp_path / "adapters", base_config=tiny_base_config)


@pytest.fixture
def client(db_url, registry):
    with admin_client(db_url, registry, max_upload_bytes=1 << 20) as client:
        yield client


def assert_error(response, status: int, *fragments: str, param: str | None = "any"):
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"} and isinstance(error["code"], str)
    for fragment in fragments:
        assert fragment in error["message"], error["message"]
    if param != "any":
        assert error["param"] == param
    return error


def make_tenant(client, name="acme", **body):
    response = client.post("/admin/tenants", json={"name": name, **body}, headers=ADMIN)
    assert response.status_code == 201, response.text
    return response.json()


def test_admin_routes_refuse_tenant_keys_and_missing_tokens(client):
    make_tenant(client)
    tenant_key = client.post("/admin/tenants/acme/keys", json={}, headers=ADMIN).json()["key"]
    for credentials in [None, "Bearer " + tenant_key, "Bearer wrong", "Basic " + "admin-secret-token", "Bearer "]:
        headers = {"Authorization": credentials} if credentials else {}
        for method, path in ROUTES:
            response = client.request(method, path, headers=headers)
            assert_error(response, 401, "admin token")
            assert response.headers["x-request-id"]
    assert client.get("/admin/tenants/acme", headers=ADMIN).status_code == 200  # nothing changed


def test_no_admin_token_configured_refuses_everyone(db_url, registry):
    with admin_client(db_url, registry) as client:
        client.gateway.config.admin_token = None
        assert_error(client.get("/admin/tenants", headers=ADMIN), 401)
        assert_error(client.get("/admin/tenants", headers={"Authorization": "Bearer "}), 401)


def test_tenant_lifecycle(client):
    created = make_tenant(client, tier="premium", limits={"max_concurrent": 4, "requests_per_minute": 60})
    assert created["object"] == "tenant" and created["tier"] == "premium"
    assert created["limits"] == {"max_concurrent": 4, "requests_per_minute": 60, "tokens_per_minute": None}
    make_tenant(client, "beta")
    assert client.get("/admin/tenants/acme", headers=ADMIN).json() == created
    listed = client.get("/admin/tenants", headers=ADMIN).json()
    assert listed["object"] == "list" and [t["name"] for t in listed["data"]] == ["acme", "beta"]

    # PATCH changes only what is sent; an explicit null lifts a limit.
    patched = client.patch("/admin/tenants/acme", json={"limits": {"max_concurrent": None, "tokens_per_minute": 900}},
                           headers=ADMIN).json()
    assert patched["tier"] == "premium"
    assert patched["limits"] == {"max_concurrent": None, "requests_per_minute": 60, "tokens_per_minute": 900}
    assert client.patch("/admin/tenants/acme", json={"tier": "standard"}, headers=ADMIN).json()["tier"] == "standard"

    deleted = client.delete("/admin/tenants/acme", headers=ADMIN)
    assert deleted.json() == {"object": "tenant", "id": "acme", "deleted": True}
    for method in ("GET", "PATCH", "DELETE"):
        assert_error(client.request(method, "/admin/tenants/acme", json={}, headers=ADMIN), 404, "no tenant 'acme'")


@pytest.mark.parametrize("body, param, fragment", [
    ({"name": "acme"}, "name", "already exists"),
    ({"name": "Bad Name"}, "name", "should match pattern"),
    ({}, "name", "Field required"),
    ({"name": "x", "tier": "gold"}, "tier", "premium"),
    ({"name": "x", "limits": {"max_concurrent": 0}}, "limits.max_concurrent", "greater than 0"),
    ({"name": "x", "limits": {"rpm": 5}}, "limits.rpm", "Extra inputs"),
    ({"name": "x", "colour": "red"}, "colour", "Extra inputs"),
    ([1, 2], None, "valid dictionary"),
])
def test_bad_tenant_bodies_are_400_naming_the_field(client, body, param, fragment):
    make_tenant(client)
    status = 409 if fragment == "already exists" else 400
    assert_error(client.post("/admin/tenants", json=body, headers=ADMIN), status, fragment, param=param)


def test_malformed_json_body(client):
    response = client.post("/admin/tenants", content=b"{nope", headers={**ADMIN, "content-type": "application/json"})
    assert_error(response, 400, "not valid JSON")


def test_key_lifecycle(client):
    make_tenant(client)
    issued = client.post("/admin/tenants/acme/keys", json={"name": "ci", "expires_in": 3600}, headers=ADMIN)
    assert issued.status_code == 201
    key = issued.json()
    assert key["key"].startswith("lgw-") and key["prefix"] == key["key"][:12]
    assert key["status"] == "active" and key["tenant"] == "acme" and key["name"] == "ci"
    expires = dt.datetime.fromisoformat(key["expires_at"])
    assert dt.timedelta(minutes=59) < expires - now() <= dt.timedelta(hours=1)

    second = client.post("/admin/tenants/acme/keys", json={}, headers=ADMIN).json()
    listed = client.get("/admin/tenants/acme/keys", headers=ADMIN).json()["data"]
    assert [k["id"] for k in listed] == [key["id"], second["id"]]
    assert all("key" not in k for k in listed)  # the secret is shown once
    assert call_store(client, "authenticate", key["key"], now=now()).tenant.name == "acme"

    revoked = client.delete(f"/admin/keys/{key['id']}", headers=ADMIN).json()
    assert revoked["status"] == "revoked" and revoked["revoked_at"]
    assert call_store(client, "authenticate", key["key"], now=now()) is None
    assert call_store(client, "authenticate", second["key"], now=now()) is not None
    assert_error(client.delete("/admin/keys/nope", headers=ADMIN), 404, "no API key")

    client.delete("/admin/tenants/acme", headers=ADMIN)
    assert call_store(client, "authenticate", second["key"], now=now()) is None
    assert_error(client.post("/admin/tenants/acme/keys", json={}, headers=ADMIN), 404, "no tenant")


@pytest.mark.parametrize("body, param, fragment", [
    ({"expires_at": "2001-01-01T00:00:00Z"}, "expires_at", "in the past"),
    ({"expires_at": "2999-01-01T00:00:00"}, "expires_at", "timezone"),
    ({"expires_at": 32503680000}, "expires_at", "ISO 8601"),  # Unix seconds: not what the schema declares
    ({"expires_at": "32503680000"}, "expires_at", "ISO 8601"),
    ({"expires_at": 3.25e10}, "expires_at", "ISO 8601"),
    ({"expires_in": -5}, "expires_in", "greater than 0"),
    ({"expires_in": 60, "expires_at": "2999-01-01T00:00:00Z"}, None, "not both"),
    ({"secret": "mine"}, "secret", "Extra inputs"),
])
def test_bad_key_requests(client, body, param, fragment):
    make_tenant(client)
    assert_error(client.post("/admin/tenants/acme/keys", json=body, headers=ADMIN), 400, fragment, param=param)


def upload(client, name, config, weights, **fields):
    data, files = upload_form(name, config, weights, **fields)
    return client.post("/admin/adapters", data=data, files=files, headers=ADMIN)


def test_adapter_upload_list_and_delete(client, tiny_adapter_dir, registry):
    make_tenant(client)
    make_tenant(client, "beta")
    v1 = upload(client, "support-bot", *adapter_files(tiny_adapter_dir), tenant="acme")
    assert v1.status_code == 201, v1.text
    body = v1.json()
    assert (body["name"], body["owner"], body["shared"], body["latest_version"]) == ("support-bot", "acme", False, 1)
    assert body["versions"][0]["ref"] == "support-bot@1" and body["versions"][0]["rank"] == 4
    assert registry.resolve("support-bot").version == 1  # available at once, no restart

    # The same content again is the same version; new content is a new one.
    assert upload(client, "support-bot", *adapter_files(tiny_adapter_dir), tenant="acme").json()["latest_version"] == 1
    v2 = upload(client, "support-bot", *adapter_files(tiny_adapter_dir, scale=2.0), tenant="acme").json()
    assert [v["version"] for v in v2["versions"]] == [1, 2]
    assert_error(upload(client, "support-bot", *adapter_files(tiny_adapter_dir), tenant="beta"), 409,
                 "belongs to tenant 'acme'", param="tenant")
    shared = upload(client, "common", *adapter_files(tiny_adapter_dir), shared=True).json()
    assert (shared["owner"], shared["shared"]) == (None, True)

    listed = client.get("/admin/adapters", headers=ADMIN).json()["data"]
    assert [(a["name"], a["owner"], a["latest_version"]) for a in listed] == [("common", None, 1),
                                                                             ("support-bot", "acme", 2)]
    assert client.get("/admin/adapters/support-bot", headers=ADMIN).json() == v2
    grants = call_store(client, "list_adapter_grants", visible_to="beta")
    assert [g.name for g in grants] == ["common"]

    # Deleting one version keeps the name and its grant; deleting the name ends both.
    assert client.delete("/admin/adapters/support-bot@1", headers=ADMIN).json()["deleted"] is True
    assert [v["version"] for v in client.get("/admin/adapters/support-bot", headers=ADMIN).json()["versions"]] == [2]
    assert client.delete("/admin/adapters/support-bot", headers=ADMIN).status_code == 200
    assert_error(client.get("/admin/adapters/support-bot", headers=ADMIN), 404, "no adapter")
    assert_error(client.delete("/admin/adapters/support-bot", headers=ADMIN), 404, "no adapter")
    with pytest.raises(NotFound):
        call_store(client, "get_adapter_grant", "support-bot")
    # Now the name is free for another tenant; its versions keep counting up.
    again = upload(client, "support-bot", *adapter_files(tiny_adapter_dir), tenant="beta").json()
    assert (again["owner"], again["latest_version"]) == ("beta", 3)

    # Deleting a tenant deletes the adapters it owns.
    client.delete("/admin/tenants/beta", headers=ADMIN)
    assert_error(client.get("/admin/adapters/support-bot", headers=ADMIN), 404)
    assert [m.name for m in registry.list()] == ["common"]


def _truncate_a(config, weights):
    tensors = load(weights)
    name = next(k for k in tensors if "lora_A" in k)
    tensors[name] = tensors[name][:, :32].contiguous()
    return config, save(tensors)


MALFORMED = {
    "missing config": (lambda c, w: (None, w), {}, "missing file adapter_config.json"),
    "missing weights": (lambda c, w: (c, None), {}, "missing file adapter_model.safetensors"),
    "config not JSON": (lambda c, w: (b"{oops", w), {}, "adapter_config.json is not valid JSON"),
    "weights not safetensors": (lambda c, w: (c, b"\x00" * 64), {}, "not a valid safetensors file"),
    "pickle bytes as weights": (lambda c, w: (c, pickle_weights()), {}, "pickle-format weights"),
    "wrong shape": (_truncate_a, {}, "has wrong shape [4, 32], expected [4, 64]"),
    "DoRA": (lambda c, w: (spoil_config(c, use_dora=True), w), {}, "DoRA (use_dora=true) is not supported"),
    "unknown module": (lambda c, w: (spoil_config(c, target_modules=["q_proj", "foo_proj"]), w), {},
                       "unknown target module 'foo_proj'"),
    "layers_pattern named group": (
        lambda c, w: (spoil_config(c, layers_to_transform=[0], layers_pattern="(?P<idx>layers)"), w), {},
        "layers_pattern: invalid regex '(?P<idx>layers)': redefinition of group name 'idx'"),
    "lora_alpha NaN": (lambda c, w: (spoil_config(c, lora_alpha=float("nan")), w), {},
                       "adapter_config.json is not valid JSON: NaN is not a JSON number; every number must be finite"),
    "backreference regex": (lambda c, w: (spoil_config(c, target_modules=r"(.*)\1"), w), {},
                            r"RE2 does not support regex '(.*)\\1' (invalid escape sequence: \1)"),
    "lookahead regex": (lambda c, w: (spoil_config(c, target_modules=r"^(?!.*mlp).*proj"), w), {},
                        "target_modules: RE2 does not support regex '^(?!.*mlp).*proj'"),
    "bad name": (lambda c, w: (c, w), {"name": "Bad/Name"}, "invalid adapter name 'Bad/Name'"),
    "no name": (lambda c, w: (c, w), {"name": None}, "name: Field required"),
    "shared not a bool": (lambda c, w: (c, w), {"shared": "maybe"}, "shared: Input should be a valid boolean"),
    "unknown field": (lambda c, w: (c, w), {"rank": "4"}, "rank: Extra inputs"),
    "bad tenant name": (lambda c, w: (c, w), {"tenant": "No Such"}, "tenant: String should match pattern"),
}

# The field or file each names.
MALFORMED_PARAM = {
    "missing config": CONFIG_FILE,
    "missing weights": WEIGHTS_FILE,
    "config not JSON": CONFIG_FILE,
    "weights not safetensors": WEIGHTS_FILE,
    "pickle bytes as weights": WEIGHTS_FILE,
    "wrong shape": WEIGHTS_FILE,
    "DoRA": CONFIG_FILE,
    "unknown module": CONFIG_FILE,
    "layers_pattern named group": CONFIG_FILE,
    "lora_alpha NaN": CONFIG_FILE,
    "backreference regex": CONFIG_FILE,
    "lookahead regex": CONFIG_FILE,
    "bad name": "name",
    "no name": "name",
    "shared not a bool": "shared",
    "unknown field": "rank",
    "bad tenant name": "tenant",
}


@pytest.mark.parametrize("case", list(MALFORMED))
def test_each_malformed_upload_is_400_with_its_reason(client, tiny_adapter_dir, registry, case):
    spoil, fields, reason = MALFORMED[case]
    config, weights = spoil(*adapter_files(tiny_adapter_dir))
    fields = {"name": "bot", **fields}
    assert_error(upload(client, fields.pop("name"), config, weights, **fields), 400, reason,
                 param=MALFORMED_PARAM[case])
    assert registry.list() == []


def test_pickle_bin_file_is_refused(client, tiny_adapter_dir):
    config, _ = adapter_files(tiny_adapter_dir)
    files = {"adapter_config.json": ("adapter_config.json", config),
             "weights": ("adapter_model.bin", pickle_weights())}
    response = client.post("/admin/adapters", data={"name": "bot"}, files=files, headers=ADMIN)
    assert_error(response, 400, "pickle-format weights (adapter_model.bin) are not accepted", param=WEIGHTS_FILE)


def test_upload_that_is_not_multipart(client):
    assert_error(client.post("/admin/adapters", json={"name": "bot"}, headers=ADMIN), 400, "multipart/form-data")


def test_the_multipart_media_type_is_matched_without_regard_to_case(client, tiny_adapter_dir, registry):
    data, files = upload_form("bot", *adapter_files(tiny_adapter_dir))
    encoded = httpx.Request("POST", "http://x/admin/adapters", data=data, files=files)
    content_type = encoded.headers["content-type"]
    for sent, status in ((content_type.replace("multipart/form-data", "Multipart/Form-Data"), 201),
                         (content_type.replace("multipart/form-data", "multipart/form-dataX"), 400)):
        response = client.post("/admin/adapters", content=encoded.read(),
                               headers={**ADMIN, "content-type": sent})
        assert response.status_code == status, response.text
    assert [m.name for m in registry.list()] == ["bot"]


def test_upload_for_an_unknown_tenant_is_404(client, tiny_adapter_dir, registry):
    assert_error(upload(client, "bot", *adapter_files(tiny_adapter_dir), tenant="ghost"), 404, "no tenant 'ghost'")
    assert registry.list() == []


def test_upload_over_the_size_limit_is_413(db_url, registry, tiny_adapter_dir):
    config, weights = adapter_files(tiny_adapter_dir)
    with admin_client(db_url, registry, max_upload_bytes=len(weights) // 2) as client:
        assert_error(upload(client, "bot", config, weights), 413, "over the limit")

        # Without a Content-Length (chunked), the limit holds while reading.
        data, files = upload_form("bot", config, weights)
        request = client.build_request("POST", "/admin/adapters", data=data, files=files, headers=ADMIN)
        body = request.read()
        chunks = (body[i:i + 4096] for i in range(0, len(body), 4096))
        headers = {**ADMIN, "content-type": request.headers["content-type"]}
        assert_error(client.post("/admin/adapters", content=chunks, headers=headers), 413, "over the limit")
    assert registry.list() == []


def test_usage_is_an_empty_list_until_billing_fills_it(client):
    make_tenant(client)
    empty = {"object": "list", "data": [], "has_more": False, "next_cursor": None}
    assert client.get("/admin/usage", headers=ADMIN).json() == empty
    assert client.get("/admin/usage?tenant=acme", headers=ADMIN).json()["data"] == []
    # A name no tenant has now may still have records (a deleted tenant's): never a 404.
    assert client.get("/admin/usage?tenant=ghost", headers=ADMIN).json() == empty
