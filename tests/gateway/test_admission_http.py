"""A standard flood through the live gateway: standard gets 429s with
Retry-After while every concurrent premium request succeeds."""

from __future__ import annotations

import asyncio
import json

import httpx
import pytest

from engine.config import EngineConfig
from gateway.config import GatewayConfig, TierLimits
from gateway.tenancy import Tier
from tests.gateway.live import build_in_process_gateway, seed_tenants, start_live_server


@pytest.fixture(scope="module")
def live(tiny_llama_dir, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("live-admission")
    db_url = f"sqlite+aiosqlite:///{tmp / 'loragw.db'}"
    keys = seed_tenants(db_url, {"vip": Tier.PREMIUM, "crowd": Tier.STANDARD})
    # Two seats: the flood's first two hold them, the next three wait for a
    # first token (the standard queue's limit), the rest must be refused.
    engine = EngineConfig.from_flat(model=str(tiny_llama_dir), max_num_seqs=2, num_kv_blocks=512,
                                    premium_reserved_fraction=0.2, data_dir=str(tmp / "data"))
    gw = build_in_process_gateway(GatewayConfig(db_url=db_url, engine=engine, data_dir=tmp / "data",
                                     standard=TierLimits(max_waiting=3), premium=TierLimits(max_waiting=8)))
    server = start_live_server(gw)
    server.keys = keys
    server.model = gw.served_model_name
    yield server
    server.stop()


async def _stream(client: httpx.AsyncClient, key: str, model: str, tokens: int) -> tuple[int, dict, int]:
    """(status, headers, completion tokens) of one streamed completion."""
    body = {"model": model, "prompt": "Once upon a time", "max_tokens": tokens, "min_tokens": tokens,
            "temperature": 0.0, "stream": True, "stream_options": {"include_usage": True}}
    async with client.stream("POST", "/v1/completions", json=body,
                             headers={"Authorization": f"Bearer {key}"}) as r:
        if r.status_code != 200:
            await r.aread()
            return r.status_code, dict(r.headers) | {"body": r.text}, 0
        usage = 0
        async for line in r.aiter_lines():
            if line.startswith("data: {"):
                usage = (json.loads(line[6:]).get("usage") or {}).get("completion_tokens", usage)
        return 200, dict(r.headers), usage


def test_standard_flood_gets_429s_while_premium_all_succeeds(live):
    async def main():
        async with httpx.AsyncClient(base_url=live.url, timeout=120) as client:
            flood = [asyncio.create_task(_stream(client, live.keys["crowd"], live.model, 120)) for _ in range(12)]
            await asyncio.sleep(1.0)  # the flood is in: seats taken, queue full
            premium = await asyncio.gather(*(_stream(client, live.keys["vip"], live.model, 8) for _ in range(4)))
            standard = await asyncio.gather(*flood)
            return premium, standard

    premium, standard = asyncio.run(main())
    assert [status for status, _, _ in premium] == [200] * 4
    assert all(tokens == 8 for _, _, tokens in premium)
    rejected = [headers for status, headers, _ in standard if status == 429]
    served = [tokens for status, _, tokens in standard if status == 200]
    # They all arrive before any has a first token: the queue's 3 get in.
    assert len(served) >= 3 and len(rejected) >= 5 and len(served) + len(rejected) == 12
    assert all(tokens == 120 for tokens in served)  # preempted ones still finish
    assert all(int(h["retry-after"]) >= 1 and "tier_queue_full" in h["body"] for h in rejected)
    snap = live.gateway.admission.snapshot()
    assert snap["premium"]["rejected"] == {} and snap["standard"]["rejected"]["max_waiting"] == len(rejected)
