"""The closed-loop streaming client of benchmarks/serve_peer.py, for any
OpenAI-style /v1/completions server.

Unlike loadgen.py's client it retries: llama-server closes some keep-alive
connections just as the next request goes out on them, and loragw's
admission answers 429 with Retry-After when a tier's queue is full. Either
way the request is sent again (a 429 after the wait it asks for) and marked
retried; only requests that stream to their end count as completed.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections import Counter
from dataclasses import dataclass, field
from typing import Callable

import httpx

MAX_ATTEMPTS = 20


@dataclass(frozen=True)
class Request:
    prompt: str
    max_tokens: int


@dataclass
class Outcome:
    completed: bool = False
    attempts: int = 0
    responses_429: int = 0
    limits_429: Counter = field(default_factory=Counter)  # the limit each 429 named
    transport_errors: int = 0
    status: int | None = None  # the last non-200, non-429 status, if that ended it
    ttft_s: float | None = None  # from the first attempt's send
    ttft_last_attempt_s: float | None = None
    finished_at: float | None = None  # perf_counter
    prompt_tokens: int = 0
    completion_tokens: int = 0


class _Retry(Exception):
    def __init__(self, wait_s: float):
        self.wait_s = wait_s


async def one_request(client: httpx.AsyncClient, body: dict, headers: dict) -> Outcome:
    out = Outcome()
    first_sent = time.perf_counter()
    while out.attempts < MAX_ATTEMPTS and not out.completed and out.status is None:
        out.attempts += 1
        try:
            await _attempt(client, body, headers, out, first_sent)
        except _Retry as retry:
            await asyncio.sleep(retry.wait_s)
        except httpx.TransportError:
            out.transport_errors += 1
            out.ttft_s = None  # tokens from a broken stream are not the answer's
    return out


async def _attempt(client, body: dict, headers: dict, out: Outcome, first_sent: float) -> None:
    sent = time.perf_counter()
    async with client.stream("POST", "/v1/completions", json=body, headers=headers) as r:
        if r.status_code == 429:
            out.responses_429 += 1
            out.limits_429[_error_code(await r.aread())] += 1
            raise _Retry(float(r.headers.get("Retry-After", "1")))
        if r.status_code != 200:
            await r.aread()
            out.status = r.status_code
            return
        async for line in r.aiter_lines():
            if not line.startswith("data: {"):
                continue
            chunk = json.loads(line[6:])
            if "error" in chunk:
                out.status = 500
                return
            if chunk.get("choices") and out.ttft_s is None:
                now = time.perf_counter()
                out.ttft_s, out.ttft_last_attempt_s = now - first_sent, now - sent
            if chunk.get("usage"):
                out.prompt_tokens = chunk["usage"]["prompt_tokens"]
                out.completion_tokens = chunk["usage"]["completion_tokens"]
    out.completed = True
    out.finished_at = time.perf_counter()


def _error_code(body: bytes) -> str:
    try:
        return str(json.loads(body)["error"].get("code"))
    except (ValueError, KeyError, TypeError, AttributeError):
        return "unknown"


@dataclass
class Run:
    outcomes: list[Outcome]
    started_at: float
    expected_tokens: int  # what the completed requests asked for


async def closed_loop(base_url: str, headers: dict, body_for: Callable[[Request], dict], requests: list[Request], *,
                      concurrency: int, duration_s: float) -> Run:
    """`concurrency` clients send requests[0], [1], ... back to back, each
    taking the next one when it is free, until `duration_s` has passed (the
    requests then in flight run to their end). duration_s 0: the whole list."""
    limits = httpx.Limits(max_connections=concurrency + 8)
    outcomes: list[Outcome] = []
    expected = 0
    pending = iter(requests)
    async with httpx.AsyncClient(base_url=base_url, timeout=httpx.Timeout(600.0), limits=limits) as client:
        t0 = time.perf_counter()

        async def worker() -> None:
            nonlocal expected
            while not duration_s or time.perf_counter() - t0 < duration_s:
                request = next(pending, None)
                if request is None:
                    return
                outcome = await one_request(client, body_for(request), headers)
                outcomes.append(outcome)
                expected += request.max_tokens if outcome.completed else 0

        await asyncio.gather(*(worker() for _ in range(concurrency)))
    return Run(outcomes, t0, expected)


async def probe_latency(base_url: str, path: str, stop: asyncio.Event, interval_s: float = 0.1) -> list[float]:
    """Seconds each GET of `path` took, one every `interval_s` until `stop`,
    on a connection of its own: how long the server's event loop keeps a
    trivial request waiting while it serves the load."""
    latencies = []
    async with httpx.AsyncClient(base_url=base_url, timeout=httpx.Timeout(60.0)) as client:
        while not stop.is_set():
            t0 = time.perf_counter()
            try:
                await client.get(path)
            except httpx.TransportError:
                continue
            latencies.append(time.perf_counter() - t0)
            try:
                await asyncio.wait_for(stop.wait(), interval_s)
            except asyncio.TimeoutError:
                pass
    return latencies


def latency_summary(latencies: list[float]) -> dict:
    ordered = sorted(latencies)
    return {"probes": len(ordered), "p50_ms": _ms(_quantile(ordered, 0.5)), "p99_ms": _ms(_quantile(ordered, 0.99)),
            "max_ms": _ms(ordered[-1] if ordered else None)}


def _ms(seconds: float | None) -> float | None:
    return None if seconds is None else round(seconds * 1e3, 1)


def summarize(run: Run) -> dict:
    done = [o for o in run.outcomes if o.completed]
    tokens = sum(o.completion_tokens for o in done)
    wall = max((o.finished_at for o in done), default=run.started_at) - run.started_at
    ttfts = sorted(o.ttft_s for o in done if o.ttft_s is not None)
    return {"completed": len(done), "failed": len(run.outcomes) - len(done),
            "failed_statuses": sorted({o.status for o in run.outcomes if o.status is not None}),
            "retried": sum(o.attempts > 1 for o in done), "responses_429": sum(o.responses_429 for o in run.outcomes),
            "limits_429": dict(sum((o.limits_429 for o in run.outcomes), Counter())),
            "transport_errors": sum(o.transport_errors for o in run.outcomes),
            "output_tokens": tokens, "expected_output_tokens": run.expected_tokens,
            "prompt_tokens": sum(o.prompt_tokens for o in done), "wall_s": round(wall, 2),
            "output_tok_s": round(tokens / wall, 1) if wall > 0 else None,
            "ttft_p50_s": _quantile(ttfts, 0.5), "ttft_p99_s": _quantile(ttfts, 0.99)}


def _quantile(sorted_values: list[float], q: float) -> float | None:
    if not sorted_values:
        return None
    return round(sorted_values[min(len(sorted_values) - 1, int(q * len(sorted_values)))], 4)
