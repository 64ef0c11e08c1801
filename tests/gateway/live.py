"""A real gateway under uvicorn on 127.0.0.1, in a background thread, for
tests that drive it over HTTP with the official `openai` client."""

from __future__ import annotations

import asyncio
import datetime as dt
import threading
import time
from dataclasses import dataclass

import httpx

from gateway.app import Gateway
from gateway.config import GatewayConfig
from gateway.engine_client import InProcessEngineClient
from gateway.server import DrainingServer, build_gateway, make_server

# The test gateways' admin token: GatewayConfig refuses one under 32 characters.
ADMIN_TOKEN = "test-admin-token-0123456789abcdef"


@dataclass
class LiveServer:
    gateway: Gateway
    server: DrainingServer
    thread: threading.Thread
    url: str  # http://127.0.0.1:PORT
    metrics_url: str | None = None  # the --metrics-port listener's, when config.metrics_port is set

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(timeout=30)


def build_in_process_gateway(config: GatewayConfig) -> Gateway:
    """`build_gateway` with the engine in this process, on a thread: the
    gateway tests that are not about workers skip a worker process's start."""
    return build_gateway(config, engine=InProcessEngineClient(config.engine))


def start_live_server(gateway: Gateway, *, ready_timeout_s: float = 120.0, wait_ready: bool = True) -> LiveServer:
    """Serve `gateway` on a free port (port 0: the OS picks) and wait until
    /ready answers 200 (unless not `wait_ready`)."""
    gateway.config.host, gateway.config.port = "127.0.0.1", 0
    server = make_server(gateway, log_level="warning")
    thread = threading.Thread(target=server.run, name="live-uvicorn", daemon=True)
    thread.start()
    deadline = time.monotonic() + ready_timeout_s
    while not server.started:
        if not thread.is_alive() or time.monotonic() > deadline:
            raise RuntimeError("the live server did not start")
        time.sleep(0.02)
    port = server.servers[0].sockets[0].getsockname()[1]
    live = LiveServer(gateway, server, thread, f"http://127.0.0.1:{port}")
    if server.metrics is not None:
        live.metrics_url = f"http://{gateway.config.metrics_host}:{server.metrics.port}"
    while wait_ready and httpx.get(f"{live.url}/ready").status_code != 200:
        if time.monotonic() > deadline:
            live.stop()
            raise RuntimeError(f"the model did not load: {gateway.engine.load_error}")
        time.sleep(0.05)
    return live


def wait_for(predicate, timeout_s: float, what: str):
    """Poll `predicate` every 0.1 s until it returns something truthy, which is returned."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        found = predicate()
        if found:
            return found
        time.sleep(0.1)
    raise AssertionError(f"timed out waiting for {what}")


def seed_tenants(db_url: str, tenants: dict, grants=()) -> dict[str, str]:
    """Migrate, then add the tenants (name -> Tier, or (Tier, TenantLimits)),
    one key each, and the adapter grants (name, owner, shared). Returns
    name -> key secret."""
    from gateway.store import schema
    from gateway.tenancy import TenantLimits

    schema.upgrade(db_url)
    now = dt.datetime.now(dt.UTC)

    async def seed(store):
        keys = {}
        for name, spec in tenants.items():
            tier, limits = spec if isinstance(spec, tuple) else (spec, TenantLimits())
            await store.create_tenant(name, tier, limits)
            keys[name] = (await store.create_key(name, now=now)).secret
        for name, owner, shared in grants:
            await store.grant_adapter(name, owner=owner, shared=shared)
        return keys

    return run_with_store(db_url, seed)


def run_with_store(db_url: str, work):
    """`await work(store)` on a store of its own, from synchronous test code
    (the server's store belongs to the server's event loop)."""
    from gateway.store.sql import SqlStore

    async def main():
        store = SqlStore.from_url(db_url)
        try:
            return await work(store)
        finally:
            await store.close()

    return asyncio.run(main())
