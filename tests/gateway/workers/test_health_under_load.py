"""/health and /ready tell the truth about the workers, and answer fast while
a worker is saturated (issue 13).

Real worker processes on the tiny random Llama behind a live gateway. The
event loop test reads its 64 streams from one thread that only `select`s
and `recv`s raw sockets, so the test's own clients take little of the
interpreter lock the gateway's event loop needs, and times /health from a
process of its own, as a prober does. The gateway shares the pytest
process, so the test gives it what `loragw serve` gives it: a worker at
the serving niceness and a frozen startup heap (below).
"""

from __future__ import annotations

import contextlib
import gc
import json
import os
import selectors
import signal
import statistics
import subprocess
import sys
import threading
from urllib.parse import urlsplit

import httpx
import pytest

from engine.host_cpu import WORKER_NICENESS
from engine.request import Tier
from tests.gateway.hangups import hang_up, send_request
from tests.gateway.live import wait_for
from tests.gateway.workers.live_fleet import start_fleet_server

STREAMS = 64
MAX_TOKENS = 1500
# Room for every stream's whole output (blocks of 16 positions, the prompt
# within the spare), so that no stream is preempted while the test holds
# the load: with 2,048 blocks, 512 positions a stream, a fast host got
# there during the sampling (~480 steps), and a preempted stream left 63
# running.
KV_BLOCKS = STREAMS * (MAX_TOKENS // 16 + 2)
SAMPLES = 200
SAMPLE_INTERVAL_S = 0.02
P99_BOUND_S = 0.05
# This test keeps about two threads runnable (the worker's step, the event
# loop). A load average above twice the cores means other jobs want more of
# the CPU than it does: a p99 over the bound then says more about them than
# about the gateway, and the test reports it as an expected failure.
_OWN_LOAD_PER_CORE = 2


def _probe(url: str) -> tuple[int, dict, int, dict]:
    health = httpx.get(f"{url}/health", timeout=5)
    ready = httpx.get(f"{url}/ready", timeout=5)
    return health.status_code, health.json(), ready.status_code, ready.json()


def _kill(server, worker_id: str) -> None:
    os.kill(server.supervisor.pid(worker_id), signal.SIGKILL)
    wait_for(lambda: not server.fleet.workers[worker_id].ready, 10, f"worker {worker_id} to be seen down")


def test_health_and_ready_say_ok_then_degraded_naming_the_dead_worker_then_unavailable(tiny_llama_dir, tmp_path):
    # Restarts wait ten minutes: the test sees the fleet as the kills left it.
    server = start_fleet_server(tmp_path, tiny_llama_dir, policy="round-robin", backoff_s=600.0)
    try:
        health, body, ready, ready_body = _probe(server.url)
        assert (health, body) == (200, {"status": "ok", "workers": {"0": "ready", "1": "ready"}})
        assert ready == 200 and ready_body["health"] == "ok"

        _kill(server, "0")
        health, body, ready, ready_body = _probe(server.url)
        assert health == 200 and body["status"] == "degraded"
        assert body["workers"]["0"].startswith("down: the worker process exited with code -9"), body
        assert body["workers"]["1"] == "ready"
        assert ready == 200 and ready_body["health"] == "degraded"  # one worker still serves

        _kill(server, "1")
        health, body, ready, ready_body = _probe(server.url)
        assert health == 503 and body["status"] == "unavailable"
        assert all(state.startswith("down") for state in body["workers"].values()) and len(body["workers"]) == 2
        assert (ready, ready_body["status"], ready_body["reason"]) == (503, "unavailable", "no engine worker is up")
        assert server.supervisor.pid("0") is None and server.supervisor.pid("1") is None  # both wait out the backoff
    finally:
        server.stop()


class _Drain:
    """Reads every byte the gateway sends on a set of sockets, from one
    thread, and keeps nothing: the 64 clients of the load."""

    def __init__(self, sockets):
        self.selector = selectors.DefaultSelector()
        for sock in sockets:
            sock.setblocking(False)
            self.selector.register(sock, selectors.EVENT_READ)
        self.stop = threading.Event()
        self.closed = 0  # sockets the server closed: a stream that ended
        self.thread = threading.Thread(target=self._run, name="stream-drain", daemon=True)
        self.thread.start()

    def _run(self) -> None:
        while not self.stop.is_set():
            for key, _ in self.selector.select(timeout=0.1):
                if not key.fileobj.recv(1 << 16):
                    self.selector.unregister(key.fileobj)
                    self.closed += 1

    def close(self) -> None:
        self.stop.set()
        self.thread.join(timeout=10)
        self.selector.close()


# The prober: a process of its own, so that its timings hold none of the
# waits for the interpreter lock that a thread in the gateway's process
# would add (each socket call gives the lock up and waits to get it back
# from a busy event loop). A new connection a probe, as a kubelet's HTTP
# probes (they turn keep-alive off), so that each one also waits for the
# event loop to accept it.
_PROBER = """
import http.client, json, sys, time
host, port, samples, interval = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), float(sys.argv[4])
latencies = []
for _ in range(samples):
    t0 = time.perf_counter()
    conn = http.client.HTTPConnection(host, port, timeout=5)
    conn.request("GET", "/health")
    response = conn.getresponse()
    response.read()
    latencies.append(time.perf_counter() - t0)
    conn.close()
    if response.status != 200:
        sys.exit(f"/health answered {response.status}")
    time.sleep(interval)
print(json.dumps(latencies))
"""


def _sample_health(url: str) -> list[float]:
    """SAMPLES timed GETs of /health about SAMPLE_INTERVAL_S apart, from a
    process of their own."""
    where = urlsplit(url)
    probe = subprocess.run([sys.executable, "-c", _PROBER, where.hostname, str(where.port), str(SAMPLES),
                            str(SAMPLE_INTERVAL_S)], capture_output=True, text=True, timeout=120)
    assert probe.returncode == 0, probe.stderr
    latencies = json.loads(probe.stdout)
    assert len(latencies) == SAMPLES
    return latencies


@contextlib.contextmanager
def _startup_heap_frozen():
    """`loragw serve` freezes its heap once startup ends, so no full pass of
    the collector walks it (engine/heap.py); what requests make afterwards
    is collected as before. Here the gateway lives in the pytest process,
    whose heap holds every earlier test's objects: a full pass over it
    stalled the event loop for 0.4-0.5 s even in a run of this test alone
    (two Zen 5 cores), a stall the served gateway does not have. So the
    heap is frozen as the gateway stands before its first request, and
    handed back to the collector when the test ends, so nothing outlives it
    (engine/heap.py: a test process must not leave its heap frozen)."""
    gc.collect()
    gc.freeze()
    try:
        yield
    finally:
        gc.unfreeze()


def test_health_p99_stays_under_50ms_while_one_worker_runs_64_streams(tiny_llama_dir, tmp_path):
    # The worker at the niceness `loragw serve` gives a local worker (gateway/config.py).
    server = start_fleet_server(tmp_path, tiny_llama_dir, policy="round-robin", workers=1, num_kv_blocks=KV_BLOCKS,
                                niceness=WORKER_NICENESS)
    gw, worker = server.live.gateway, server.fleet.workers["0"]
    body = {"model": server.model, "prompt": "Once upon a time", "max_tokens": MAX_TOKENS, "min_tokens": MAX_TOKENS,
            "temperature": 0.0, "stream": True}
    try:
        with _startup_heap_frozen():
            sockets = [send_request(server.url, "/v1/completions", body, server.key, request_id=f"load-{i}")
                       for i in range(STREAMS)]
            drain = _Drain(sockets)
            try:
                wait_for(lambda: worker.snapshot.num_running[Tier.STANDARD] == STREAMS, 60, "all 64 streams to run")
                steps_before = worker.snapshot.steps
                latencies = _sample_health(server.url)
                # The premise: the load ran all along (no stream ended) and the worker kept stepping.
                assert drain.closed == 0 and worker.snapshot.num_running[Tier.STANDARD] == STREAMS
                steps = worker.snapshot.steps - steps_before
                load = os.getloadavg()
            finally:
                drain.close()
                for sock in sockets:
                    hang_up(sock)  # the load ends here: the gateway aborts all 64
        wait_for(lambda: gw.in_flight == 0, 30, "the aborted streams to end")
    finally:
        server.stop()

    q = statistics.quantiles(latencies, n=100)
    p50, p99 = statistics.median(latencies), q[98]
    print(f"\n/health under {STREAMS} streams: p50 {p50 * 1000:.1f} ms, p99 {p99 * 1000:.1f} ms, max "
          f"{max(latencies) * 1000:.1f} ms; {steps} worker steps meanwhile; load average {load[0]:.1f}")
    assert steps > 0
    cores = os.cpu_count() or 1
    verdict = f"p99 {p99 * 1000:.1f} ms with load average {load[0]:.1f} on {cores} cores"
    if p99 >= P99_BOUND_S and load[0] > _OWN_LOAD_PER_CORE * cores:
        pytest.xfail(f"{verdict}: other jobs hold the CPU; the bound is for a machine this test has to itself")
    assert p99 < P99_BOUND_S, verdict
