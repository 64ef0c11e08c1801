"""`loragw worker` as an operator runs it on another machine, and a gateway
that attaches it by address (`--workers 0 --worker tcp://...`): the CLI,
the TCP listener, the shared secret, and the worker's own /metrics."""

from __future__ import annotations

import os
import re
import socket
import subprocess
import sys

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from gateway.config import GatewayConfig, WorkerPoolConfig
from gateway.server import build_gateway
from gateway.tenancy import Tier
from tests.gateway.live import seed_tenants, start_live_server, wait_for
from tests.gateway.workers.live_fleet import WORKER_START_S

SECRET = "remote-worker-secret-0123456789abcdef"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture
def remote_worker(tiny_llama_dir, tmp_path):
    """`loragw worker` on a TCP port of the OS's choosing, with a secret
    file and a metrics port; yields (endpoint, metrics URL)."""
    secret_file = tmp_path / "secret"
    secret_file.write_text(SECRET + "\n")
    metrics_port = free_port()
    cmd = [sys.executable, "-m", "gateway.cli", "worker", "--listen", "tcp://127.0.0.1:0", "--model",
           str(tiny_llama_dir), "--num-kv-blocks", "64", "--max-loras", "0", "--num-threads", "1",
           "--secret-file", str(secret_file), "--metrics-port", str(metrics_port), "--log-level", "warning"]
    env = {**os.environ, "LORAGW_DATA_DIR": str(tmp_path / "data")}
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, text=True, env=env)
    try:
        line = proc.stdout.readline()  # the first line names the bound endpoint
        found = re.search(r"listening on (tcp://127\.0\.0\.1:\d+)", line)
        assert found, f"unexpected first line: {line!r}"
        yield found[1], f"http://127.0.0.1:{metrics_port}/metrics"
    finally:
        proc.terminate()
        assert proc.wait(timeout=30) == 0  # SIGTERM is a clean stop


def test_a_gateway_attaches_a_remote_worker_by_address(remote_worker, tiny_llama_dir, tmp_path):
    endpoint, metrics_url = remote_worker
    db_url = f"sqlite+aiosqlite:///{tmp_path / 'loragw.db'}"
    key = seed_tenants(db_url, {"acme": Tier.STANDARD})["acme"]
    config = GatewayConfig(db_url=db_url, data_dir=tmp_path / "data",
                           worker_pool=WorkerPoolConfig(workers=0, worker_endpoints=(endpoint,), worker_secret=SECRET))
    config.engine.model, config.engine.lora.max_loras = str(tiny_llama_dir), 0
    live = start_live_server(build_gateway(config), ready_timeout_s=WORKER_START_S)
    try:
        health = httpx.get(f"{live.url}/health").json()
        assert health == {"status": "ok", "workers": {"remote-0": "ready"}}
        r = httpx.post(f"{live.url}/v1/completions", headers={"Authorization": f"Bearer {key}"}, timeout=60,
                       json={"model": live.gateway.served_model_name, "prompt": "Hello", "max_tokens": 5,
                             "min_tokens": 5, "temperature": 0})
        assert r.status_code == 200, r.text
        assert r.json()["usage"]["completion_tokens"] == 5
        # The worker's own /metrics: its engine series, with no worker label.
        samples = {(s.name, tuple(sorted(s.labels.items()))): s.value
                   for f in text_string_to_metric_families(httpx.get(metrics_url).text) for s in f.samples}
        assert samples[("loragw:num_requests_running", (("tier", "standard"),))] == 0
        assert samples[("loragw:kv_cache_blocks", (("state", "used"), ("tier", "standard")))] == 0
    finally:
        live.stop()


def test_a_gateway_with_the_wrong_secret_is_refused_and_says_why(remote_worker, tiny_llama_dir, tmp_path):
    endpoint, _ = remote_worker
    db_url = f"sqlite+aiosqlite:///{tmp_path / 'loragw.db'}"
    seed_tenants(db_url, {})
    config = GatewayConfig(db_url=db_url, data_dir=tmp_path / "data",
                           worker_pool=WorkerPoolConfig(workers=0, worker_endpoints=(endpoint,),
                                                        worker_secret="not-" + SECRET))
    config.engine.model = str(tiny_llama_dir)
    live = start_live_server(build_gateway(config), wait_ready=False)
    try:
        def refused():
            body = httpx.get(f"{live.url}/ready").json()
            return body if body["workers"]["remote-0"].startswith("refused") else None

        body = wait_for(refused, 60, "the worker to refuse the session")
        assert "secret" in body["workers"]["remote-0"] and body["status"] == "unavailable"
        assert httpx.get(f"{live.url}/health").status_code == 503  # its one worker is unusable
    finally:
        live.stop()
