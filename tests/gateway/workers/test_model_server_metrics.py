"""A live `loragw worker`'s /metrics in the inference extension's
model-server protocol (engine/model_server_metrics.py), read as an endpoint
picker reads it: over HTTP, parsed by prometheus_client's text parser,
while the worker serves requests with adapters.

The worker is driven over its own protocol, as a gateway drives it, so the
test decides exactly what the engine holds: one sequence runs at a time
(--max-num-seqs 1), so of three long requests one runs and two wait."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import time

import httpx
import pytest
import zmq
from prometheus_client.parser import text_string_to_metric_families

from adapters.registry import AdapterRegistry
from engine.request import Tier
from engine.sampling_params import SamplingParams
from engine.wire import PROTOCOL_VERSION, Abort, AddRequest, Codec, Hello, Status
from tests.gateway.live import wait_for
from tests.gateway.workers.live_fleet import WORKER_START_S
from tests.gateway.workers.test_remote_worker import free_port

NUM_KV_BLOCKS, MAX_LORAS = 128, 2


class WorkerSession:
    """A gateway's side of one worker session, reduced to what the test needs."""

    def __init__(self, endpoint: str):
        self.codec = Codec()
        self.context = zmq.Context()
        self.socket = self.context.socket(zmq.DEALER)
        self.socket.setsockopt(zmq.LINGER, 0)
        self.socket.connect(endpoint)
        self.send(Hello(PROTOCOL_VERSION, "metrics-test"))

    def send(self, message) -> None:
        self.socket.send(self.codec.encode(message))

    def wait_loaded(self) -> None:
        deadline = time.monotonic() + WORKER_START_S
        while time.monotonic() < deadline:
            if self.socket.poll(100):
                message = self.codec.decode_to_gateway(self.socket.recv())
                if isinstance(message, Status):
                    assert message.load_error is None, message.load_error
                    if message.worker is not None:
                        return
        raise AssertionError("the worker did not load its model")

    def close(self) -> None:
        self.socket.close()
        self.context.term()


@pytest.fixture(scope="module")
def adapter_keys(lora_dirs, tmp_path_factory):
    """lora-a, lora-b and lora-c in a data directory the worker loads from."""
    data_dir = tmp_path_factory.mktemp("msp-data")
    registry = AdapterRegistry(data_dir / "adapters")
    keys = {name: registry.import_dir(name, lora_dirs[name]).key for name in ("lora-a", "lora-b", "lora-c")}
    return data_dir, keys


@pytest.fixture(scope="module")
def worker(tiny_llama_dir, adapter_keys):
    """`loragw worker` with a metrics port; yields (session, metrics URL)."""
    data_dir, _ = adapter_keys
    port = free_port()
    cmd = [sys.executable, "-m", "gateway.cli", "worker", "--listen", "tcp://127.0.0.1:0", "--model",
           str(tiny_llama_dir), "--num-kv-blocks", str(NUM_KV_BLOCKS), "--max-loras", str(MAX_LORAS),
           "--max-num-seqs", "1", "--num-threads", "1", "--metrics-port", str(port), "--log-level", "warning"]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, text=True, env={**os.environ, "LORAGW_DATA_DIR": str(data_dir)})
    session = None
    try:
        found = re.search(r"listening on (tcp://\S+)", proc.stdout.readline())
        assert found, "the worker did not name its endpoint"
        session = WorkerSession(found[1])
        session.wait_loaded()
        yield session, f"http://127.0.0.1:{port}/metrics"
    finally:
        if session is not None:
            session.close()
        proc.terminate()
        assert proc.wait(timeout=30) == 0


def scrape(url: str) -> dict[str, list]:
    """{family name: its samples}, as the text parser reads the page."""
    families = text_string_to_metric_families(httpx.get(url, timeout=10).text)
    return {f.name: f.samples for f in families}


def one(samples: dict, name: str):
    (sample,) = samples[name]
    return sample


def adapters(label: str) -> set[str]:
    """A comma-separated adapter list as the EPP splits it."""
    return {name.strip() for name in label.split(",") if name.strip()}


def test_an_idle_worker_reports_its_cache_and_no_load(worker):
    _, url = worker
    samples = scrape(url)
    assert one(samples, "vllm:num_requests_waiting").value == 0
    assert one(samples, "vllm:num_requests_running").value == 0
    assert one(samples, "vllm:kv_cache_usage_perc").value == 0
    cache = one(samples, "vllm:cache_config_info")
    assert cache.value == 1 and cache.labels == {"block_size": "16", "num_gpu_blocks": str(NUM_KV_BLOCKS)}
    before = time.time()
    lora = one(scrape(url), "vllm:lora_requests_info")
    assert lora.labels["max_lora"] == str(MAX_LORAS)
    assert before <= lora.value <= time.time()  # the update's wall-clock time


def test_requests_in_flight_show_as_running_and_waiting_with_their_adapters(worker, adapter_keys):
    session, url = worker
    _, keys = adapter_keys
    # Long enough that the state lasts many scrapes; aborted at the end.
    params = SamplingParams(max_tokens=1500, ignore_eos=True, temperature=0.0)
    order = ["lora-a", "lora-b", "lora-c"]
    for i, name in enumerate(order):
        session.send(AddRequest(f"r{i}", [1, 2, 3, 4, 5, 6, 7, 8], params, Tier.STANDARD, keys[name], None))

    def busy():
        samples = scrape(url)
        queued = one(samples, "vllm:num_requests_waiting").value == 2
        return samples if queued and one(samples, "vllm:num_requests_running").value == 1 else None

    try:
        samples = wait_for(busy, 60, "one request running and two waiting")
        lora = one(samples, "vllm:lora_requests_info")
        # First come, first served: lora-a's request runs, so its adapter
        # is in a device slot; the others' requests wait.
        assert adapters(lora.labels["waiting_lora_adapters"]) == {"lora-b", "lora-c"}
        running = adapters(lora.labels["running_lora_adapters"])
        assert "lora-a" in running and len(running) <= MAX_LORAS
        usage = one(samples, "vllm:kv_cache_usage_perc").value
        # The same scrape in loragw's names: one snapshot behind both.
        ours = {tuple(s.labels.items()): s.value for s in samples["loragw:kv_cache_blocks"]}
        used = sum(v for labels, v in ours.items() if ("state", "used") in labels)
        assert usage == pytest.approx(used / NUM_KV_BLOCKS) and 0 < usage <= 1
    finally:
        session.send(Abort(["r0", "r1", "r2"]))

    def idle():
        samples = scrape(url)
        load = one(samples, "vllm:num_requests_waiting").value + one(samples, "vllm:num_requests_running").value
        return samples if load == 0 else None

    samples = wait_for(idle, 60, "the aborted requests to leave the engine")
    lora = one(samples, "vllm:lora_requests_info")
    assert lora.labels["waiting_lora_adapters"] == ""
    # An adapter stays in its slot after its requests end: still ready to serve.
    assert "lora-a" in adapters(lora.labels["running_lora_adapters"])
    assert one(samples, "vllm:kv_cache_usage_perc").value == 0
