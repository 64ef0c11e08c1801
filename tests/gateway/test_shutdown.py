"""`loragw serve` as a real process: it prints the demo tenant's key, and on
SIGTERM drains: a running stream finishes with [DONE], new requests get 503
while /health still answers, and the process exits 0."""

from __future__ import annotations

import datetime as dt
import json
import os
import re
import signal
import socket
import subprocess
import sys

import httpx
import openai
import pytest

import migrations
from gateway.server import ensure_demo_tenant
from tests.gateway.live import run_with_store, wait_for


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture
def served(tiny_llama_dir, tmp_path):
    port = _free_port()
    out = tmp_path / "stdout.txt"
    env = {**os.environ, "LORAGW_DATA_DIR": str(tmp_path / "data"), "LORAGW_DRAIN_TIMEOUT": "60"}
    cmd = [sys.executable, "-m", "gateway.cli", "serve", "--model", str(tiny_llama_dir), "--port", str(port),
           "--max-num-seqs", "4", "--log-level", "warning"]
    with open(out, "w") as stdout:
        proc = subprocess.Popen(cmd, stdout=stdout, stderr=subprocess.STDOUT, env=env)
    try:
        key = wait_for(lambda: re.search(r"lgw-[\w-]+", out.read_text()), 60, "the demo key")[0]
        url = f"http://127.0.0.1:{port}"

        def ready():
            try:
                return httpx.get(f"{url}/ready").status_code == 200
            except httpx.TransportError:
                return proc.poll() is not None  # exited: fail below, not after a timeout

        wait_for(ready, 120, "/ready")
        assert proc.poll() is None, out.read_text()
        yield proc, url, key, out
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def test_sigterm_drains_the_running_stream_refuses_new_requests_and_exits_0(served):
    proc, url, key, out = served
    auth = {"Authorization": f"Bearer {key}"}
    (model,) = [m["id"] for m in httpx.get(f"{url}/v1/models", headers=auth).json()["data"]]
    body = {"model": model, "prompt": "Once upon a time", "max_tokens": 60, "min_tokens": 60, "stream": True,
            "logprobs": 0}
    with httpx.stream("POST", f"{url}/v1/completions", json=body, headers=auth, timeout=60) as stream:
        lines = stream.iter_lines()
        first = next(line for line in lines if line.startswith("data: "))
        assert '"finish_reason":null' in first

        proc.send_signal(signal.SIGTERM)
        # New work is refused with a typed 503, while the probe still answers.
        client = openai.OpenAI(base_url=f"{url}/v1", api_key=key, max_retries=0)
        refused = wait_for(lambda: _refused(client, model), 10, "a 503 while draining")
        assert refused.status_code == 503 and refused.code == "draining"
        assert httpx.get(f"{url}/health").status_code == 200
        assert httpx.get(f"{url}/ready").status_code == 503

        events = [line for line in lines if line.startswith("data: ")]
    assert events[-1] == "data: [DONE]"
    assert '"finish_reason":"length"' in events[-2]
    # Every token arrives: a chunk may carry several (steps merged while
    # this reader was behind); its logprobs list one entry per token.
    tokens = [json.loads(e[6:])["choices"][0]["logprobs"]["tokens"] for e in [first, *events[:-1]]]
    assert sum(map(len, tokens)) == 60
    assert proc.wait(timeout=60) == 0, out.read_text()


def _refused(client: openai.OpenAI, model: str):
    try:
        client.completions.create(model=model, prompt="hi", max_tokens=1)
    except openai.InternalServerError as exc:
        return exc
    return None


def test_the_demo_key_is_issued_only_on_an_empty_database(tmp_path):
    url = f"sqlite+aiosqlite:///{tmp_path / 'loragw.db'}"
    migrations.upgrade(url)
    now = dt.datetime.now(dt.UTC)

    async def twice(store):
        first = await ensure_demo_tenant(store, now)
        return first, await ensure_demo_tenant(store, now), await store.authenticate(first.secret, now=now)

    first, second, principal = run_with_store(url, twice)
    assert first.secret.startswith("lgw-") and second is None
    assert principal.tenant.name == "demo"
