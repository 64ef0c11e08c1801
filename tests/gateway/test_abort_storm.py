"""Clients that hang up while their request is queued (issue 12, defect 4).

A request waits in the engine's queue until its first output; a client that
leaves meanwhile must be aborted at once, not kept in the queue and then
prefilled for nobody. Both tests run a real uvicorn gateway with billing on
the tiny random Llama, on SQLite and PostgreSQL, close raw sockets (so the
test alone decides when a connection ends) and read the ledger afterwards.
"""

from __future__ import annotations

import time
from collections import Counter
from contextlib import ExitStack

import httpx

from gateway.config import TierLimits
from gateway.tenancy import TenantLimits, Tier
from tests.billing.live_helpers import ledger_records, start_billing_server
from tests.gateway.hangups import (CountingObserver, admission_empty, client_request_id, engine_idle, hang_up,
                                   request_records_by_client, send_request)
from tests.gateway.live import wait_for

STORM = 200
PROMPT_TOKENS = 400
STORM_TOKENS = 1000  # asked of every storm request: the two sequence slots stay busy for seconds
STORM_TIER_LIMITS = TierLimits(max_waiting=STORM, max_queued_tokens=10**8)


def _prompt(i: int) -> list[int]:
    return [(7 * i + 13 * j) % 5000 + 3 for j in range(PROMPT_TOKENS)]


def _storm_request(model: str, i: int) -> tuple[str, dict]:
    """Completions and chat, streamed and not, each a long prompt that runs long."""
    body = {"model": model, "max_tokens": STORM_TOKENS, "min_tokens": STORM_TOKENS, "temperature": 0.0,
            "stream": i % 4 in (1, 2)}
    if i % 2:
        return "/v1/chat/completions", {**body, "messages": [
            {"role": "user", "content": f"Request {i}: " + "tell me more " * (PROMPT_TOKENS // 3)}]}
    return "/v1/completions", {**body, "prompt": _prompt(i)}


def test_ghost_request_a_client_that_hangs_up_while_queued_is_aborted_before_prefill(
        tiny_llama_dir, tmp_path, db_url):
    server = start_billing_server(tmp_path, tiny_llama_dir, tenants={"acme": Tier.STANDARD}, db_url=db_url,
                                  max_num_seqs=1, num_kv_blocks=256)
    gw, key = server.gateway, server.keys["acme"]
    seen = CountingObserver()
    gw.observers.append(seen)
    try:
        # A long stream holds the engine's only sequence slot (its client
        # reads nothing: the engine runs on regardless) ...
        with send_request(server.url, "/v1/completions", {
                "model": server.model, "prompt": "Once upon a time", "max_tokens": 1900, "min_tokens": 1900,
                "temperature": 0.0, "stream": True}, key, request_id="long"):
            wait_for(lambda: gw.engine.stats().num_running[Tier.STANDARD] == 1, 30, "the long stream to run")
            # ... so this one waits in the queue, and its client gives up there.
            ghost = send_request(server.url, "/v1/completions", {
                "model": server.model, "prompt": _prompt(0), "max_tokens": 16, "temperature": 0.0},
                key, request_id="ghost")
            with ghost:
                wait_for(lambda: gw.engine.stats().num_waiting[Tier.STANDARD] == 1, 30, "the ghost to queue")
                hang_up(ghost)
            wait_for(lambda: any(client_request_id(r.request_id) == "ghost" for r in seen.ended), 5,
                     "the gateway to end the ghost")
            assert gw.in_flight == 1
            assert gw.admission.snapshot()["standard"] == {"waiting": 0, "queued_tokens": 0, "rejected": {}}
            # The engine thread applies the abort between two steps: the
            # ghost's queue slot is free while the request ahead still runs.
            wait_for(lambda: gw.engine.stats().num_waiting[Tier.STANDARD] == 0, 5, "the engine to drop the ghost")
            assert gw.engine.stats().num_running[Tier.STANDARD] == 1
    finally:
        server.stop()  # settles and flushes the spool to the ledger

    [record] = request_records_by_client(db_url)["ghost"]
    assert record.finish_reason == "client_disconnect"
    assert record.gpu_us == 0 and record.completion_tokens == 0  # never prefilled, never decoded
    assert record.queue_us is None and record.ttft_us is None  # never scheduled
    assert record.prompt_tokens == PROMPT_TOKENS


def test_abort_storm_frees_every_slot_and_kv_block_and_bills_each_request_once(tiny_llama_dir, tmp_path, db_url):
    """Robustness test 9: 200 requests cancelled within 0.5 s; then a fresh
    request completes within 5 s, the engine holds no KV, admission holds
    nothing, and each cancelled request has exactly one ledger record."""
    # The tenant may hold exactly STORM requests: one leaked slot and the
    # fresh request below is refused.
    server = start_billing_server(
        tmp_path, tiny_llama_dir, tenants={"acme": (Tier.STANDARD, TenantLimits(max_concurrent=STORM))},
        db_url=db_url, tier_limits=STORM_TIER_LIMITS, max_num_seqs=2, num_kv_blocks=512)
    gw, key = server.gateway, server.keys["acme"]
    seen = CountingObserver()
    gw.observers.append(seen)
    try:
        with ExitStack() as connections:
            sockets = [connections.enter_context(
                send_request(server.url, *_storm_request(server.model, i), key, request_id=f"storm-{i}"))
                for i in range(STORM)]
            wait_for(lambda: len(seen.started) == STORM, 120, "every storm request to be admitted")
            cancel_start = time.monotonic()
            for i, sock in enumerate(sockets):
                hang_up(sock, reset=i % 3 == 0)
            assert time.monotonic() - cancel_start < 0.5

        fresh_start = time.monotonic()
        r = httpx.post(f"{server.url}/v1/completions", timeout=5, headers={
            "Authorization": f"Bearer {key}", "X-Request-Id": "fresh"},
            json={"model": server.model, "prompt": "Hello", "max_tokens": 8, "temperature": 0.0})
        assert r.status_code == 200, r.text
        assert r.json()["usage"]["completion_tokens"] == 8
        assert time.monotonic() - fresh_start < 5

        wait_for(lambda: len(seen.ended) == STORM + 1, 10, "every request to end")
        wait_for(lambda: engine_idle(gw), 10, "the engine to free every sequence and KV block")
        wait_for(lambda: admission_empty(gw), 5, "every admission slot to be released")
        gw.engine._engine.engine.scheduler.kv.check_invariants()  # idle: nothing steps under us
    finally:
        server.stop()

    by_client = request_records_by_client(db_url)
    assert Counter({cid: len(rows) for cid, rows in by_client.items()}) == Counter(
        {**{f"storm-{i}": 1 for i in range(STORM)}, "fresh": 1})
    storm = [rows[0] for cid, rows in by_client.items() if cid != "fresh"]
    assert all(r.finish_reason == "client_disconnect" for r in storm), Counter(r.finish_reason for r in storm)
    # The test's premise: most were still queued when their clients left, and
    # cost nothing. (Only two ever hold a sequence slot at once.)
    never_ran = [r for r in storm if r.gpu_us == 0 and r.completion_tokens == 0]
    assert len(never_ran) >= STORM * 3 // 4
    all_records = ledger_records(db_url)
    assert sum(r.charged_us for r in all_records) == sum(step.busy_time_us for step in server.steps)
