"""The spool: records survive a database outage and land once it is back,
exactly once, also when the flusher dies between insert and delete."""

from __future__ import annotations

import asyncio
import os
import sqlite3
import stat

import pytest

from billing.ledger import Ledger
from billing.records import REQUEST, UsageRecord
from billing.spool import Spool, SpoolFlusher
from gateway.store.sql import create_engine

pytestmark = pytest.mark.anyio


def rec(i: int) -> UsageRecord:
    return UsageRecord(request_id=f"r{i}", kind=REQUEST, tenant_id="t", tenant="acme", tier="standard",
                       ended_at_us=i, gpu_us=10 * i, completion_tokens=i)


async def test_outage_piles_up_in_the_spool_and_lands_when_the_database_returns(db_url, tmp_path):
    spool = Spool(tmp_path / "spool.db")
    dead = create_engine(f"sqlite+aiosqlite:///{tmp_path / 'missing' / 'dir' / 'x.db'}")
    flusher = SpoolFlusher(spool, Ledger(dead), interval_s=0.01, max_backoff_s=0.05)
    await flusher.start()
    for i in range(20):
        spool.append([rec(i)])
        flusher.wake()
    # The first attempt's failure can take a while on a busy machine: wait
    # for it rather than for a fixed time (a 0.3 s sleep lost that race).
    for _ in range(1000):
        if flusher.failures > 0:
            break
        await asyncio.sleep(0.01)
    assert len(spool) == 20 and flusher.failures > 0  # the database is away: nothing lost
    good = create_engine(db_url)
    flusher.ledger = Ledger(good)  # it is back
    for _ in range(200):
        if len(spool) == 0:
            break
        await asyncio.sleep(0.02)
    await flusher.stop()
    assert [r.request_id for r in await Ledger(good).records()] == [f"r{i}" for i in range(20)]
    await good.dispose()
    await dead.dispose()


async def test_a_crash_between_insert_and_delete_replays_without_double_counting(db_url, tmp_path):
    engine = create_engine(db_url)
    ledger = Ledger(engine)
    spool = Spool(tmp_path / "spool.db")
    spool.append([rec(i) for i in range(5)])
    await ledger.append(spool.pending())  # landed, but the process died before removing them
    spool.close()
    spool = Spool(tmp_path / "spool.db")  # restart
    spool.append([rec(1)])  # spooling a record twice keeps one
    assert len(spool) == 5
    await SpoolFlusher(spool, ledger).flush()
    assert len(spool) == 0
    records = await ledger.records()
    assert [r.request_id for r in records] == [f"r{i}" for i in range(5)]
    assert sum(r.gpu_us for r in records) == 100
    await engine.dispose()


async def test_on_moved_sees_each_batch_once_after_the_ledger_has_it(db_url, tmp_path):
    spool = Spool(tmp_path / "spool.db")
    dead = create_engine(f"sqlite+aiosqlite:///{tmp_path / 'missing' / 'dir' / 'x.db'}")
    moved = []
    flusher = SpoolFlusher(spool, Ledger(dead), on_moved=moved.append, batch=3)
    spool.append([rec(i) for i in range(5)])
    with pytest.raises(Exception):
        await flusher.flush()
    assert moved == [] and len(spool) == 5  # not in the ledger: not counted
    good = create_engine(db_url)
    flusher.ledger = Ledger(good)

    def broken(records):
        moved.append(records)
        raise RuntimeError("a metrics bug")

    flusher.on_moved = broken
    assert await flusher.flush() == 5  # a failing callback costs a count, not the flush
    assert [[r.request_id for r in batch] for batch in moved] == [["r0", "r1", "r2"], ["r3", "r4"]]
    assert await flusher.flush() == 0 and len(moved) == 2
    assert len(await Ledger(good).records()) == 5
    await good.dispose()
    await dead.dispose()


def _mode(path) -> int:
    return stat.S_IMODE(os.stat(path).st_mode)


@pytest.fixture
def permissive_umask():
    old = os.umask(0o022)  # the usual default: new files 0644, world-readable
    yield
    os.umask(old)


def test_spool_file_is_created_owner_only(tmp_path, permissive_umask):
    spool = Spool(tmp_path / "data" / "usage-spool.db")
    spool.append([rec(1)])
    files = sorted(p.name for p in (tmp_path / "data").iterdir())
    assert files == ["usage-spool.db", "usage-spool.db-shm", "usage-spool.db-wal"]  # WAL mode, open
    assert {name: _mode(tmp_path / "data" / name) for name in files} == dict.fromkeys(files, 0o600)
    spool.close()


def test_a_world_readable_spool_left_by_an_older_version_is_tightened(tmp_path, permissive_umask):
    sqlite3.connect(tmp_path / "usage-spool.db").close()
    assert _mode(tmp_path / "usage-spool.db") == 0o644
    Spool(tmp_path / "usage-spool.db").close()
    assert _mode(tmp_path / "usage-spool.db") == 0o600
