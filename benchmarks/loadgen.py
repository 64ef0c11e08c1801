"""Open-loop HTTP load against a running gateway, and the server it runs against.

`GatewayProcess` starts `loragw serve` in a subprocess with a fresh data dir
and SQLite file, so each benchmark phase gets a clean server. `open_loop`
sends streaming completions with Poisson arrivals and records, per request,
when it was sent, its TTFT as the client saw it, and how it ended. Arrivals
never wait for earlier requests: a slow server makes the queue grow, it
does not slow the offered load (the usual closed-loop mistake).
"""

from __future__ import annotations

import asyncio
import json
import os
import random
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import httpx

ADMIN_TOKEN = "bench-admin-token-0123456789abcdef"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class GatewayProcess:
    def __init__(self, extra_args: list[str], *, model: str | None = None, env: dict[str, str] | None = None,
                 wrapper: list[str] = (), keep_log: Path | None = None):
        """`wrapper`: a command that runs the server, e.g. a profiler's
        `py-spy record ... --`. `keep_log`: where the server's log is copied
        when it stops (else it goes with the data dir)."""
        self.keep_log = keep_log
        self.port = _free_port()
        self.base_url = f"http://127.0.0.1:{self.port}"
        self._tmp = tempfile.TemporaryDirectory(prefix="loragw-bench-")
        env = {**os.environ, **(env or {}), "LORAGW_DATA_DIR": self._tmp.name, "LORAGW_ADMIN_TOKEN": ADMIN_TOKEN}
        cmd = [*wrapper, sys.executable, "-m", "gateway.cli", "serve", "--port", str(self.port),
               "--db", f"sqlite+aiosqlite:///{self._tmp.name}/bench.db", *extra_args]
        if model:
            cmd += ["--model", model]
        self.log_path = Path(self._tmp.name) / "server.log"
        self._log = open(self.log_path, "w")
        self.proc = subprocess.Popen(cmd, env=env, stdout=self._log, stderr=subprocess.STDOUT)

    def wait_ready(self, timeout: float = 600.0) -> None:
        wait_until_ok(self.proc, f"{self.base_url}/ready", timeout, poll_s=0.5, what="gateway",
                      log_tail=lambda: self.log_path.read_text()[-2000:])

    def create_tenant(self, name: str, tier: str) -> str:
        """Create a tenant with no limits of its own; return an API key."""
        headers = {"Authorization": f"Bearer {ADMIN_TOKEN}"}
        r = httpx.post(f"{self.base_url}/admin/tenants", json={"name": name, "tier": tier}, headers=headers)
        r.raise_for_status()
        r = httpx.post(f"{self.base_url}/admin/tenants/{name}/keys", json={}, headers=headers)
        r.raise_for_status()
        return r.json()["key"]

    def stop(self) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(60)
        except subprocess.TimeoutExpired:
            self.proc.kill()
        self._log.close()
        try:
            if self.keep_log is not None:
                shutil.copy(self.log_path, self.keep_log)
        except OSError as exc:  # the run's results matter more than its log
            print(f"server log not kept at {self.keep_log}: {exc}", file=sys.stderr)
        finally:
            self._tmp.cleanup()


def wait_until_ok(proc: subprocess.Popen, url: str, timeout: float, *, poll_s: float, what: str,
                  log_tail) -> None:
    """Poll `url` until it answers 200; raise if `proc` exits first (with
    `log_tail()`) or `timeout` passes."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"{what} exited: {log_tail()}")
        try:
            if httpx.get(url, timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(poll_s)
    raise TimeoutError(f"{what} did not become ready: {log_tail()}")


@dataclass
class Sample:
    tier: str
    sent_at: float  # seconds since the phase began
    status: int  # HTTP status; 0 for a transport error
    ttft: float | None = None
    latency: float | None = None
    completion_tokens: int = 0
    error: str | None = None  # what broke it: a transport error (status 0), an error event, a status not 200 or 429


@dataclass(frozen=True)
class Stream:
    """One class of traffic: a tier, its keys, and its arrival rate.
    `arrival_seed` draws its arrival times on their own (its keys and
    prompts still come from the phase's seed), so two phases can send it at
    the same times with different prompts."""

    tier: str
    keys: list[str]
    rate_per_s: float
    arrival_seed: int | None = None


def make_prompt(rng: random.Random, num_tokens: int) -> list[int]:
    # Ordinary-token ids from the middle of the vocabulary: no special
    # tokens, and no two prompts share a cached prefix.
    return [rng.randrange(1000, 40000) for _ in range(num_tokens)]


async def one_request(client: httpx.AsyncClient, key: str, model: str, prompt: list[int],
                      output_tokens: int, tier: str, t0: float) -> Sample:
    sent = time.perf_counter()
    sample = Sample(tier=tier, sent_at=sent - t0, status=0)
    body = {"model": model, "prompt": prompt, "max_tokens": output_tokens, "min_tokens": output_tokens,
            "temperature": 0.0, "stream": True, "stream_options": {"include_usage": True}}
    try:
        async with client.stream("POST", "/v1/completions", json=body,
                                 headers={"Authorization": f"Bearer {key}"}) as r:
            sample.status = r.status_code
            if r.status_code != 200:
                body = await r.aread()
                if r.status_code != 429:  # a 429 is an answer the benchmarks count, not a failure
                    sample.error = f"HTTP {r.status_code}: {body[:300].decode(errors='replace')}"
                return sample
            async for line in r.aiter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                chunk = json.loads(line[6:])
                if "error" in chunk:
                    sample.status, sample.error = 500, str(chunk["error"])[:300]
                    return sample
                if chunk.get("choices") and sample.ttft is None:
                    sample.ttft = time.perf_counter() - sent
                if chunk.get("usage"):
                    sample.completion_tokens = chunk["usage"]["completion_tokens"]
        sample.latency = time.perf_counter() - sent
    except httpx.HTTPError as exc:
        sample.status, sample.error = 0, f"{type(exc).__name__}: {exc}"[:300]
    return sample


def plan_arrivals(stream: Stream, stream_rng: random.Random, *, duration_s: float,
                  prompt_tokens: int) -> list[tuple[float, str, list[int]]]:
    """One stream's Poisson arrivals in `duration_s`: (seconds from the
    phase's start, key, prompt) each. Times come from `stream.arrival_seed`
    where it is set, else from `stream_rng` with the keys and prompts."""
    times = random.Random(stream.arrival_seed) if stream.arrival_seed is not None else stream_rng
    plan = []
    at = times.expovariate(stream.rate_per_s)
    while at < duration_s:
        plan.append((at, stream_rng.choice(stream.keys), make_prompt(stream_rng, prompt_tokens)))
        at += times.expovariate(stream.rate_per_s)
    return plan


async def open_loop(base_url: str, model: str, streams: list[Stream], *, duration_s: float,
                    prompt_tokens: int, output_tokens: int, seed: int, grace_s: float) -> list[Sample]:
    """Send every stream's Poisson arrivals for `duration_s`, then give the
    requests still open `grace_s` to end; the rest are cancelled (the client
    disconnects, so the gateway aborts them) and come back with status -1."""
    rng = random.Random(seed)
    plans = [(s, plan_arrivals(s, random.Random(rng.random()), duration_s=duration_s, prompt_tokens=prompt_tokens))
             for s in streams]
    limits = httpx.Limits(max_connections=4096, max_keepalive_connections=256)
    async with httpx.AsyncClient(base_url=base_url, timeout=httpx.Timeout(600.0), limits=limits) as client:
        t0 = time.perf_counter()
        tasks: list[asyncio.Task] = []

        async def arrivals(stream: Stream, plan: list[tuple[float, str, list[int]]]) -> None:
            for at, key, prompt in plan:
                delay = t0 + at - time.perf_counter()
                if delay > 0:
                    await asyncio.sleep(delay)
                task = asyncio.create_task(one_request(client, key, model, prompt, output_tokens, stream.tier, t0))
                task.tier, task.sent_at = stream.tier, at  # for a request cancelled before it answers
                tasks.append(task)

        await asyncio.gather(*(arrivals(stream, plan) for stream, plan in plans))
        done, pending = await asyncio.wait(tasks, timeout=grace_s) if tasks else (set(), set())
        for task in pending:
            task.cancel()
        await asyncio.gather(*pending, return_exceptions=True)
        return [_result_or_cancelled(t) for t in tasks]


def _result_or_cancelled(task: asyncio.Task) -> Sample:
    return task.result() if not task.cancelled() else Sample(tier=task.tier, sent_at=task.sent_at, status=-1)


async def closed_loop(base_url: str, model: str, key: str, *, concurrency: int, duration_s: float,
                      prompt_tokens: int, output_tokens: int, seed: int) -> list[Sample]:
    """`concurrency` clients each sending back to back: the engine's capacity."""
    rng = random.Random(seed)
    limits = httpx.Limits(max_connections=concurrency + 8)
    async with httpx.AsyncClient(base_url=base_url, timeout=httpx.Timeout(600.0), limits=limits) as client:
        t0 = time.perf_counter()
        samples: list[Sample] = []

        async def worker() -> None:
            while time.perf_counter() - t0 < duration_s:
                samples.append(await one_request(client, key, model, make_prompt(rng, prompt_tokens),
                                                 output_tokens, "capacity", t0))

        await asyncio.gather(*(worker() for _ in range(concurrency)))
        return samples
