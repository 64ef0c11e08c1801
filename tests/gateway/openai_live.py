"""A live gateway for the OpenAI API tests (tests/gateway/test_openai_*.py):
the tiny random Llama behind uvicorn, a few tenants and adapters, and the
official `openai` client."""

from __future__ import annotations

import contextlib
import datetime as dt

import openai

from engine.config import EngineConfig
from gateway.config import GatewayConfig
from gateway.store import schema
from gateway.tenancy import TenantLimits, Tier
from tests.gateway.live import ADMIN_TOKEN, build_in_process_gateway, run_with_store, start_live_server

PROMPT = "The quick brown fox"
CHAT = [{"role": "user", "content": "Say something."}]


@contextlib.contextmanager
def openai_gateway(tiny_llama_dir, tiny_adapter_dir, tmp):
    """A live gateway on the tiny Llama: tenants acme, rival and limited
    (one request at a time), revoked and expired keys of acme, and two
    adapters, tiny-lora (acme's own) and shared-lora (everyone's)."""
    db_url = f"sqlite+aiosqlite:///{tmp / 'loragw.db'}"
    schema.upgrade(db_url)
    now = dt.datetime.now(dt.UTC)

    async def seed(store):
        keys = {}
        for name, limits in [("acme", TenantLimits()), ("rival", TenantLimits()),
                             ("limited", TenantLimits(max_concurrent=1))]:
            await store.create_tenant(name, Tier.STANDARD, limits)
            keys[name] = (await store.create_key(name, now=now)).secret
        revoked = await store.create_key("acme", now=now)
        await store.revoke_key(revoked.info.id, now=now)
        keys["revoked"] = revoked.secret
        expired = await store.create_key("acme", now=now - dt.timedelta(hours=2),
                                         expires_at=now - dt.timedelta(hours=1))
        keys["expired"] = expired.secret
        await store.grant_adapter("tiny-lora", owner="acme", shared=False)
        await store.grant_adapter("shared-lora", owner=None, shared=True)
        return keys

    keys = run_with_store(db_url, seed)
    engine = EngineConfig.from_flat(model=str(tiny_llama_dir), max_num_seqs=16, num_kv_blocks=512,
                                    data_dir=str(tmp / "data"))
    gw = build_in_process_gateway(GatewayConfig(db_url=db_url, admin_token=ADMIN_TOKEN, engine=engine,
                                     data_dir=tmp / "data"))
    server = start_live_server(gw)
    gw.registry.import_dir("tiny-lora", tiny_adapter_dir)
    gw.registry.import_dir("shared-lora", tiny_adapter_dir)
    server.keys = keys
    server.model = gw.served_model_name
    try:
        yield server
    finally:
        server.stop()


def client(live, tenant: str = "acme", **kwargs) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{live.url}/v1", api_key=live.keys[tenant], **{"max_retries": 0, **kwargs})


def complete(live, **kwargs):
    args = {"model": live.model, "prompt": PROMPT, "max_tokens": 8, "temperature": 0.0, **kwargs}
    return client(live).completions.create(**args)
