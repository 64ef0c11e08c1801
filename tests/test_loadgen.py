"""The benchmarks' open-loop schedule (benchmarks/loadgen.py): a stream
with its own arrival seed comes at the same times in two phases, with other
prompts, which is what lets tiers.py compare premium TTFT with and without
the standard flood on the same arrivals. And a failed request keeps what
broke it, for the benchmark's report."""

from __future__ import annotations

import asyncio
import random
import sys
import time
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))

from loadgen import Sample, Stream, one_request, plan_arrivals  # noqa: E402


def _plan(stream: Stream, phase_seed: int) -> list[tuple[float, str, list[int]]]:
    return plan_arrivals(stream, random.Random(phase_seed), duration_s=60.0, prompt_tokens=16)


def test_an_arrival_seed_gives_two_phases_the_same_times_and_other_prompts():
    premium = Stream("premium", ["k1", "k2"], 2.0, arrival_seed=7)
    idle, over = _plan(premium, 2), _plan(premium, 3)
    assert len(idle) > 60 and [a for a, _, _ in idle] == [a for a, _, _ in over]
    assert not {tuple(p) for _, _, p in idle} & {tuple(p) for _, _, p in over}  # no prefix hits across phases
    assert all(0 < a < 60 for a, _, _ in idle) and [a for a, _, _ in idle] == sorted(a for a, _, _ in idle)


def test_without_an_arrival_seed_the_times_follow_the_phase():
    stream = Stream("standard", ["k"], 2.0)
    a, b = _plan(stream, 2), _plan(stream, 3)
    assert [t for t, _, _ in a] != [t for t, _, _ in b]
    assert _plan(stream, 2) == a  # and a phase's seed repeats it


class _CutStream(httpx.AsyncByteStream):
    """A stream that breaks after its first token, as a connection the server closes."""

    async def __aiter__(self):
        yield b'data: {"choices": [{"index": 0, "text": "a"}]}\n\n'
        raise httpx.RemoteProtocolError("peer closed connection without sending complete message body")


def _one(handler) -> Sample:
    async def run():
        async with httpx.AsyncClient(transport=httpx.MockTransport(handler), base_url="http://gw") as client:
            return await one_request(client, "k", "m", [1, 2], 4, "premium", time.perf_counter())
    return asyncio.run(run())


def test_a_stream_cut_after_its_first_token_is_counted_with_what_broke_it():
    sample = _one(lambda request: httpx.Response(200, stream=_CutStream()))
    assert sample.status == 0 and sample.ttft is not None and sample.latency is None
    assert sample.error == "RemoteProtocolError: peer closed connection without sending complete message body"


def test_an_error_event_is_counted_with_its_message():
    body = b'data: {"error": {"message": "engine failed", "type": "server_error"}}\n\n'
    sample = _one(lambda request: httpx.Response(200, content=body))
    assert sample.status == 500 and "engine failed" in sample.error
    assert _one(lambda request: httpx.Response(429, json={})).error is None  # told to come back: not a failure
    refused = _one(lambda request: httpx.Response(503, json={"error": {"message": "not ready"}}))
    assert refused.status == 503 and refused.error.startswith("HTTP 503: ") and "not ready" in refused.error
