"""Adapter uploads racing each other and tenant deletion, on both stores: the
owner check, the weights and the grant are one step (admin_service's
`adapter_writes`), and an upload whose grant fails leaves no weights behind.
A black-box pass found two tenants uploading one new name at once could
each pass the owner check, and the grant written last gave its tenant the
other's weights."""

from __future__ import annotations

import asyncio
import datetime as dt

import pytest

from adapters.registry import AdapterRegistry
from gateway.admin_service import AdminService
from gateway.schemas.admin import AdapterOut, AdapterUpload
from gateway.store.base import Conflict, NotFound
from tests.gateway.admin_app import ADMIN, adapter_files, admin_client
from tests.gateway.test_admin_api import make_tenant


@pytest.fixture
def registry(tmp_path, tiny_base_config):
    return AdapterRegistry(tmp_path / "adapters", base_config=tiny_base_config)


@pytest.fixture
def client(db_url, registry):
    with admin_client(db_url, registry) as client:
        make_tenant(client, "t1")
        make_tenant(client, "t2")
        yield client


def service(client, registry) -> AdminService:
    return AdminService(client.gateway.store, registry=lambda: registry, now=lambda: dt.datetime.now(dt.UTC))


def test_two_tenants_uploading_one_new_name_at_once_get_one_owner_and_its_weights(client, registry,
                                                                                   tiny_adapter_dir):
    files = {"t1": adapter_files(tiny_adapter_dir, scale=1.0), "t2": adapter_files(tiny_adapter_dir, scale=2.0)}
    digests = {}
    for tenant, (config, weights) in files.items():  # each content's digest, from a registry of its own
        digests[tenant] = AdapterRegistry(registry.root.parent / tenant, base_config=registry.base).put(
            "probe", config, weights).digest

    async def race(name: str):
        admin = service(client, registry)
        uploads = [admin.upload_adapter(AdapterUpload(name=name, tenant=t), *files[t]) for t in ("t1", "t2")]
        return await asyncio.gather(*uploads, return_exceptions=True)

    for round_ in range(4):
        name = f"race{round_}"
        results = client.portal.call(race, name)
        won = [r for r in results if not isinstance(r, BaseException)]
        lost = [r for r in results if isinstance(r, BaseException)]
        assert len(won) == 1 and len(lost) == 1 and isinstance(lost[0], Conflict), results
        owner = won[0].owner
        stored = [m for m in registry.list(all_versions=True) if m.name == name]
        assert [m.digest for m in stored] == [digests[owner]], (owner, stored)
        shown = client.get(f"/admin/adapters/{name}", headers=ADMIN).json()
        assert shown["owner"] == owner and [v["version"] for v in shown["versions"]] == [1]


def test_an_upload_whose_grant_fails_leaves_no_weights(client, registry, tiny_adapter_dir, monkeypatch):
    """As when its tenant is deleted between the check and the grant: the
    weights used to stay, as a platform adapter nobody uploaded."""
    async def tenant_gone(name, *, owner, shared):
        raise NotFound(f"no tenant {owner!r}", param="tenant")

    monkeypatch.setattr(client.gateway.store, "grant_adapter", tenant_gone)
    with pytest.raises(NotFound):
        client.portal.call(service(client, registry).upload_adapter, AdapterUpload(name="bot", tenant="t1"),
                           *adapter_files(tiny_adapter_dir))
    assert registry.list(all_versions=True) == []


def test_a_failed_grant_after_an_identical_upload_keeps_the_version_it_found(client, registry, tiny_adapter_dir,
                                                                             monkeypatch):
    """`put` hands back the latest version for identical content: the
    rollback deletes only what the failed upload itself stored."""
    admin = service(client, registry)
    first = client.portal.call(admin.upload_adapter, AdapterUpload(name="bot", tenant="t1"),
                               *adapter_files(tiny_adapter_dir))

    async def down(name, *, owner, shared):
        raise NotFound(f"no tenant {owner!r}", param="tenant")

    monkeypatch.setattr(client.gateway.store, "grant_adapter", down)
    with pytest.raises(NotFound):
        client.portal.call(admin.upload_adapter, AdapterUpload(name="bot", tenant="t1"),
                           *adapter_files(tiny_adapter_dir))
    assert [m.version for m in registry.list(all_versions=True)] == [v.version for v in first.versions] == [1]


def test_an_upload_and_its_tenant_s_deletion_never_leave_an_orphan(client, registry, tiny_adapter_dir):
    async def race(name: str, tenant: str):
        admin = service(client, registry)
        upload = admin.upload_adapter(AdapterUpload(name=name, tenant=tenant), *adapter_files(tiny_adapter_dir))
        return await asyncio.gather(upload, admin.delete_tenant(tenant), return_exceptions=True)

    for round_ in range(3):
        tenant = f"gone{round_}"
        make_tenant(client, tenant)
        uploaded, deleted = client.portal.call(race, f"orphan{round_}", tenant)
        assert not isinstance(deleted, BaseException), deleted
        # It landed first (then went with its tenant), or found no tenant.
        assert isinstance(uploaded, (AdapterOut, NotFound)), uploaded
        assert [m.name for m in registry.list(all_versions=True) if m.name == f"orphan{round_}"] == []


@pytest.mark.parametrize("repeat", ["name", "tenant", "adapter_model.safetensors"])
def test_a_field_sent_twice_is_a_400_not_the_last_one_winning(client, registry, tiny_adapter_dir, repeat):
    """Which tenant owns the adapter, or which weights it has, must not hang on
    the order the fields were sent in."""
    config, weights = adapter_files(tiny_adapter_dir)
    other_weights = adapter_files(tiny_adapter_dir, scale=2.0)[1]
    data = {"name": ["bot", "bot2"] if repeat == "name" else "bot",
            "tenant": ["t1", "t2"] if repeat == "tenant" else "t1"}
    files = [("adapter_config.json", ("adapter_config.json", config, "application/json")),
             ("adapter_model.safetensors", ("adapter_model.safetensors", weights, "application/octet-stream"))]
    if repeat == "adapter_model.safetensors":
        files.append(("adapter_model.safetensors", ("adapter_model.safetensors", other_weights, "x/y")))
    response = client.post("/admin/adapters", data=data, files=files, headers=ADMIN)
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["param"] == repeat and "more than once" in error["message"]
    assert registry.list(all_versions=True) == []


def test_a_usage_query_parameter_given_twice_is_a_400(client):
    response = client.get("/admin/usage?tenant=t1&tenant=t2", headers=ADMIN)
    assert response.status_code == 400 and response.json()["error"]["param"] == "tenant"
