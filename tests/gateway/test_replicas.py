"""Two gateway replicas, each with its own engine and usage spool, sharing
one Redis (tenant limits) and one PostgreSQL (tenants, keys, the ledger):
a tenant's limits hold across both, and every request each one serves is
billed exactly once in the shared ledger.

The failure modes are then tested on one replica whose Redis is a port
nothing listens on."""

from __future__ import annotations

import asyncio
import datetime as dt
import json

import httpx
import pytest

from billing.records import REQUEST
from engine.config import EngineConfig
from gateway.config import GatewayConfig, RedisLimitsConfig
from gateway.tenancy import TenantLimits, Tier
from tests.billing.live_helpers import ledger_records, request_id_of
from tests.gateway.live import (ADMIN_TOKEN, build_in_process_gateway, run_with_store, seed_tenants,
                                start_live_server, wait_for)

RPM = 5
# Nothing listens on port 1 of the loopback: connections are refused at once.
UNREACHABLE_REDIS = "redis://127.0.0.1:1/0"


def _replica(tmp, name: str, model_dir, db_url: str, redis: RedisLimitsConfig):
    data = tmp / name
    engine = EngineConfig.from_flat(model=str(model_dir), num_kv_blocks=256, data_dir=str(data))
    gw = build_in_process_gateway(GatewayConfig(db_url=db_url, engine=engine, data_dir=data, redis=redis,
                                                admin_token=ADMIN_TOKEN))
    return start_live_server(gw)


@pytest.fixture(scope="module")
def replicas(tiny_llama_dir, tmp_path_factory):
    """Module-scoped, so the store fixtures are read here by hand."""
    import os

    from tests.gateway.conftest import _reset_postgres
    from tests.stores import POSTGRES_ENV, REDIS_ENV, unavailable

    db_url, redis_url = os.environ.get(POSTGRES_ENV), os.environ.get(REDIS_ENV)
    for store, url in (("PostgreSQL", db_url), ("Redis", redis_url)):
        if not url:
            pytest.skip(unavailable(store))
    pytest.importorskip("redis", reason="Redis: the redis package is not installed")
    asyncio.run(_reset_postgres(db_url))
    keys = seed_tenants(db_url, {"metered": (Tier.STANDARD, TenantLimits(requests_per_minute=RPM)),
                                 "narrow": (Tier.STANDARD, TenantLimits(max_concurrent=2))})
    tmp = tmp_path_factory.mktemp("replicas")
    servers = [_replica(tmp, name, tiny_llama_dir, db_url, RedisLimitsConfig(url=redis_url)) for name in "ab"]
    yield servers, keys, db_url
    for server in servers:
        server.stop()


def _body(server, **extra) -> dict:
    return {"model": server.gateway.served_model_name, "prompt": "Once upon a time", "max_tokens": 1,
            "temperature": 0.0, **extra}


async def _post(server, key: str) -> httpx.Response:
    async with httpx.AsyncClient(base_url=server.url, timeout=60) as client:
        return await client.post("/v1/completions", json=_body(server), headers={"Authorization": f"Bearer {key}"})


def test_replicas_together_admit_exactly_the_tenants_rpm_and_bill_each_request_once(replicas):
    servers, keys, db_url = replicas

    async def flood():
        return await asyncio.gather(*(_post(servers[i % 2], keys["metered"]) for i in range(12)))

    responses = asyncio.run(flood())
    by_replica = [[r.status_code for r in responses[i::2]] for i in range(2)]
    served = [r for r in responses if r.status_code == 200]
    assert len(served) == RPM
    assert all(429 in statuses for statuses in by_replica), by_replica  # each replica refuses some
    assert all(r.json()["error"]["code"] == "requests_per_minute" and int(r.headers["retry-after"]) >= 1
               for r in responses if r.status_code == 429)
    assert sorted(r.status_code for r in responses) == [200] * RPM + [429] * (12 - RPM)

    # Each replica's spool flushes its own records into the one ledger.
    served_ids = sorted(request_id_of(r.json()) for r in served)

    def billed():
        rows = [r for r in ledger_records(db_url) if r.kind == REQUEST and r.tenant == "metered"]
        return rows if len(rows) >= RPM else None

    rows = wait_for(billed, 30, "both replicas' usage in the ledger")
    assert sorted(r.request_id for r in rows) == served_ids  # every one, once
    usage = {request_id_of(r.json()): r.json()["usage"] for r in served}
    assert all(row.prompt_tokens == usage[row.request_id]["prompt_tokens"]
               and row.completion_tokens == usage[row.request_id]["completion_tokens"] for row in rows)


def _on_loop(server, work):
    """Run `work()` on the live server's event loop (the limiter's client
    lives there) and return its result."""
    async def run():
        result = work()
        return await result if asyncio.iscoroutine(result) else result

    return asyncio.run_coroutine_threadsafe(run(), server.server._loop).result(timeout=10)


def test_replicas_share_the_tenants_concurrency_limit(replicas):
    servers, keys, db_url = replicas
    key = keys["narrow"]
    principal = run_with_store(db_url, lambda store: store.authenticate(key, now=dt.datetime.now(dt.UTC)))
    # One request in flight on each replica: held by each one's own admission,
    # as a request waiting on its engine would hold it.
    tickets = [_on_loop(s, lambda s=s: s.gateway.admission.admit(principal, prompt_tokens=1, max_tokens=1))
               for s in servers]
    refused = [asyncio.run(_post(server, key)) for server in servers]
    assert [r.status_code for r in refused] == [429, 429]
    assert all(r.json()["error"]["code"] == "max_concurrent" for r in refused)
    _on_loop(servers[0], tickets[0].release)  # the request on replica a ends ...
    _on_loop(servers[0], servers[0].gateway.admission.tenant_limiter.settle)
    # ... and its slot serves replica b, one request at a time (each served
    # request gives its slot back when it ends).
    for _ in range(3):
        assert asyncio.run(_post(servers[1], key)).status_code == 200
        _on_loop(servers[1], servers[1].gateway.admission.tenant_limiter.settle)
    assert asyncio.run(_post(servers[0], key)).status_code == 200
    _on_loop(servers[1], tickets[1].release)


@pytest.fixture
def unreachable(tiny_llama_dir, tmp_path, request):
    db_url = f"sqlite+aiosqlite:///{tmp_path / 'loragw.db'}"
    keys = seed_tenants(db_url, {"acme": (Tier.STANDARD, TenantLimits(requests_per_minute=1))})
    server = _replica(tmp_path, "one", tiny_llama_dir, db_url,
                      RedisLimitsConfig(url=UNREACHABLE_REDIS, failure_mode=request.param))
    server.key = keys["acme"]
    yield server
    server.stop()


def _says_redis_is_down(server) -> None:
    health = httpx.get(f"{server.url}/health").json()
    assert health["status"] == "degraded"
    assert health["tenant_limits"]["backend"] == "redis" and health["tenant_limits"]["up"] is False
    metrics = httpx.get(f"{server.url}/metrics", headers={"Authorization": f"Bearer {ADMIN_TOKEN}"}).text
    assert "loragw:redis_up 0.0" in metrics.splitlines()


@pytest.mark.parametrize("unreachable", ["refuse"], indirect=True)
def test_refuse_mode_answers_503_with_retry_after_while_redis_is_unreachable(unreachable):
    r = asyncio.run(_post(unreachable, unreachable.key))
    assert r.status_code == 503 and r.headers["retry-after"] == "2"
    error = r.json()["error"]
    assert error["code"] == "rate_limiter_unavailable" and error["type"] == "service_unavailable"
    assert "unreachable" in error["message"]
    _says_redis_is_down(unreachable)


@pytest.mark.parametrize("unreachable", ["local"], indirect=True)
def test_local_mode_serves_under_this_replicas_own_limits_while_redis_is_unreachable(unreachable):
    first, second = (asyncio.run(_post(unreachable, unreachable.key)) for _ in range(2))
    assert first.status_code == 200 and json.loads(first.text)["usage"]["completion_tokens"] == 1
    assert second.status_code == 429 and second.json()["error"]["code"] == "requests_per_minute"
    _says_redis_is_down(unreachable)
