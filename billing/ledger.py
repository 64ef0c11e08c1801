"""The ledger: append-only usage records in SQL, and totals derived from them.

`append` is idempotent: a record whose `request_id` is already there is
skipped (INSERT ... ON CONFLICT DO NOTHING on SQLite and PostgreSQL alike),
so replaying the spool never double-counts. Totals per tenant per hour or
day are GROUP BY queries over the records; no counter is kept anywhere else.
"""

from __future__ import annotations

from dataclasses import dataclass

from sqlalchemy import case, func, select, tuple_
from sqlalchemy.dialects import postgresql, sqlite
from sqlalchemy.ext.asyncio import AsyncEngine

from billing.models import UsageRecordRow
from billing.records import REQUEST, UsageRecord

PERIOD_US = {"hour": 3_600_000_000, "day": 86_400_000_000}
_COLUMNS = [c.name for c in UsageRecordRow.__table__.columns]


@dataclass(frozen=True)
class UsageTotals:
    """One tenant's usage over one period (at one tier). A name may be
    reused after its tenant was deleted: the id tells the two apart."""

    tenant_id: str
    tenant: str
    tier: str
    period_start_us: int
    requests: int
    prompt_tokens: int
    cached_prompt_tokens: int
    completion_tokens: int
    gpu_us: int
    recompute_us: int
    adapter_load_us: int

    @property
    def charged_us(self) -> int:
        return self.gpu_us + self.recompute_us + self.adapter_load_us


class Ledger:
    def __init__(self, engine: AsyncEngine):
        self.engine = engine

    async def append(self, records: list[UsageRecord]) -> None:
        """Insert the records in one transaction; ids already present are skipped."""
        if not records:
            return
        insert = postgresql.insert if self.engine.dialect.name == "postgresql" else sqlite.insert
        stmt = insert(UsageRecordRow).on_conflict_do_nothing(index_elements=["request_id"])
        async with self.engine.begin() as conn:
            await conn.execute(stmt, [r.to_dict() for r in records])

    async def records(self, *, since_us: int | None = None, until_us: int | None = None,
                      tenant: str | None = None, after: tuple | None = None,
                      limit: int | None = None) -> list[UsageRecord]:
        """Records that ended in [since, until), oldest first; at most `limit`
        of them, those whose `record_key` sorts after `after`."""
        t = UsageRecordRow
        key = (t.ended_at_us, t.request_id)
        stmt = _page(_where(select(t.__table__), since_us, until_us, tenant), key, after, limit)
        async with self.engine.connect() as conn:
            rows = (await conn.execute(stmt)).all()
        return [UsageRecord(**dict(zip(_COLUMNS, row))) for row in rows]

    async def totals(self, *, group_by: str = "day", since_us: int | None = None, until_us: int | None = None,
                     tenant: str | None = None, after: tuple | None = None,
                     limit: int | None = None) -> list[UsageTotals]:
        """Per tenant, tier and hour or day (UTC), from the records; at most
        `limit` of them, those whose `totals_key` sorts after `after`."""
        t = UsageRecordRow
        period = (t.ended_at_us // PERIOD_US[group_by]) * PERIOD_US[group_by]
        stmt = select(
            t.tenant_id, t.tenant, t.tier, period.label("period"),
            func.sum(case((t.kind == REQUEST, 1), else_=0)),
            func.sum(t.prompt_tokens), func.sum(t.cached_prompt_tokens), func.sum(t.completion_tokens),
            func.sum(t.gpu_us), func.sum(t.recompute_us), func.sum(t.adapter_load_us),
        ).group_by(t.tenant_id, t.tenant, t.tier, period)
        # The group's key is a function of each of its records, so the page's
        # bound is a WHERE on records, not a HAVING on sums.
        stmt = _where(stmt, since_us, until_us, tenant)
        # The key's period cannot use the time index; this bound, which holds
        # for SQL's truncating division of either sign, lets each page read
        # only from the cursor's period on (none is needed below BIGINT's range).
        lowest = None if after is None else after[0] - PERIOD_US[group_by]
        if lowest is not None and lowest >= -2**63:
            stmt = stmt.where(t.ended_at_us > lowest)
        stmt = _page(stmt, (period, t.tenant, t.tenant_id, t.tier), after, limit)
        async with self.engine.connect() as conn:
            rows = (await conn.execute(stmt)).all()
        return [UsageTotals(tenant_id, tenant, tier, int(start), *(int(v or 0) for v in sums))
                for tenant_id, tenant, tier, start, *sums in rows]


def record_key(r: UsageRecord) -> tuple[int, str]:
    """Where a record sorts in `Ledger.records`: its rows are unique by it."""
    return r.ended_at_us, r.request_id


def totals_key(t: UsageTotals) -> tuple[int, str, str, str]:
    """Where a total sorts in `Ledger.totals`: its rows are unique by it."""
    return t.period_start_us, t.tenant, t.tenant_id, t.tier


def _page(stmt, key: tuple, after: tuple | None, limit: int | None):
    """Keyset paging: each page starts past the last row of the one before.
    Rows that were there all along come once each, whatever is appended
    between pages; an OFFSET would repeat or skip some of them."""
    if after is not None:  # a plain tuple: each value takes its column's type (BIGINT), not one of its own
        stmt = stmt.where(tuple_(*key) > tuple(after))
    stmt = stmt.order_by(*key)
    return stmt if limit is None else stmt.limit(limit)


def _where(stmt, since_us, until_us, tenant):
    t = UsageRecordRow
    if since_us is not None:
        stmt = stmt.where(t.ended_at_us >= since_us)
    if until_us is not None:
        stmt = stmt.where(t.ended_at_us < until_us)
    if tenant is not None:
        stmt = stmt.where(t.tenant == tenant)
    return stmt
