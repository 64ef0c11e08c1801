"""Metering through a live gateway and the engine: the GPU time charged to
requests, recompute, adapter loads and overhead adds up to the engine's
step busy time exactly, and every request has exactly one record."""

from __future__ import annotations

import asyncio
import threading
from collections import Counter

import httpx

from billing.records import ADAPTER_LOAD, RECOMPUTE, REQUEST
from engine.request import Tier
from gateway.metering import UsageObserver
from tests.billing.live_helpers import ledger_records, request_id_of, start_billing_server
from tests.gateway.admin_app import ADMIN, adapter_files, upload_form

PROMPTS = [[(7 * i + j) % 200 + 3 for j in range(40)] for i in range(16)]


async def _complete(client, key, model, prompt, tokens):
    body = {"model": model, "prompt": prompt, "max_tokens": tokens, "min_tokens": tokens, "temperature": 0.0}
    r = await client.post("/v1/completions", json=body, headers={"Authorization": f"Bearer {key}"})
    assert r.status_code == 200, r.text
    return r.json()


async def _abandon(client, key, model, prompt):
    """A stream the client leaves after its first chunk: a client_disconnect."""
    body = {"model": model, "prompt": prompt, "max_tokens": 300, "min_tokens": 300, "stream": True}
    async with client.stream("POST", "/v1/completions", json=body, headers={"Authorization": f"Bearer {key}"}) as r:
        async for _line in r.aiter_lines():
            break
    return r.headers["x-request-id"]


def test_mixed_workload_conserves_busy_time(tiny_llama_dir, tiny_adapter_dir, tmp_path):
    server = start_billing_server(
        tmp_path, tiny_llama_dir, tenants={"gold": Tier.PREMIUM, "silver": Tier.STANDARD},
        grants=[("gold-lora", "gold", False), ("silver-lora", "silver", False), ("shared-lora", None, True)],
        adapter_dir=tiny_adapter_dir, max_num_seqs=6, num_kv_blocks=24, premium_reserved_fraction=0.2,
        max_loras=2)
    keys, model = server.keys, server.model

    async def workload():
        async with httpx.AsyncClient(base_url=server.url, timeout=120) as client:
            jobs = []
            for i in range(12):
                tenant = "gold" if i % 2 == 0 else "silver"
                adapter = [model, f"{tenant}-lora", "shared-lora"][i % 3]
                jobs.append(_complete(client, keys[tenant], adapter, PROMPTS[i], 40 + i))
            jobs += [_abandon(client, keys["silver"], model, PROMPTS[13 + i]) for i in range(3)]
            results = await asyncio.gather(*jobs)
            # Prefix hits: the same prompt again, one at a time.
            for _ in range(2):
                results.append(await _complete(client, keys["gold"], model, PROMPTS[0], 4))
            return results

    try:
        results = asyncio.run(workload())
    finally:
        server.stop()  # settles, and flushes the spool to the ledger
    records = ledger_records(server.db_url)
    busy = sum(step.busy_time_us for step in server.steps)
    assert any(step.preemptions for step in server.steps), "the workload must preempt"
    assert busy > 0
    assert sum(r.charged_us for r in records) == busy  # exact, not just within 1%

    requests = [r for r in records if r.kind == REQUEST]
    assert len(requests) == len(results) == len({r.request_id for r in requests})
    finished = {request_id_of(r): r for r in results if isinstance(r, dict)}
    by_id = {r.request_id: r for r in requests}
    for request_id, body in finished.items():
        row = by_id[request_id]
        assert (row.prompt_tokens, row.completion_tokens) == (body["usage"]["prompt_tokens"],
                                                             body["usage"]["completion_tokens"])
        assert row.gpu_us > 0 and row.finish_reason == "length"
    reasons = Counter(r.finish_reason for r in requests)
    assert reasons["client_disconnect"] == 3
    assert max(r.cached_prompt_tokens for r in requests) >= 32  # the repeated prompt hit the prefix cache
    assert any(r.kind == "adapter_load" and r.tenant == "gold" for r in records)
    assert all(r.recompute_us == 0 for r in requests)
    assert any(r.kind == RECOMPUTE for r in records)


def test_premium_pays_for_the_recompute_it_causes(tiny_llama_dir, tmp_path):
    # One seat: premium arriving while standard runs takes its seat and
    # preempts it (the premium seat rule).
    # No prefix caching: with it the victim's full blocks stay cached, and
    # when it was preempted on a block boundary it resumes with nothing to
    # recompute, so there is no charge to test (1 run in 16).
    server = start_billing_server(tmp_path, tiny_llama_dir, tenants={"gold": Tier.PREMIUM, "silver": Tier.STANDARD},
                                  max_num_seqs=1, num_kv_blocks=256, premium_reserved_fraction=0.2,
                                  enable_prefix_caching=False)
    keys, model = server.keys, server.model

    async def workload():
        async with httpx.AsyncClient(base_url=server.url, timeout=120) as client:
            standard = asyncio.create_task(_complete(client, keys["silver"], model, PROMPTS[1], 200))
            while not any(step.requests for step in server.steps):
                await asyncio.sleep(0.005)
            await asyncio.sleep(0.05)
            premium = await _complete(client, keys["gold"], model, PROMPTS[2], 4)
            return await standard, premium

    try:
        standard, premium = asyncio.run(workload())
    finally:
        server.stop()
    records = {r.request_id: r for r in ledger_records(server.db_url)}
    victim, payer = request_id_of(standard), request_id_of(premium)
    assert any(p.victim_id == victim and p.caused_by == payer for s in server.steps for p in s.preemptions)
    assert records[victim].recompute_us == 0
    charge = records[f"{victim}/recompute/{payer}"]
    assert (charge.kind, charge.tenant, charge.tier, charge.caused_by) == (RECOMPUTE, "gold", "premium", payer)
    assert charge.recompute_us > 0
    assert sum(r.charged_us for r in records.values()) == sum(s.busy_time_us for s in server.steps)


def test_an_adapter_deleted_during_its_request_bills_its_load_to_its_owner(tiny_llama_dir, tiny_adapter_dir,
                                                                            tmp_path):
    # A load's owner is looked up in the adapter's grant, by name, when its
    # record is flushed. Deleting the adapter drops the grant, and a later
    # upload of the name may give it another owner: once the version is
    # gone, its owner's own request has to vouch for it. The flush is held
    # until each adapter was deleted after its request's first token (its
    # load made), and gold-lora uploaded again by silver.
    server = start_billing_server(
        tmp_path, tiny_llama_dir, tenants={"gold": Tier.PREMIUM, "silver": Tier.STANDARD},
        grants=[("gold-lora", "gold", False), ("gold-shared", "gold", True), ("platform-shared", None, True)],
        adapter_dir=tiny_adapter_dir, max_loras=3)
    keys = server.keys
    [observer] = [o for o in server.gateway.observers if isinstance(o, UsageObserver)]
    deleted_all, resolve = threading.Event(), observer.flusher.resolve

    async def resolve_after_the_deletes(records):
        await asyncio.to_thread(deleted_all.wait, 600)
        return await resolve(records)

    observer.flusher.resolve = resolve_after_the_deletes

    async def delete_during(client, tenant: str, adapter: str, prompt) -> None:
        body = {"model": adapter, "prompt": prompt, "max_tokens": 24, "min_tokens": 24, "stream": True}
        async with client.stream("POST", "/v1/completions", json=body,
                                 headers={"Authorization": f"Bearer {keys[tenant]}"}) as r:
            assert r.status_code == 200
            lines = r.aiter_lines()
            async for line in lines:
                if line.startswith("data: "):
                    break
            deleted = await client.delete(f"/admin/adapters/{adapter}", headers=ADMIN)
            assert deleted.status_code == 200, deleted.text
            async for _line in lines:
                pass

    async def upload(client, tenant: str, adapter: str) -> None:
        data, files = upload_form(adapter, *adapter_files(tiny_adapter_dir, scale=2.0), tenant=tenant)
        uploaded = await client.post("/admin/adapters", data=data, files=files, headers=ADMIN)
        assert uploaded.status_code == 201, uploaded.text

    async def workload():
        async with httpx.AsyncClient(base_url=server.url, timeout=120) as client:
            # Its own adapter; its shared one, which another tenant's request loads; a platform adapter.
            for tenant, adapter, prompt in (("gold", "gold-lora", PROMPTS[0]), ("silver", "gold-shared", PROMPTS[1]),
                                            ("silver", "platform-shared", PROMPTS[2])):
                await delete_during(client, tenant, adapter, prompt)
            await upload(client, "silver", "gold-lora")  # the name's new owner must not pay for gold's version
        deleted_all.set()

    try:
        asyncio.run(workload())
    finally:
        deleted_all.set()
        server.stop()
    records = ledger_records(server.db_url)
    loads = {r.adapter: r for r in records if r.kind == ADAPTER_LOAD}
    assert {r.adapter_version for r in loads.values()} == {1}
    assert set(loads) == {"gold-lora", "gold-shared", "platform-shared"}
    assert all(load.adapter_load_us > 0 for load in loads.values())
    gold = next(r for r in records if r.kind == REQUEST and r.tenant == "gold")
    assert (loads["gold-lora"].tenant, loads["gold-lora"].tenant_id, loads["gold-lora"].tier) == (
        "gold", gold.tenant_id, "premium")
    # No request of its owner's vouched for the shared adapter's version: overhead, as a platform adapter's load.
    assert loads["gold-shared"].tenant == loads["platform-shared"].tenant == "platform-overhead"
    assert sum(r.charged_us for r in records) == sum(s.busy_time_us for s in server.steps)
