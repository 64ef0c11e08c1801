"""A live gateway with billing for the billing tests, and ledger reads."""

from __future__ import annotations

import asyncio
from pathlib import Path

from billing.ledger import Ledger
from billing.records import UsageRecord
from engine.config import EngineConfig
from gateway.config import GatewayConfig, TierLimits
from gateway.tenancy import Tier
from tests.gateway.live import ADMIN_TOKEN, build_in_process_gateway, seed_tenants, start_live_server


def start_billing_server(tmp: Path, model_dir, *, tenants: dict[str, Tier], grants=(), adapter_dir=None,
                         db_url: str | None = None, tier_limits: TierLimits = TierLimits(max_waiting=64),
                         **engine_kwargs):
    """Tenants (one key each), adapter grants (name, owner, shared) imported
    from `adapter_dir`, and a live server whose step busy times are also
    collected in `server.steps` (the ground truth). `tier_limits` applies
    to both tiers; the admin API takes `tests.gateway.live.ADMIN_TOKEN`."""
    db_url = db_url or f"sqlite+aiosqlite:///{tmp / 'loragw.db'}"
    keys = seed_tenants(db_url, tenants, grants)
    engine = EngineConfig.from_flat(model=str(model_dir), data_dir=str(tmp / "data"), **engine_kwargs)
    gw = build_in_process_gateway(GatewayConfig(db_url=db_url, engine=engine, data_dir=tmp / "data",
                                                standard=tier_limits, premium=tier_limits, admin_token=ADMIN_TOKEN))
    steps = []
    gw.engine.add_usage_sink(steps.append)
    server = start_live_server(gw)
    for name, _owner, _shared in grants:
        gw.registry.import_dir(name, adapter_dir)
    server.keys, server.model, server.steps, server.db_url = keys, gw.served_model_name, steps, db_url
    return server


def ledger_records(db_url: str) -> list[UsageRecord]:
    from gateway.store.sql import create_engine

    async def read():
        engine = create_engine(db_url)
        try:
            return await Ledger(engine).records()
        finally:
            await engine.dispose()

    return asyncio.run(read())


def request_id_of(response_json: dict) -> str:
    """The engine request id behind a completion (`cmpl-<id>` / `chatcmpl-<id>`)."""
    return response_json["id"].split("-", 1)[1]
