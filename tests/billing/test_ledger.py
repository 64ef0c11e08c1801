"""The ledger on SQLite and PostgreSQL: idempotent appends, totals derived
from records, and priced exports (CSV and JSONL) that match the records."""

from __future__ import annotations

import csv
import io
import json
from decimal import Decimal

import pytest

from billing.export import usage_rows, write
from billing.ledger import Ledger
from billing.pricing import PriceBook
from billing.records import RECOMPUTE, REQUEST, UsageRecord
from gateway.metering import recompute_record_id
from gateway.store.sql import create_engine

pytestmark = pytest.mark.anyio
DAY = 86_400_000_000
PRICES = PriceBook.parse(["premium:2,1,3", "standard:1,0.5,1"])


def record(request_id, tenant, tier, day, **kw):
    return UsageRecord(request_id=request_id, kind=REQUEST, tenant_id=f"id-{tenant}", tenant=tenant, tier=tier,
                       ended_at_us=day * DAY + 1000, **kw)


RECORDS = [
    record("a1", "gold", "premium", 0, prompt_tokens=1000, completion_tokens=2000, gpu_us=1_500_000),
    record("a2", "gold", "premium", 0, prompt_tokens=500, cached_prompt_tokens=500, gpu_us=500_000),
    record("b1", "silver", "standard", 0, prompt_tokens=2000, completion_tokens=1000, gpu_us=3_000_000),
    record("b2", "silver", "standard", 1, completion_tokens=10, gpu_us=7),
]


@pytest.fixture
async def ledger(db_url):
    engine = create_engine(db_url)
    yield Ledger(engine)
    await engine.dispose()


async def test_appending_the_same_request_twice_is_a_no_op(ledger):
    await ledger.append(RECORDS[:2])
    await ledger.append(RECORDS)  # a replay overlapping what landed
    await ledger.append([record("a1", "gold", "premium", 5, gpu_us=99)])
    assert await ledger.records() == RECORDS


async def test_daily_totals_and_prices_per_tier(ledger):
    await ledger.append(RECORDS)
    rows = await usage_rows(ledger, PRICES, group_by="day")
    gold, silver, silver_next = rows
    assert (gold["tenant"], gold["requests"], gold["gpu_us"], gold["gpu_seconds"]) == ("gold", 2, 2_000_000, "2")
    # premium: 2 s x 2 + 1k uncached prompt x 1 + 2k completion x 3
    assert Decimal(gold["cost"]) == Decimal(4 + 1 + 6)
    assert Decimal(silver["cost"]) == Decimal(3 + 1 + 1)
    assert silver_next["period_start"].startswith("1970-01-02")
    assert await usage_rows(ledger, PRICES, group_by="day", tenant="gold", since_us=DAY) == []


async def test_csv_and_jsonl_exports_match_the_ledger(ledger):
    await ledger.append(RECORDS)
    rows = await usage_rows(ledger, PRICES)
    jsonl, text = io.StringIO(), io.StringIO()
    write(rows, "jsonl", jsonl)
    write(rows, "csv", text)
    from_jsonl = [json.loads(line) for line in jsonl.getvalue().splitlines()]
    from_csv = list(csv.DictReader(io.StringIO(text.getvalue())))
    assert [r["request_id"] for r in from_jsonl] == [r["request_id"] for r in from_csv] == ["a1", "a2", "b1", "b2"]
    for rec, j, c in zip(RECORDS, from_jsonl, from_csv):
        assert j["gpu_us"] == rec.gpu_us == int(c["gpu_us"])
        assert j["completion_tokens"] == rec.completion_tokens == int(c["completion_tokens"])
        assert j["cost"] == c["cost"]
    assert Decimal(from_jsonl[0]["cost"]) == Decimal(3 + 1 + 6)  # premium prices on a premium record
    assert Decimal(from_jsonl[3]["cost"]) == Decimal("0.010007")  # standard: 7 us + 10 completion tokens


async def test_a_recompute_between_the_longest_request_ids_fits_the_ledger(ledger):
    # Engine request ids are the client's X-Request-Id (up to 128 characters), '-' and a random suffix.
    victim, payer = "v" * 128 + "-" + "a" * 32, "p" * 128 + "-" + "b" * 32
    charge_id = recompute_record_id(victim, payer)
    charge = UsageRecord(request_id=charge_id, kind=RECOMPUTE, tenant_id="id-gold", tenant="gold", tier="premium",
                         ended_at_us=DAY, recompute_us=5, caused_by=payer)
    await ledger.append([charge])  # PostgreSQL refuses a key longer than the column
    assert await ledger.records() == [charge]
    assert recompute_record_id(victim, payer) == charge_id  # a replay keeps its key
    assert recompute_record_id("v1", "p1") == "v1/recompute/p1" and recompute_record_id("v1", None) == \
        "v1/recompute/platform"
