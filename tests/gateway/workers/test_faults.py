"""Worker faults through the live gateway (issue 13): a worker killed
mid-stream, a worker that stops heartbeating, an engine that fails inside
its worker.

Real `python -m engine.worker` processes on the tiny random Llama, the
gateway under uvicorn, billing on. Every client call has a timeout and is
awaited with one, so a hang fails the test instead of blocking it. Routing
is round-robin, so the test knows which worker holds what; the sequence
slots are few (`max_num_seqs`) so that a worker holds streams that are
producing tokens and streams queued behind them at once.
"""

from __future__ import annotations

import os
import signal
import threading
import time
from collections import Counter
from concurrent.futures import ThreadPoolExecutor

import httpx

from engine.request import Tier
from engine.worker import EXIT_ENGINE_FAILED
from engine.worker_loop import FAULT_AFTER_STEPS_ENV
from gateway.engine_client import Health
from tests.billing.live_helpers import ledger_records
from tests.gateway.hangups import client_request_id, request_records_by_client
from tests.gateway.live import wait_for
from tests.gateway.workers.live_fleet import start_fleet_server, stream_completion

LONG_TOKENS = 1000  # a running stream: still streaming seconds later, when its worker dies
SHORT_TOKENS = 48  # a queued stream: what must finish, on the other worker
RESULT_TIMEOUT_S = 180  # the longest any client call may take, whatever happens
RESTART_BOUND_S = 60  # a killed worker is back within this (the measured time is printed)


def _body(model: str, max_tokens: int) -> dict:
    return {"model": model, "prompt": "Once upon a time", "max_tokens": max_tokens, "min_tokens": max_tokens,
            "temperature": 0.0, "stream_options": {"include_usage": True}}


def _waiting(conn) -> int | None:
    snap = conn.snapshot
    return None if snap is None else snap.num_waiting[Tier.STANDARD]


def _health(url: str) -> tuple[int, dict]:
    r = httpx.get(f"{url}/health", timeout=5)
    return r.status_code, r.json()


def _health_when(url: str, status: str, timeout_s: float) -> tuple[int, dict]:
    """/health's answer once it says `status`."""

    def says() -> tuple[int, dict] | None:
        answer = _health(url)
        return answer if answer[1]["status"] == status else None

    return wait_for(says, timeout_s, f"/health to say {status}")


def _fill(pool, server, *, streams_per_worker: int, slots: int) -> dict:
    """Start `slots` long streams per worker and wait until each produced a
    token, then queue the rest (short ones) behind them and wait until every
    worker shows them waiting. Returns client id -> future of its result."""
    workers = len(server.fleet.workers)
    streaming = {f"long-{i}": threading.Event() for i in range(slots * workers)}
    futures = {cid: pool.submit(stream_completion, server.url, server.key, _body(server.model, LONG_TOKENS),
                                request_id=cid, on_first_token=ev.set) for cid, ev in streaming.items()}
    wait_for(lambda: all(ev.is_set() for ev in streaming.values()), 60, "every long stream's first token")
    queued = (streams_per_worker - slots) * workers
    futures.update({f"short-{i}": pool.submit(stream_completion, server.url, server.key,
                                              _body(server.model, SHORT_TOKENS), request_id=f"short-{i}")
                    for i in range(queued)})
    wait_for(lambda: all(_waiting(c) == streams_per_worker - slots for c in server.fleet.workers.values()), 30,
             "the short streams to queue on every worker")
    return futures


def _on(conn) -> tuple[set[str], set[str]]:
    """The client ids of the long and the short streams a worker holds."""
    ids = {client_request_id(r) for r in list(conn.in_flight)}  # list(): one atomic copy of the loop's dict
    return {i for i in ids if i.startswith("long")}, {i for i in ids if i.startswith("short")}


def _results(futures: dict) -> dict:
    return {cid: f.result(timeout=RESULT_TIMEOUT_S) for cid, f in futures.items()}


def _assert_complete(result, max_tokens: int) -> None:
    assert (result.status, result.errors, result.done) == (200, [], True), result
    assert result.finish_reason == "length"
    assert result.usage["completion_tokens"] == max_tokens


def _assert_ended_with_error(result, worker_id: str) -> None:
    """Streamed tokens, then one error event naming the worker, then [DONE]."""
    assert result.status == 200 and result.text, result
    assert result.finish_reason is None and result.usage is None
    [error] = result.errors
    assert error["code"] == "engine_error" and f"worker {worker_id}" in error["message"], error
    assert result.done


def test_sigkill_mid_stream_errors_the_streams_retries_the_queued_restarts_and_bills_once(
        tiny_llama_dir, tmp_path, db_url):
    server = start_fleet_server(tmp_path, tiny_llama_dir, policy="round-robin", db_url=db_url, max_num_seqs=2,
                                num_kv_blocks=512)
    fleet, sup = server.fleet, server.supervisor
    victim = fleet.workers["0"]
    try:
        with ThreadPoolExecutor(8) as pool:
            futures = _fill(pool, server, streams_per_worker=4, slots=2)
            running, queued = _on(victim)
            assert len(running) == 2 and len(queued) == 2  # the premise: both kinds on the victim
            old_pid = sup.pid("0")
            killed_at = time.monotonic()
            os.kill(old_pid, signal.SIGKILL)
            status, body = _health_when(server.url, "degraded", 10)
            assert status == 200 and body["workers"]["0"].startswith("down") and body["workers"]["1"] == "ready"
            results = _results(futures)

        for cid in running:
            _assert_ended_with_error(results[cid], "0")
        for cid, result in results.items():
            if cid not in running:
                _assert_complete(result, SHORT_TOKENS if cid.startswith("short") else LONG_TOKENS)
        assert fleet.retried == len(queued)

        wait_for(lambda: fleet.health().status is Health.OK and victim.sessions == 2, RESTART_BOUND_S,
                 f"the killed worker to be back within {RESTART_BOUND_S}s")
        restart_s = time.monotonic() - killed_at
        print(f"\nkilled worker back (health ok, new session) after {restart_s:.1f}s")
        assert sup.restarts == {"0": 1, "1": 0}
        assert sup.pid("0") not in (None, old_pid)
        assert _health(server.url) == (200, {"status": "ok", "workers": {"0": "ready", "1": "ready"}})
        # The fresh engine serves: round-robin sends one of two requests to it.
        assert victim.snapshot.steps == 0
        after = [stream_completion(server.url, server.key, _body(server.model, SHORT_TOKENS), request_id=f"after-{i}")
                 for i in range(2)]
        for result in after:
            _assert_complete(result, SHORT_TOKENS)
        assert victim.snapshot.steps > 0
        wait_for(lambda: server.live.gateway.in_flight == 0, 10, "no request left in flight")
    finally:
        server.stop()  # settles and flushes the spool to the ledger

    by_client = request_records_by_client(db_url)
    assert Counter({cid: len(rows) for cid, rows in by_client.items()}) == Counter(
        {cid: 1 for cid in [*results, "after-0", "after-1"]})
    for cid, [record] in by_client.items():
        if cid in running:
            assert record.finish_reason == "error", record
            assert 0 < record.completion_tokens < LONG_TOKENS and record.gpu_us > 0
        else:
            assert record.finish_reason == "length", record
            assert record.completion_tokens == (LONG_TOKENS if cid.startswith("long") else SHORT_TOKENS)
    # Conservation over both workers: every step the gateway heard is charged once.
    assert sum(r.charged_us for r in ledger_records(db_url)) == sum(s.busy_time_us for s in server.steps)


def test_a_worker_that_stops_heartbeating_is_lost_within_the_timeout_and_comes_back_when_resumed(
        tiny_llama_dir, tmp_path):
    """SIGSTOP: the process lives on but sends nothing, so only the missing
    heartbeat can tell. Once resumed it answers the connection's next Hello:
    a new session, which aborts what the old one left running there."""
    timeout_s = 2.0
    server = start_fleet_server(tmp_path, tiny_llama_dir, policy="round-robin", heartbeat_timeout_s=timeout_s,
                                max_num_seqs=1, num_kv_blocks=512)
    fleet, sup = server.fleet, server.supervisor
    victim = fleet.workers["0"]
    pid = sup.pid("0")
    try:
        with ThreadPoolExecutor(4) as pool:
            futures = _fill(pool, server, streams_per_worker=2, slots=1)
            [running], [queued] = _on(victim)
            stopped_at = time.monotonic()
            os.kill(pid, signal.SIGSTOP)
            lost = futures[running].result(timeout=RESULT_TIMEOUT_S)
            lost_after_s = time.monotonic() - stopped_at
            print(f"\nthe stopped worker's stream ended {lost_after_s:.2f}s after SIGSTOP (timeout {timeout_s:g}s)")
            _assert_ended_with_error(lost, "0")
            # The worker sends something at least every 0.5 s (its heartbeat),
            # so it was heard at most that long before it stopped.
            assert timeout_s - 0.5 <= lost_after_s < timeout_s + 3
            status, body = _health_when(server.url, "degraded", 5)
            assert body["workers"] == {"0": f"down: no heartbeat for {timeout_s:g}s", "1": "ready"}
            results = _results(futures)
        for cid, result in results.items():
            if cid != running:
                _assert_complete(result, SHORT_TOKENS if cid.startswith("short") else LONG_TOKENS)
        assert fleet.retried == 1  # `queued`, sent on to worker 1

        os.kill(pid, signal.SIGCONT)
        wait_for(lambda: fleet.health().status is Health.OK and victim.sessions == 2, 30,
                 "the resumed worker to open a new session")
        assert sup.restarts == {"0": 0, "1": 0} and sup.pid("0") == pid  # the same process, never restarted
        wait_for(lambda: victim.snapshot.num_requests == 0, 10, "the old session's requests to be aborted")
        steps = victim.snapshot.steps
        for i in range(2):
            _assert_complete(stream_completion(server.url, server.key, _body(server.model, SHORT_TOKENS),
                                               request_id=f"after-{i}"), SHORT_TOKENS)
        assert victim.snapshot.steps > steps
    finally:
        os.kill(pid, signal.SIGCONT)  # a stopped worker could not stop with the gateway
        server.stop()

    records = {cid: [r.finish_reason for r in rows] for cid, rows in request_records_by_client(server.db_url).items()}
    assert records == {**{cid: ["length"] for cid in results if cid != running}, running: ["error"],
                       "after-0": ["length"], "after-1": ["length"]}


def test_an_engine_failure_in_a_worker_errors_its_streams_and_the_worker_exits_3_and_restarts(
        tiny_llama_dir, tmp_path, monkeypatch):
    fault_after = 300  # steps: both streams below have streamed by then, and the request after has not
    monkeypatch.setenv(FAULT_AFTER_STEPS_ENV, str(fault_after))  # the workers inherit it
    server = start_fleet_server(tmp_path, tiny_llama_dir, policy="round-robin", workers=1, num_kv_blocks=512)
    fleet, sup = server.fleet, server.supervisor
    exits = []
    forward = sup.on_exit
    sup.on_exit = lambda worker_id, code: (exits.append((worker_id, code)), forward(worker_id, code))
    try:
        with ThreadPoolExecutor(2) as pool:
            futures = {f"long-{i}": pool.submit(stream_completion, server.url, server.key,
                                                _body(server.model, LONG_TOKENS), request_id=f"long-{i}")
                       for i in range(2)}
            results = _results(futures)
        failed_at = time.monotonic()
        for result in results.values():
            assert result.status == 200 and result.text and result.done, result
            [error] = result.errors
            assert error["code"] == "engine_error" and "an injected fault" in error["message"], error
        wait_for(lambda: fleet.health().status is Health.OK and fleet.workers["0"].sessions == 2, RESTART_BOUND_S,
                 "the failed worker to be restarted")
        print(f"\nthe failed worker was back {time.monotonic() - failed_at:.1f}s after its streams ended")
        assert exits == [("0", EXIT_ENGINE_FAILED)] and sup.restarts == {"0": 1}
        _assert_complete(stream_completion(server.url, server.key, _body(server.model, SHORT_TOKENS),
                                           request_id="after"), SHORT_TOKENS)
    finally:
        server.stop()

    by_client = request_records_by_client(server.db_url)
    assert {cid: [r.finish_reason for r in rows] for cid, rows in by_client.items()} == {
        "long-0": ["error"], "long-1": ["error"], "after": ["length"]}
    assert all(0 < rows[0].completion_tokens <= fault_after for cid, rows in by_client.items() if cid != "after")
    assert sum(r.charged_us for r in ledger_records(server.db_url)) == sum(s.busy_time_us for s in server.steps)
