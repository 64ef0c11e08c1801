"""End to end: a standard flood saturates the engine while premium's TTFT
stays low (no page); with tiers off premium queues behind the flood until
the TTFT alert reaches a real webhook receiver and /admin/alerts."""

from __future__ import annotations

import asyncio

import httpx
import jsonschema
import pytest

from engine.config import EngineConfig
from gateway.config import GatewayConfig, TierLimits
from gateway.slo import ALERT_NAME, SloConfig
from gateway.tenancy import Tier
from tests.gateway.live import build_in_process_gateway, ADMIN_TOKEN, seed_tenants, start_live_server
from tests.gateway.test_slo import Receiver



@pytest.fixture
def receiver():
    r = Receiver()
    yield r
    r.close()


def serve(tiny_llama_dir, tmp, receiver_url: str, *, tiers: bool):
    tmp.mkdir(parents=True, exist_ok=True)
    db_url = f"sqlite+aiosqlite:///{tmp / 'loragw.db'}"
    keys = seed_tenants(db_url, {"vip": Tier.PREMIUM, "crowd": Tier.STANDARD})
    engine = EngineConfig.from_flat(model=str(tiny_llama_dir), max_num_seqs=2, num_kv_blocks=512, enable_tiers=tiers,
                                    premium_reserved_fraction=0.2 if tiers else 0.0, data_dir=str(tmp / "data"))
    # Small numbers for a CPU and a tiny model: page when half the premium
    # requests in both windows take over 250 ms.
    slo = SloConfig(ttft_slo_s=0.3, ttft_alert_s=0.25, fast_window_s=30, slow_window_s=60, burn_rate=50,
                    min_samples=2, min_hold_s=0, eval_interval_s=0.2, webhook_urls=(receiver_url,))
    gw = build_in_process_gateway(GatewayConfig(db_url=db_url, engine=engine, data_dir=tmp / "data", admin_token=ADMIN_TOKEN,
                                     standard=TierLimits(max_waiting=16), slo=slo))
    server = start_live_server(gw)
    server.keys, server.model = keys, gw.served_model_name
    return server


async def _complete(client, key: str, model: str, tokens: int) -> int:
    body = {"model": model, "prompt": "Once upon a time", "max_tokens": tokens, "min_tokens": tokens,
            "temperature": 0.0}
    r = await client.post("/v1/completions", json=body, headers={"Authorization": f"Bearer {key}"})
    return r.status_code


def flood_then_premium(live) -> list[int]:
    async def main():
        async with httpx.AsyncClient(base_url=live.url, timeout=120) as client:
            # Long enough that, with tiers off, premium waits well past the
            # 250 ms alert even on an idle machine (40 tokens did not).
            flood = [asyncio.create_task(_complete(client, live.keys["crowd"], live.model, 200)) for _ in range(4)]
            # The flood must be in the engine (both seats held, the rest queued)
            # before premium arrives; on a loaded machine that takes a while.
            for _ in range(600):
                if live.gateway.in_flight >= 4:
                    break
                await asyncio.sleep(0.05)
            await asyncio.sleep(0.1)
            premium = await asyncio.gather(*(_complete(client, live.keys["vip"], live.model, 2) for _ in range(2)))
            await asyncio.gather(*flood)
            return premium

    return asyncio.run(main())


def test_premium_is_protected_with_tiers_and_paged_when_starved_without(tiny_llama_dir, tmp_path, receiver):
    live = serve(tiny_llama_dir, tmp_path / "tiers", receiver.url, tiers=True)
    try:
        assert flood_then_premium(live) == [200] * 2
        assert live.gateway.slo.firing() == [] and receiver.payloads == []
    finally:
        live.stop()

    live = serve(tiny_llama_dir, tmp_path / "fcfs", receiver.url, tiers=False)
    try:
        assert flood_then_premium(live) == [200] * 2
        assert receiver.arrived.wait(10), "no alert reached the receiver"
        firing = receiver.payloads[0]
        assert firing["status"] == "firing" and firing["alerts"][0]["labels"]["tier"] == "premium"
        alerts = httpx.get(f"{live.url}/admin/alerts", headers={"Authorization": f"Bearer {ADMIN_TOKEN}"}).json()
        assert [a["labels"]["alertname"] for a in alerts["data"]] == [ALERT_NAME]
        # The answer is what /openapi.json declares for it.
        doc = httpx.get(f"{live.url}/openapi.json").json()
        declared = doc["paths"]["/admin/alerts"]["get"]["responses"]["200"]["content"]["application/json"]["schema"]
        jsonschema.validate(alerts, {**declared, "components": doc["components"]})
        assert httpx.get(f"{live.url}/admin/alerts").status_code == 401
    finally:
        live.stop()
