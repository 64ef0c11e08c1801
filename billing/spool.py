"""The spool: a durable local outbox between request end and the ledger.

A record is committed to a SQLite file (synchronous=FULL, so it survives a
crash of the process, and of the machine once fsync returns) when its
request is settled. `SpoolFlusher` moves records to the ledger in batches:
insert (idempotent), then delete from the spool. A crash between the two
replays the batch on the next start; the ledger skips what it has, so
nothing is lost and nothing is counted twice. While the database is down
records pile up here and the flusher retries with exponential backoff.
"""

from __future__ import annotations

import asyncio
import json
import logging
import sqlite3
import threading
from pathlib import Path
from typing import Awaitable, Callable

from billing.ledger import Ledger
from billing.records import UsageRecord
from billing.sqlite_file import create_private_sqlite_file

log = logging.getLogger(__name__)

Resolver = Callable[[list[UsageRecord]], Awaitable[list[UsageRecord]]]


class Spool:
    def __init__(self, path: Path):
        path.parent.mkdir(parents=True, exist_ok=True)
        create_private_sqlite_file(path)  # usage records name tenants: owner-only (0600)
        self.path = path
        self._lock = threading.Lock()
        self._db = sqlite3.connect(path, check_same_thread=False, isolation_level=None)
        self._db.execute("PRAGMA journal_mode=WAL")
        self._db.execute("PRAGMA synchronous=FULL")
        self._db.execute("CREATE TABLE IF NOT EXISTS outbox (seq INTEGER PRIMARY KEY AUTOINCREMENT, "
                         "request_id TEXT NOT NULL UNIQUE, payload TEXT NOT NULL)")

    def append(self, records: list[UsageRecord]) -> None:
        """Durable when it returns. A request id already spooled is kept as it was."""
        rows = [(r.request_id, json.dumps(r.to_dict())) for r in records]
        with self._lock, self._db:
            self._db.executemany("INSERT OR IGNORE INTO outbox (request_id, payload) VALUES (?, ?)", rows)

    def pending(self, limit: int = 500) -> list[UsageRecord]:
        with self._lock:
            rows = self._db.execute("SELECT payload FROM outbox ORDER BY seq LIMIT ?", (limit,)).fetchall()
        return [UsageRecord.from_dict(json.loads(p)) for (p,) in rows]

    def remove(self, request_ids: list[str]) -> None:
        with self._lock, self._db:
            self._db.executemany("DELETE FROM outbox WHERE request_id = ?", [(i,) for i in request_ids])

    def __len__(self) -> int:
        with self._lock:
            return self._db.execute("SELECT count(*) FROM outbox").fetchone()[0]

    def close(self) -> None:
        with self._lock:
            self._db.close()


async def _unchanged(records: list[UsageRecord]) -> list[UsageRecord]:
    return records


class SpoolFlusher:
    """Moves spooled records to the ledger on the event loop: at start (the
    replay), when woken, every `interval_s`, and once more at stop."""

    def __init__(self, spool: Spool, ledger: Ledger, *, resolve: Resolver = _unchanged,
                 on_moved: Callable[[list[UsageRecord]], None] | None = None,
                 interval_s: float = 1.0, max_backoff_s: float = 30.0, batch: int = 500):
        self.spool, self.ledger, self.resolve = spool, ledger, resolve
        self.on_moved = on_moved  # called with each batch, as resolved, once it is in the ledger
        self.interval_s, self.max_backoff_s, self.batch = interval_s, max_backoff_s, batch
        self._wake = asyncio.Event()
        self._task: asyncio.Task | None = None
        self.failures = 0  # consecutive failed flushes

    async def flush(self) -> int:
        """Move everything spooled now; raises if the database fails."""
        moved = 0
        while batch := self.spool.pending(self.batch):
            resolved = await self.resolve(batch)
            await self.ledger.append(resolved)
            self.spool.remove([r.request_id for r in batch])
            if self.on_moved is not None:
                try:
                    self.on_moved(resolved)
                except Exception:  # noqa: BLE001 - the records are in the ledger; only a count is lost
                    log.exception("usage spool: on_moved failed for %d records", len(resolved))
            moved += len(batch)
        return moved

    def wake(self) -> None:
        self._wake.set()

    async def start(self) -> None:
        self._wake = asyncio.Event()
        self._task = asyncio.create_task(self._run(), name="usage-spool-flusher")

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)
            self._task = None
        try:
            await self.flush()
        except Exception:  # noqa: BLE001 - what is left stays in the spool for the next start
            log.warning("usage spool: %d records left for the next start", len(self.spool), exc_info=True)

    async def _run(self) -> None:
        self._wake.set()  # the replay: whatever the last run left
        while True:
            try:
                await asyncio.wait_for(self._wake.wait(), timeout=self.interval_s)
            except asyncio.TimeoutError:
                pass
            self._wake.clear()
            try:
                await self.flush()
                self.failures = 0
            except Exception as exc:  # noqa: BLE001 - the database may be down; retry later
                self.failures += 1
                delay = min(self.max_backoff_s, 0.25 * 2 ** min(self.failures, 16))
                log.warning("usage spool: flush failed (%s); %d records waiting, retry in %.2fs",
                            exc, len(self.spool), delay)
                await asyncio.sleep(delay)
