"""Metering conserves GPU time across two workers, with a forced preemption:
per worker, the busy time it reports equals the usage the gateway received
from it; in total, the ledger's charges (requests, recompute, adapter loads,
overhead) equal the workers' busy time exactly; every request is billed
once."""

from __future__ import annotations

import asyncio
from collections import Counter

import pytest

from billing.records import ADAPTER_LOAD, RECOMPUTE, REQUEST
from gateway.tenancy import Tier
from tests.gateway.test_metrics import scrape
from tests.billing.live_helpers import ledger_records, request_id_of
from tests.gateway.live import wait_for
from tests.gateway.workers.live_fleet import start_fleet_server

PROMPTS = [[(7 * i + j) % 300 + 3 for j in range(24 + i)] for i in range(12)]
LONG = 500  # tokens: the standard requests still run when premium arrives
ABANDONED_TOKENS = 1900  # of the tiny model's 2048 positions
# (tenant, model): lora-a is gold's own adapter, lora-b is shared.
MIXED = [("gold", "lora-a"), ("silver", "lora-b"), ("gold", None), ("silver", None), ("gold", "lora-b"),
         ("gold", "lora-a")]


async def _complete(client, server, tenant, prompt, tokens, model=None):
    body = {"model": model or server.model, "prompt": prompt, "max_tokens": tokens, "min_tokens": tokens,
            "temperature": 0.0}
    r = await client.post("/v1/completions", json=body, headers=server.headers(tenant))
    assert r.status_code == 200, r.text
    return r.json()


async def _abandon(client, server, prompt) -> None:
    """A stream the client leaves after its first chunk: a client_disconnect.
    It asks for most of the tiny model's context so that the client's hang-up
    reaches the gateway first even on a loaded host (300 tokens once finished
    before it did, in CI, and the request was billed as "length")."""
    body = {"model": server.model, "prompt": prompt, "max_tokens": ABANDONED_TOKENS, "min_tokens": ABANDONED_TOKENS,
            "stream": True}
    async with client.stream("POST", "/v1/completions", json=body, headers=server.headers("silver")) as r:
        async for _line in r.aiter_lines():
            break


def _running_standard(server) -> int:
    """Workers running a standard request now."""
    return sum(bool(s.num_running.get(Tier.STANDARD)) for s in server.snapshots().values())


async def _until(predicate, what: str, timeout_s: float = 60.0) -> None:
    deadline = asyncio.get_running_loop().time() + timeout_s
    while not predicate():
        if asyncio.get_running_loop().time() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        await asyncio.sleep(0.01)


async def _workload(server) -> list[dict]:
    """Each worker gets a long standard request and, once both run, premium
    requests arrive: with one seat per worker, premium takes a standard
    request's seat and preempts it. Then a mixed batch, adapters included."""
    async with server.client() as client:
        standard = [asyncio.create_task(_complete(client, server, "silver", PROMPTS[i], LONG)) for i in range(2)]
        await _until(lambda: _running_standard(server) == 2, "a standard request running on each worker")
        premium = [asyncio.create_task(_complete(client, server, "gold", PROMPTS[2 + i], 4)) for i in range(2)]
        results = await asyncio.gather(*standard, *premium)
        mixed = [_complete(client, server, tenant, PROMPTS[4 + i], 6 + i, model=model)
                 for i, (tenant, model) in enumerate(MIXED)]
        results += await asyncio.gather(*mixed, _abandon(client, server, PROMPTS[11]))
    return [r for r in results if r is not None]


def test_busy_time_is_conserved_per_worker_and_in_total(tmp_path, tiny_llama_dir, lora_dirs):
    # One seat per worker and no prefix caching: a preempted request then
    # recomputes its tokens, which its preemptor pays for.
    server = start_fleet_server(
        tmp_path, tiny_llama_dir, tenants={"gold": Tier.PREMIUM, "silver": Tier.STANDARD},
        grants=[("lora-a", "gold", False), ("lora-b", None, True)], adapter_dirs=lora_dirs,
        max_num_seqs=1, num_kv_blocks=256, premium_reserved_fraction=0.2, enable_prefix_caching=False, max_loras=2)
    try:
        results = asyncio.run(_workload(server))

        def settled():
            snaps = server.snapshots()
            return len(snaps) == 2 and all(
                s.num_requests == 0 and s.busy_time_us == sum(u.busy_time_us for u in server.usage[w])
                for w, s in snaps.items()) and snaps

        # Per worker: its cumulative busy time equals the usage the gateway got from it.
        snapshots = wait_for(settled, 60.0, "each worker's busy time to match the usage received from it")
    finally:
        server.stop()  # settles, and flushes the spool to the ledger
    assert all(s.steps > 0 and s.steps == len(server.usage[w]) for w, s in snapshots.items())
    assert sum(s.num_preemptions.get(Tier.STANDARD, 0) for s in snapshots.values()) >= 1

    records = ledger_records(server.db_url)
    assert sum(r.charged_us for r in records) == sum(s.busy_time_us for s in snapshots.values()) > 0
    # The metric bills each tenant what the ledger does: adapter loads,
    # recompute and overhead (platform-overhead) included.
    billed = Counter()
    for r in records:
        billed[r.tenant] += r.charged_us
    samples = scrape(server.live.gateway.metrics.render().decode())
    counted = {dict(labels)["tenant"]: v for (name, labels), v in samples.items()
               if name == "loragw:tenant_gpu_seconds_total"}
    assert counted == pytest.approx({tenant: us / 1e6 for tenant, us in billed.items()}, abs=1e-6)
    assert any(r.kind == RECOMPUTE and r.tenant == "gold" for r in records)
    assert any(r.kind == ADAPTER_LOAD and r.tenant == "gold" for r in records)
    requests = [r for r in records if r.kind == REQUEST]
    assert len(requests) == len(results) + 1 == len({r.request_id for r in requests})  # +1: the abandoned stream
    by_id = {r.request_id: r for r in requests}
    for body in results:
        row = by_id[request_id_of(body)]
        assert (row.prompt_tokens, row.completion_tokens) == (body["usage"]["prompt_tokens"],
                                                             body["usage"]["completion_tokens"])
        assert row.gpu_us > 0 and row.finish_reason == "length"
    assert Counter(r.finish_reason for r in requests)["client_disconnect"] == 1
