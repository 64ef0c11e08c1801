"""A change made through this gateway's /admin takes effect on it at once,
with no wait for the auth cache's TTL (the clock here never moves)."""

from __future__ import annotations

import pytest

from adapters.registry import AdapterRegistry
from gateway.auth_cache import AuthCache
from tests.gateway.admin_app import ADMIN, admin_client
from tests.gateway.fakes import ManualClock


@pytest.fixture
def client(db_url, tmp_path, tiny_base_config):
    registry = AdapterRegistry(tmp_path / "adapters", base_config=tiny_base_config)
    with admin_client(db_url, registry) as client:
        gw = client.gateway
        gw.auth = AuthCache(gw.store, ttl_s=60.0, stale_s=60.0, max_entries=100, clock=ManualClock())
        yield client


def _models(client, key: str) -> int:
    return client.get("/v1/models", headers={"Authorization": f"Bearer {key}"}).status_code


def test_db_hot_path_admin_revocation_and_deletion_take_effect_at_once_on_this_replica(client):
    assert client.post("/admin/tenants", json={"name": "acme"}, headers=ADMIN).status_code == 201
    first = client.post("/admin/tenants/acme/keys", json={}, headers=ADMIN).json()
    second = client.post("/admin/tenants/acme/keys", json={}, headers=ADMIN).json()
    assert _models(client, first["key"]) == _models(client, second["key"]) == 200  # both cached now
    assert client.delete(f"/admin/keys/{first['id']}", headers=ADMIN).status_code == 200
    assert (_models(client, first["key"]), _models(client, second["key"])) == (401, 200)
    assert client.delete("/admin/tenants/acme", headers=ADMIN).status_code == 200
    assert _models(client, second["key"]) == 401
