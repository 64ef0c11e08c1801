"""Defect 6, end to end: the database goes down under a live gateway.

PostgreSQL is reached through a TCP proxy that the test closes (the shared
server keeps running); SQLite is taken down by another connection holding
an exclusive lock, so every query fails with "database is locked". While
it is down, a tenant seen within the auth cache's TTL keeps getting 200s
(its adapter included), every other key gets 503 with Retry-After, /admin
gets 503, and nothing else is a 5xx. Once it is back everything recovers,
a revocation takes effect once the TTL passes, and the requests served
during the outage reach the ledger through the spool."""

from __future__ import annotations

import contextlib
import datetime as dt
import sqlite3
import urllib.parse

import httpx
import pytest

from engine.config import EngineConfig
from gateway.auth_cache import AuthCache
from gateway.config import GatewayConfig
from gateway.tenancy import Tier
from tests.billing.live_helpers import ledger_records, request_id_of
from tests.gateway.fakes import ManualClock
from tests.gateway.live import build_in_process_gateway, run_with_store, seed_tenants, start_live_server, wait_for
from tests.gateway.tcp_proxy import TcpProxy

ADMIN_TOKEN = "outage-test-admin-token-0123456789abcdef"
ADMIN = {"Authorization": f"Bearer {ADMIN_TOKEN}"}
TTL_S, STALE_S = 5.0, 60.0
ADAPTER = "warm-lora"
# /admin reads and writes, through the store and (usage) the ledger's own queries.
ADMIN_CALLS = [("GET", "/admin/tenants", {}), ("POST", "/admin/tenants", {"json": {"name": "new"}}),
               ("GET", "/admin/tenants/warm/keys", {}), ("DELETE", "/admin/keys/nope", {}),
               ("GET", "/admin/usage", {}), ("GET", "/admin/adapters", {})]


class PostgresOutage:
    """The gateway's URL points at a proxy in front of the real server."""

    def __init__(self, url: str):
        parts = urllib.parse.urlsplit(url)
        self.proxy = TcpProxy(parts.hostname, parts.port or 5432)
        self.proxy.up()
        netloc = parts.netloc.replace(f"{parts.hostname}:{parts.port}" if parts.port else parts.hostname,
                                      f"127.0.0.1:{self.proxy.port}")
        self.gateway_url = urllib.parse.urlunsplit(parts._replace(netloc=netloc))

    def down(self):
        self.proxy.down()

    def up(self):
        self.proxy.up()

    def close(self):
        self.proxy.close()


class SqliteOutage:
    """Another connection holds an exclusive lock; the gateway's busy
    timeout is short, so each query fails fast with "database is locked"."""

    def __init__(self, url: str):
        self.path = url.split(":///", 1)[1]
        self.gateway_url = f"{url}?timeout=0.2"
        self._lock: sqlite3.Connection | None = None

    def down(self):
        self._lock = sqlite3.connect(self.path, isolation_level=None, timeout=10)
        self._lock.execute("BEGIN EXCLUSIVE")

    def up(self):
        if self._lock is not None:
            self._lock.execute("ROLLBACK")
            self._lock.close()
            self._lock = None

    def close(self):
        self.up()


@contextlib.contextmanager
def outage_for(db_url: str):
    outage = PostgresOutage(db_url) if db_url.startswith("postgresql") else SqliteOutage(db_url)
    try:
        yield outage
    finally:
        outage.close()


def _bearer(key: str) -> dict:
    return {"Authorization": f"Bearer {key}"}


def test_db_outage_cached_tenants_keep_working_new_keys_get_503_never_500(db_url, tiny_llama_dir,
                                                                           tiny_adapter_dir, tmp_path):
    keys = seed_tenants(db_url, {"warm": Tier.STANDARD, "cold": Tier.STANDARD}, grants=[(ADAPTER, "warm", False)])
    with outage_for(db_url) as outage:
        engine = EngineConfig.from_flat(model=str(tiny_llama_dir), max_num_seqs=4, data_dir=str(tmp_path / "data"))
        gw = build_in_process_gateway(GatewayConfig(db_url=outage.gateway_url, engine=engine, data_dir=tmp_path / "data",
                                         admin_token=ADMIN_TOKEN))
        clock = ManualClock()
        gw.auth = AuthCache(gw.store, ttl_s=TTL_S, stale_s=STALE_S, max_entries=100, clock=clock)
        live = start_live_server(gw)
        try:
            gw.registry.import_dir(ADAPTER, tiny_adapter_dir)
            _run_outage(live.url, gw.served_model_name, keys, outage, clock, db_url)
        finally:
            live.stop()


def _run_outage(url, model, keys, outage, clock, db_url):
    statuses = []
    served_during_outage = []

    with httpx.Client(base_url=url, timeout=60) as client:
        def call(method, path, *, headers, **kwargs):
            r = client.request(method, path, headers=headers, **kwargs)
            statuses.append((method, path, r.status_code))
            return r

        def complete(key, model_name=model):
            body = {"model": model_name, "prompt": "Once upon a time", "max_tokens": 4, "temperature": 0.0}
            return call("POST", "/v1/completions", headers=_bearer(key), json=body)

        def assert_503(r):
            assert r.status_code == 503, r.text
            assert r.json()["error"]["code"] == "database_unavailable"
            assert int(r.headers["Retry-After"]) >= 1

        # The warm tenant is seen (its key, its adapter, its model list) while the database is up.
        for r in (complete(keys["warm"]), complete(keys["warm"], ADAPTER),
                  call("GET", "/v1/models", headers=_bearer(keys["warm"]))):
            assert r.status_code == 200, r.text

        outage.down()
        for r in (complete(keys["warm"]), complete(keys["warm"], ADAPTER)):
            assert r.status_code == 200, r.text
            served_during_outage.append(request_id_of(r.json()))
        models = call("GET", "/v1/models", headers=_bearer(keys["warm"]))
        assert models.status_code == 200 and ADAPTER in {m["id"] for m in models.json()["data"]}
        assert_503(complete(keys["cold"]))
        assert_503(call("GET", "/v1/models", headers=_bearer(keys["cold"])))
        assert_503(complete("lgw-" + "x" * 43))  # unknown: the database cannot say it is invalid
        assert call("POST", "/v1/completions", headers={}, json={}).status_code == 401
        for method, path, kwargs in ADMIN_CALLS:
            assert_503(call(method, path, headers=ADMIN, **kwargs))
        assert call("GET", "/health", headers={}).status_code == 200

        # Past the TTL the warm tenant is served from the stale window; past that, 503 too.
        clock.now += TTL_S + 1
        r = complete(keys["warm"])
        assert r.status_code == 200, r.text
        served_during_outage.append(request_id_of(r.json()))
        clock.now += STALE_S
        assert_503(complete(keys["warm"]))

        outage.up()
        clock.now += 1  # past the auth cache's fail-fast second
        for key in (keys["warm"], keys["cold"]):
            assert wait_for(lambda k=key: complete(k).status_code == 200, 30, "recovery")
        assert call("GET", "/admin/tenants", headers=ADMIN).status_code == 200

        # Revocation elsewhere (another replica, the CLI): the cached key
        # works until the TTL passes, then 401.
        (cold_key,) = call("GET", "/admin/tenants/cold/keys", headers=ADMIN).json()["data"]
        run_with_store(db_url, lambda store: store.revoke_key(cold_key["id"], now=dt.datetime.now(dt.UTC)))
        assert complete(keys["cold"]).status_code == 200
        clock.now += TTL_S
        assert complete(keys["cold"]).status_code == 401

    bad = [s for s in statuses if s[2] >= 500 and s[2] != 503]
    assert not bad, bad
    # Billing: what was served while the database was down reaches the ledger through the spool.
    wait_for(lambda: set(served_during_outage) <= {r.request_id for r in ledger_records(db_url)}, 90,
             "the outage's usage records in the ledger")
