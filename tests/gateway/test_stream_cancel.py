"""Robustness test 10: 100 streams cancelled mid-flight, in the same batch
as streams that run to the end. The survivors' text is exactly what a solo
run of the same prompt gives (greedy), the engine ends holding no KV, and
every request, cancelled or not, has exactly one ledger record; the GPU time
charged adds up to the engine's busy time exactly. On SQLite and PostgreSQL.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections import Counter

import httpx

from gateway.config import TierLimits
from gateway.tenancy import Tier
from tests.billing.live_helpers import ledger_records, start_billing_server
from tests.gateway.hangups import admission_empty, engine_idle, request_records_by_client
from tests.gateway.live import wait_for

SURVIVORS = 6
CUT = 100
# The cuts come within 4 tokens of their first, but 100 streams' admission,
# prefill and hang-ups take steps too: with 48 tokens a survivor once ended
# 37 ms before the last cut, on a 2-core host running the whole suite.
SURVIVOR_TOKENS = 160
CUT_TOKENS = 400  # asked of every cut stream: none can finish before it is cut
LIMITS = TierLimits(max_waiting=256, max_queued_tokens=10**8)


def _survivor_prompt(i: int) -> str:
    return f"Survivor {i} walked into the forest and" + " then" * i


async def _stream(client: httpx.AsyncClient, key: str, request_id: str, body: dict, *, cut_after: int | None = None):
    """The streamed text, and the usage chunk; with `cut_after`, hang up once
    that many token chunks arrived (None comes back)."""
    body = {**body, "stream": True, "stream_options": {"include_usage": True}}
    text, usage, chunks = [], None, 0
    async with client.stream("POST", "/v1/completions", json=body,
                             headers={"Authorization": f"Bearer {key}", "X-Request-Id": request_id}) as r:
        assert r.status_code == 200
        async for line in r.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[len("data: "):])
            assert "error" not in chunk, chunk
            text += [c["text"] for c in chunk["choices"]]
            usage = chunk["usage"] or usage
            chunks += bool(chunk["choices"])
            if chunks == cut_after:
                return None  # leaving the block closes the half-read response's connection
    return "".join(text), usage


def test_cancelling_100_streams_mid_flight_keeps_the_others_exact_and_bills_each_once(
        tiny_llama_dir, tmp_path, db_url):
    server = start_billing_server(tmp_path, tiny_llama_dir, tenants={"acme": Tier.STANDARD}, db_url=db_url,
                                  tier_limits=LIMITS, max_num_seqs=128, num_kv_blocks=4096)
    gw, key, model = server.gateway, server.keys["acme"], server.model
    greedy = {"model": model, "max_tokens": SURVIVOR_TOKENS, "min_tokens": SURVIVOR_TOKENS, "temperature": 0.0}
    cut_times, survivor_ends = [], []

    async def survivor(client: httpx.AsyncClient, i: int):
        result = await _stream(client, key, f"survivor-{i}", {**greedy, "prompt": _survivor_prompt(i)})
        survivor_ends.append(time.monotonic())
        return result

    async def cut(client: httpx.AsyncClient, i: int):
        body = {"model": model, "prompt": f"Stream {i} is about to be cut" + " short" * (i % 9),
                "max_tokens": CUT_TOKENS, "min_tokens": CUT_TOKENS, "temperature": 0.0 if i % 2 else 1.0}
        assert await _stream(client, key, f"cut-{i}", body, cut_after=1 + i % 4) is None
        cut_times.append(time.monotonic())

    async def workload():
        async with httpx.AsyncClient(base_url=server.url, timeout=120,
                                     limits=httpx.Limits(max_connections=2 * (SURVIVORS + CUT))) as client:
            solo = [await _stream(client, key, f"solo-{i}", {**greedy, "prompt": _survivor_prompt(i)})
                    for i in range(SURVIVORS)]
            together = await asyncio.gather(*[survivor(client, i) for i in range(SURVIVORS)],
                                            *[cut(client, i) for i in range(CUT)])
            return solo, together[:SURVIVORS]

    try:
        solo, survivors = asyncio.run(workload())
        # The cuts really were mid-flight: all of them before any survivor ended.
        assert len(cut_times) == CUT and max(cut_times) < min(survivor_ends)
        for (solo_text, solo_usage), (text, usage) in zip(solo, survivors):
            assert usage["completion_tokens"] == solo_usage["completion_tokens"] == SURVIVOR_TOKENS
            assert text == solo_text
        wait_for(lambda: engine_idle(gw), 10, "the engine to free every sequence and KV block")
        wait_for(lambda: admission_empty(gw), 5, "every admission slot to be released")
    finally:
        server.stop()

    by_client = request_records_by_client(db_url)
    expected = ([f"solo-{i}" for i in range(SURVIVORS)] + [f"survivor-{i}" for i in range(SURVIVORS)]
                + [f"cut-{i}" for i in range(CUT)])
    assert Counter({cid: len(rows) for cid, rows in by_client.items()}) == Counter(expected)
    for cid, [record] in by_client.items():
        if cid.startswith("cut-"):
            i = int(cid.split("-")[1])
            assert record.finish_reason == "client_disconnect"
            assert 1 + i % 4 <= record.completion_tokens < CUT_TOKENS and record.gpu_us > 0
        else:
            assert record.finish_reason == "length" and record.completion_tokens == SURVIVOR_TOKENS
    assert sum(r.charged_us for r in ledger_records(db_url)) == sum(s.busy_time_us for s in server.steps)
