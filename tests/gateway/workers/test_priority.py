"""A local CPU worker runs nicer than the gateway that started it, every
thread of it (engine/host_cpu.py, WORKER_NICENESS), and still serves."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from engine.host_cpu import WORKER_NICENESS
from tests.gateway.workers.live_fleet import start_fleet_server, stream_completion
from tests.niceness import niceness_of_threads


@pytest.mark.skipif(not Path("/proc/self/task").is_dir(), reason="needs Linux's /proc")
@pytest.mark.skipif(os.getpriority(os.PRIO_PROCESS, 0) >= 19, reason="already as nice as can be: nothing to see")
def test_a_local_cpu_worker_runs_every_thread_nicer_than_its_gateway(tiny_llama_dir, tmp_path):
    server = start_fleet_server(tmp_path, tiny_llama_dir, workers=1, niceness=WORKER_NICENESS, device="cpu")
    try:
        body = {"model": server.model, "prompt": "Once upon a time", "max_tokens": 8, "min_tokens": 8,
                "temperature": 0.0}
        result = stream_completion(server.url, server.key, body, request_id="nice-0")
        assert (result.status, result.errors, result.done) == (200, [], True), result
        gateway = os.getpriority(os.PRIO_PROCESS, 0)
        threads = niceness_of_threads(server.supervisor.pid("0"))
        # The I/O thread, the engine thread and torch's: every one of them.
        assert len(threads) >= 3
        assert set(threads.values()) == {min(19, gateway + WORKER_NICENESS)}
    finally:
        server.stop()
