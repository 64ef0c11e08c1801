"""Crash safety: a real `loragw serve` is killed with SIGKILL in the middle
of a workload and restarted on the same data directory and database. Once
the spool has replayed, every request whose full response the client got
has exactly one ledger record with the response's token counts, nothing is
counted twice, and the totals equal what the responses add up to.

While the first process runs, the test holds SQLite's write lock on the
database, so the flusher cannot move anything: every record is still in the
spool when the process dies, and only the replay can deliver it. The other
case lets the flusher run, so the kill lands wherever it lands (a batch may
be in the ledger and still in the spool: the replay must skip it).

The kill is sent the moment a stream's last token chunk reaches the client:
its record must already be spooled, though its usage chunk and [DONE] may
not have been sent (tests/gateway/test_streaming.py pins that order)."""

from __future__ import annotations

import asyncio
import json
import os
import re
import signal
import sqlite3
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest

from billing.records import REQUEST
from gateway.tenancy import Tier
from tests.billing.live_helpers import ledger_records, request_id_of
from tests.gateway.live import seed_tenants
from tests.gateway.live import wait_for

TENANTS = {"gold": Tier.PREMIUM, "silver": Tier.STANDARD}
WORKERS = 6
KILL_AFTER = 8  # complete responses received before the kill
# (path, stream, n): completions and chat, streamed and not, one and two choices
SHAPES = [("/v1/completions", False, 1), ("/v1/completions", True, 2), ("/v1/chat/completions", True, 1),
          ("/v1/completions", False, 2), ("/v1/completions", True, 1), ("/v1/chat/completions", False, 2)]


@dataclass
class Outcome:
    tenant: str
    completion_tokens: int  # what the request asks for (min_tokens = max_tokens, times n)
    request_id: str | None = None  # the engine request id, once the client learned it
    final_chunk_seen: bool = False  # a stream: every choice's finish_reason arrived
    usage: dict | None = None  # set only when the client received the full response


class Served:
    """`loragw serve` on a port of the OS's choosing, logging to `log`."""

    def __init__(self, model_dir: Path, db_url: str, data_dir: Path, log: Path):
        env = {**os.environ, "LORAGW_DATA_DIR": str(data_dir)}
        cmd = [sys.executable, "-m", "gateway.cli", "serve", "--model", str(model_dir), "--db", db_url,
               "--port", "0", "--max-num-seqs", "8", "--max-loras", "0", "--log-level", "info"]
        self.log = log
        with open(log, "w") as out:
            self.proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, env=env)
        port = wait_for(self._port, 180, "the server to listen")
        self.url = f"http://127.0.0.1:{port}"
        wait_for(self._ready, 180, "/ready")

    def _port(self) -> str | None:
        assert self.proc.poll() is None, self.log.read_text()
        found = re.search(r"Uvicorn running on http://127\.0\.0\.1:(\d+)", self.log.read_text())
        return found and found[1]

    def _ready(self) -> bool:
        assert self.proc.poll() is None, self.log.read_text()
        try:
            return httpx.get(f"{self.url}/ready").status_code == 200
        except httpx.TransportError:
            return False

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait(timeout=60)


def _body(path: str, stream: bool, n: int, model: str, i: int) -> dict:
    tokens = 4 + (5 * i) % 21
    body = {"model": model, "max_tokens": tokens, "min_tokens": tokens, "n": n, "temperature": 1.0,
            "stream": stream}
    if stream:
        body["stream_options"] = {"include_usage": True}
    if path.endswith("chat/completions"):
        body["messages"] = [{"role": "user", "content": f"Tell story number {i}."}]
    else:
        body["prompt"] = f"Once upon a time, story {i} began" + " and then" * (i % 7)
    return body


async def _request(client: httpx.AsyncClient, key: str, outcome: Outcome, path: str, body: dict, *,
                   on_first_chunk=None, on_final_chunk=None) -> Outcome:
    """One request; a transport error (the server died) leaves `outcome.usage` None."""
    headers = {"Authorization": f"Bearer {key}"}
    try:
        if not body["stream"]:
            r = await client.post(path, json=body, headers=headers)
            if r.status_code == 200:
                outcome.request_id, outcome.usage = request_id_of(r.json()), r.json()["usage"]
            return outcome
        last, usage, finished = None, None, set()
        async with client.stream("POST", path, json=body, headers=headers) as r:
            async for line in r.aiter_lines():
                if not line.startswith("data: "):
                    continue
                last = line
                if line == "data: [DONE]":
                    continue
                chunk = json.loads(line[len("data: "):])
                if outcome.request_id is None:
                    outcome.request_id = request_id_of(chunk)
                    if on_first_chunk is not None:
                        on_first_chunk()
                usage = chunk.get("usage") or usage
                finished |= {c["index"] for c in chunk["choices"] if c.get("finish_reason")}
                if len(finished) == body.get("n", 1) and not outcome.final_chunk_seen:
                    outcome.final_chunk_seen = True
                    if on_final_chunk is not None:
                        on_final_chunk(outcome)
        if last == "data: [DONE]" and usage is not None:
            outcome.usage = usage
    except httpx.TransportError:
        pass
    return outcome


async def _workload(url: str, keys: dict[str, str], model: str, kill) -> tuple[list[Outcome], Outcome, Outcome]:
    """WORKERS clients send requests back to back until the server dies,
    while one long stream runs. `kill()` runs once KILL_AFTER responses are
    complete and the long stream is under way, the moment a stream's last
    token chunk arrives: before its usage chunk and [DONE] (the window in
    which a record reported only after the last bytes would be lost).
    Returns every outcome, the long stream's and the one that killed."""
    outcomes: list[Outcome] = []
    streaming = asyncio.Event()
    killer: list[Outcome] = []

    def maybe_kill(outcome: Outcome) -> None:
        if not killer and streaming.is_set() and sum(o.usage is not None for o in outcomes) >= KILL_AFTER:
            killer.append(outcome)
            kill()

    async def worker(w: int, client: httpx.AsyncClient) -> None:
        i = w
        while not killer:
            tenant = "gold" if i % 2 == 0 else "silver"
            path, stream, n = SHAPES[i % len(SHAPES)]
            body = _body(path, stream, n, model, i)
            outcome = Outcome(tenant, body["max_tokens"] * n)
            outcomes.append(await _request(client, keys[tenant], outcome, path, body, on_final_chunk=maybe_kill))
            if outcome.usage is None:
                return  # the server is gone
            i += WORKERS

    async with httpx.AsyncClient(base_url=url, timeout=120) as client:
        long_body = {"model": model, "prompt": "A long tale", "max_tokens": 2000, "min_tokens": 2000,
                     "stream": True, "stream_options": {"include_usage": True}}
        long_stream = asyncio.create_task(_request(client, keys["gold"], Outcome("gold", 2000), "/v1/completions",
                                                   long_body, on_first_chunk=streaming.set))
        await asyncio.gather(*(worker(w, client) for w in range(WORKERS)))
        return outcomes, await long_stream, killer[0]


def _spooled_ids(spool_path: Path) -> set[str]:
    with sqlite3.connect(spool_path) as db:
        return {request_id for (request_id,) in db.execute("SELECT request_id FROM outbox")}


@pytest.mark.parametrize("ledger_locked", [True, False], ids=["ledger-locked", "ledger-open"])
def test_sigkill_mid_workload_then_replay_bills_every_complete_response_once(tiny_llama_dir, tmp_path,
                                                                               ledger_locked):
    db_path, data_dir = tmp_path / "loragw.db", tmp_path / "data"
    db_url = f"sqlite+aiosqlite:///{db_path}"
    keys = seed_tenants(db_url, TENANTS)
    spool_path = data_dir / "usage-spool.db"

    first = Served(tiny_llama_dir, db_url, data_dir, tmp_path / "first.log")
    lock = None
    try:
        model = httpx.get(f"{first.url}/v1/models", headers={"Authorization": f"Bearer {keys['gold']}"}
                          ).json()["data"][0]["id"]
        if ledger_locked:  # the flusher's inserts now fail ("database is locked"); reads still work
            lock = sqlite3.connect(db_path, isolation_level=None)
            lock.execute("BEGIN IMMEDIATE")
        outcomes, long_stream, killer = asyncio.run(
            _workload(first.url, keys, model, kill=lambda: os.kill(first.proc.pid, signal.SIGKILL)))
    finally:
        first.kill()
        if lock is not None:
            lock.rollback()
            lock.close()

    complete = [o for o in outcomes if o.usage is not None]
    assert len(complete) >= KILL_AFTER
    assert {o.final_chunk_seen for o in complete} == {True, False}  # streamed and not
    assert long_stream.request_id is not None and long_stream.usage is None  # cut by the kill
    # Streams whose last token chunk arrived: the killer, maybe others; their
    # records were reported before that chunk was sent.
    final_seen = [o for o in outcomes if o.final_chunk_seen]
    assert killer in final_seen
    if ledger_locked:
        # Nothing reached the ledger: every record is in the spool, put there
        # before the client had the response's last bytes.
        assert not [r for r in ledger_records(db_url) if r.kind == REQUEST]
        assert {o.request_id for o in complete + final_seen} <= _spooled_ids(spool_path)

    second = Served(tiny_llama_dir, db_url, data_dir, tmp_path / "second.log")
    try:
        expected = {o.request_id for o in complete}
        wait_for(lambda: not _spooled_ids(spool_path) and expected <= {r.request_id for r in ledger_records(db_url)},
              120, "the spool's replay")
        second.proc.send_signal(signal.SIGTERM)
        assert second.proc.wait(timeout=120) == 0, second.log.read_text()
    finally:
        second.kill()

    records = ledger_records(db_url)
    ids = [r.request_id for r in records]
    assert len(ids) == len(set(ids))
    by_id = {r.request_id: r for r in records if r.kind == REQUEST}
    for o in complete:
        r = by_id[o.request_id]
        assert (r.tenant, r.prompt_tokens, r.completion_tokens) == (
            o.tenant, o.usage["prompt_tokens"], o.usage["completion_tokens"]), o
        assert r.finish_reason in ("stop", "length") and r.gpu_us > 0
        assert o.usage["completion_tokens"] == o.completion_tokens
    for o in final_seen:
        r = by_id[o.request_id]
        assert (r.completion_tokens, r.finish_reason) == (o.completion_tokens, "length"), o
    for tenant in TENANTS:
        mine = [o for o in complete if o.tenant == tenant]
        billed = [by_id[o.request_id] for o in mine]
        assert sum(r.prompt_tokens for r in billed) == sum(o.usage["prompt_tokens"] for o in mine)
        assert sum(r.completion_tokens for r in billed) == sum(o.usage["completion_tokens"] for o in mine)
    # A request the kill cut short may have its record (its end was reported
    # just before the process died) or not, but never two: the ids are unique.
