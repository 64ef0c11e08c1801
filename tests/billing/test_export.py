"""`loragw usage export` (CSV and JSONL, per record or per tenant per day,
a tenant filter, prices per tier) and `GET /admin/usage`, which answers the
same figures as JSON, on SQLite and PostgreSQL."""

from __future__ import annotations

import asyncio
import base64
import csv
import datetime as dt
import io
import json
from decimal import ROUND_HALF_EVEN, Decimal

import pytest

from billing.ledger import Ledger
from billing.records import ADAPTER_LOAD, OVERHEAD, RECOMPUTE, REQUEST, UsageRecord, to_us
from billing.pricing import PriceBook
from gateway.cli import main
from gateway.store.sql import create_engine
from gateway.tenancy import TenantLimits, Tier
from tests.gateway.admin_app import ADMIN, admin_client
from tests.gateway.live import run_with_store

PRICE_FLAGS = ["--price", "premium:2,1,3", "--price", "standard:1,0.5,1"]
PRICES = {"premium": (Decimal(2), Decimal(1), Decimal(3)), "standard": (Decimal(1), Decimal("0.5"), Decimal(1))}
DAY0 = dt.datetime(2026, 11, 1, tzinfo=dt.UTC)
RANGE = ["--since", "2026-11-01", "--until", "2026-11-03"]


def at(day: int, hour: int) -> int:
    return to_us(DAY0 + dt.timedelta(days=day, hours=hour))


def rec(request_id: str, kind: str, tenant: str, tier: str, ended_at_us: int, **kw) -> UsageRecord:
    return UsageRecord(request_id=request_id, kind=kind, tenant_id=f"id-{tenant}", tenant=tenant, tier=tier,
                       ended_at_us=ended_at_us, **kw)


RECORDS = [
    rec("g1", REQUEST, "gold", "premium", at(0, 10), key_id="k-gold", prompt_tokens=1000,
        cached_prompt_tokens=200, completion_tokens=500, gpu_us=1_500_000, finish_reason="stop",
        started_at_us=at(0, 10) - 2_000_000, queue_us=1000, ttft_us=50_000, e2e_us=2_000_000),
    rec("s1/recompute/g1", RECOMPUTE, "gold", "premium", at(0, 10), recompute_us=40_000, caused_by="g1"),
    rec("s1", REQUEST, "silver", "standard", at(0, 11), key_id="k-silver", prompt_tokens=2000,
        completion_tokens=1000, gpu_us=3_000_000, finish_reason="client_disconnect"),
    rec("adapter-load/1", ADAPTER_LOAD, "silver", "standard", at(0, 9), adapter="silver-lora", adapter_version=2,
        adapter_load_us=12_000),
    rec("overhead/1", OVERHEAD, "platform-overhead", "platform", at(0, 12), gpu_us=333),
    rec("g2", REQUEST, "gold", "premium", at(1, 8), adapter="gold-lora", adapter_version=1, prompt_tokens=300,
        completion_tokens=100, gpu_us=250_000, finish_reason="length"),
    rec("s2", REQUEST, "silver", "standard", at(1, 23), completion_tokens=10, gpu_us=7, finish_reason="abort"),
    rec("s3", REQUEST, "silver", "standard", at(2, 0), completion_tokens=99, gpu_us=99, finish_reason="stop"),
]
IN_RANGE = [r for r in RECORDS if r.ended_at_us < at(2, 0)]


def cost(tier: str, charged_us: int, prompt: int, cached: int, completion: int) -> str:
    """The price formula of docs/billing.md, by hand."""
    gpu_s, prompt_1k, completion_1k = PRICES.get(tier, (0, 0, 0))
    exact = (Decimal(charged_us) / 10**6 * gpu_s + Decimal(prompt - cached) / 1000 * prompt_1k
             + Decimal(completion) / 1000 * completion_1k)
    return str(exact.quantize(Decimal("0.000001"), rounding=ROUND_HALF_EVEN))


@pytest.fixture
def ledger_db(db_url):
    """The records in the ledger, and the tenants in the store (the API checks `?tenant=`)."""

    async def append():
        engine = create_engine(db_url)
        try:
            await Ledger(engine).append(RECORDS)
        finally:
            await engine.dispose()

    async def tenants(store):
        await store.create_tenant("gold", Tier.PREMIUM, TenantLimits())
        await store.create_tenant("silver", Tier.STANDARD, TenantLimits())

    asyncio.run(append())
    run_with_store(db_url, tenants)
    return db_url


@pytest.fixture
def export(ledger_db, capsys, monkeypatch):
    """export(*flags) -> stdout of `loragw usage export` on the ledger."""
    monkeypatch.delenv("LORAGW_PRICE", raising=False)

    def run(*flags: str) -> str:
        code = main(["usage", "export", "--db", ledger_db, *flags])
        out, err = capsys.readouterr()
        assert code == 0, err
        return out

    return run


def test_jsonl_rows_are_the_records_in_range_priced_per_tier(export):
    rows = [json.loads(line) for line in export(*RANGE, *PRICE_FLAGS, "--format", "jsonl").splitlines()]
    assert [r["request_id"] for r in rows] == [r.request_id for r in sorted(IN_RANGE, key=lambda r: r.ended_at_us)]
    for row in rows:
        r = next(r for r in RECORDS if r.request_id == row["request_id"])
        assert {k: row[k] for k in ("kind", "tenant", "tier", "key_id", "adapter", "adapter_version",
                                    "finish_reason", "prompt_tokens", "cached_prompt_tokens", "completion_tokens",
                                    "gpu_us", "recompute_us", "adapter_load_us", "queue_us", "ttft_us", "e2e_us",
                                    "caused_by")} == {
            "kind": r.kind, "tenant": r.tenant, "tier": r.tier, "key_id": r.key_id, "adapter": r.adapter,
            "adapter_version": r.adapter_version, "finish_reason": r.finish_reason,
            "prompt_tokens": r.prompt_tokens, "cached_prompt_tokens": r.cached_prompt_tokens,
            "completion_tokens": r.completion_tokens, "gpu_us": r.gpu_us, "recompute_us": r.recompute_us,
            "adapter_load_us": r.adapter_load_us, "queue_us": r.queue_us, "ttft_us": r.ttft_us,
            "e2e_us": r.e2e_us, "caused_by": r.caused_by}
        assert Decimal(row["gpu_seconds"]) * 10**6 == r.charged_us
        assert row["cost"] == cost(r.tier, r.charged_us, r.prompt_tokens, r.cached_prompt_tokens,
                                   r.completion_tokens)
        assert dt.datetime.fromisoformat(row["ended_at"]) == DAY0 + dt.timedelta(microseconds=r.ended_at_us - at(0, 0))
    g1 = next(row for row in rows if row["request_id"] == "g1")
    assert g1["cost"] == "5.300000"  # premium: 1.5 s x 2 + 0.8k uncached prompt x 1 + 0.5k completion x 3
    assert next(row for row in rows if row["request_id"] == "overhead/1")["cost"] == "0.000000"  # unpriced tier


def test_csv_totals_per_tenant_per_day_with_a_tenant_filter_to_a_file(export, tmp_path, monkeypatch):
    monkeypatch.setenv("LORAGW_PRICE", "premium:2,1,3 standard:1,0.5,1")  # prices from the environment
    out = tmp_path / "silver.csv"
    assert export(*RANGE, "--tenant", "silver", "--group-by", "day", "--format", "csv", "-o", str(out)) == ""
    rows = list(csv.DictReader(io.StringIO(out.read_text())))
    day0, day1 = rows
    assert (day0["tenant"], day0["tier"], day0["period_start"]) == ("silver", "standard", "2026-11-01T00:00:00+00:00")
    assert day1["period_start"] == "2026-11-02T00:00:00+00:00"
    # day 0: s1 and its adapter load; day 1: s2 (s3 ends at --until, which is exclusive)
    assert {k: int(day0[k]) for k in ("requests", "prompt_tokens", "completion_tokens", "gpu_us",
                                      "adapter_load_us")} == {
        "requests": 1, "prompt_tokens": 2000, "completion_tokens": 1000, "gpu_us": 3_000_000,
        "adapter_load_us": 12_000}
    assert day0["gpu_seconds"] == "3.012" and day0["cost"] == cost("standard", 3_012_000, 2000, 0, 1000) == "5.012000"
    assert (int(day1["requests"]), int(day1["gpu_us"]), day1["cost"]) == (1, 7, cost("standard", 7, 0, 0, 10))


def test_daily_totals_add_up_to_the_records(export):
    rows = [json.loads(line) for line in export(*RANGE, *PRICE_FLAGS, "--group-by", "day", "--format", "jsonl")
            .splitlines()]
    assert [(r["tenant"], r["period_start"][:10]) for r in rows] == [
        ("gold", "2026-11-01"), ("platform-overhead", "2026-11-01"), ("silver", "2026-11-01"),
        ("gold", "2026-11-02"), ("silver", "2026-11-02")]
    for field in ("prompt_tokens", "cached_prompt_tokens", "completion_tokens", "gpu_us", "recompute_us",
                  "adapter_load_us"):
        assert sum(r[field] for r in rows) == sum(getattr(r, field) for r in IN_RANGE)
    assert sum(r["requests"] for r in rows) == sum(r.kind == REQUEST for r in IN_RANGE)
    gold0 = rows[0]
    assert (gold0["requests"], gold0["recompute_us"], gold0["gpu_seconds"]) == (1, 40_000, "1.54")
    assert gold0["cost"] == cost("premium", 1_540_000, 1000, 200, 500) == "5.380000"


@pytest.mark.parametrize("flags, message", [
    (["--since", "yesterday", "--until", "2026-11-03"], "not an ISO date"),
    ([*RANGE, "--price", "premium:1,2"], "expected TIER:"),
    # Each of these once went through: NaN and negative costs in the export,
    # a traceback, a tier nobody is in, the second price silently winning.
    ([*RANGE, "--price", "premium:nan,0,0"], "'nan' is not a price from 0 to 1000000"),
    ([*RANGE, "--price", "premium:-1,0,0"], "'-1' is not a price"),
    ([*RANGE, "--price", "premium:1e999,0,0"], "'1e999' is not a price"),
    ([*RANGE, "--price", "premium:Infinity,0,0"], "'Infinity' is not a price"),
    ([*RANGE, "--price", "premium:one,0,0"], "'one' is not a number"),
    ([*RANGE, "--price", "gold:1,1,1"], "unknown tier 'gold' (tiers: premium, standard)"),
    ([*RANGE, "--price", "premium:1,1,1", "--price", "premium:2,2,2"], "tier 'premium' is priced twice"),
])
def test_bad_flags_are_one_error_line(ledger_db, capsys, flags, message):
    assert main(["usage", "export", "--db", ledger_db, *flags]) == 2
    out, err = capsys.readouterr()
    assert out == "" and err.startswith("error: ") and message in err and err.count("\n") == 1


def test_an_output_file_that_cannot_be_written_is_one_error_line(ledger_db, tmp_path, capsys):
    assert main(["usage", "export", "--db", ledger_db, *RANGE, "-o", str(tmp_path / "missing" / "x.csv")]) == 1
    out, err = capsys.readouterr()  # it was a traceback
    assert out == "" and err.startswith("error: ") and "No such file or directory" in err and err.count("\n") == 1


@pytest.fixture
def api(ledger_db):
    with admin_client(ledger_db, registry=None, prices=PriceBook.parse(PRICE_FLAGS[1::2])) as client:
        yield client


def test_admin_usage_needs_the_admin_token(api):
    assert api.get("/admin/usage").status_code == 401
    assert api.get("/admin/usage", headers={"Authorization": "Bearer not-it"}).status_code == 401


@pytest.mark.parametrize("query, flags", [
    ({}, []),
    ({"group_by": "day"}, ["--group-by", "day"]),
    ({"group_by": "hour", "tenant": "gold"}, ["--group-by", "hour", "--tenant", "gold"]),
    ({"tenant": "silver"}, ["--tenant", "silver"]),
])
def test_admin_usage_answers_what_the_export_writes(api, export, query, flags):
    response = api.get("/admin/usage", headers=ADMIN,
                       params={"since": "2026-11-01", "until": "2026-11-03", **query})
    assert response.status_code == 200, response.text
    body = response.json()
    assert body["object"] == "list" and body["data"]
    exported = [json.loads(line) for line in export(*RANGE, *PRICE_FLAGS, *flags, "--format", "jsonl").splitlines()]
    assert body["data"] == exported


def test_admin_usage_filters_by_the_name_records_were_made_under(api, ledger_db, export):
    """Not by a tenant that exists now: a deleted tenant's usage stays
    billable, platform overhead is there too, and a name with no records is
    an empty list, as the export answers (it was a 404). A name reused after
    its tenant was deleted holds both tenants' records, told apart by
    tenant_id, in the records and in the totals."""
    async def reuse_gold():
        engine = create_engine(ledger_db)
        try:
            await Ledger(engine).append([
                UsageRecord(request_id="g3", kind=REQUEST, tenant_id="id-gold-2", tenant="gold", tier="standard",
                            ended_at_us=at(1, 9), prompt_tokens=7, completion_tokens=3, gpu_us=10)])
        finally:
            await engine.dispose()

    asyncio.run(reuse_gold())
    dates = {"since": "2026-11-01", "until": "2026-11-03"}
    for name in ("nobody", "platform-overhead", "gold"):
        body = api.get("/admin/usage", headers=ADMIN, params={**dates, "tenant": name}).json()
        exported = [json.loads(line) for line in export(*RANGE, *PRICE_FLAGS, "--tenant", name, "--format",
                                                        "jsonl").splitlines()]
        assert body["data"] == exported
        assert [r["request_id"] for r in body["data"]] == [r.request_id for r in IN_RANGE if r.tenant == name] + (
            ["g3"] if name == "gold" else [])
    gold = api.get("/admin/usage", headers=ADMIN, params={**dates, "tenant": "gold"}).json()["data"]
    assert {r["request_id"]: r["tenant_id"] for r in gold} == {"g1": "id-gold", "s1/recompute/g1": "id-gold",
                                                               "g2": "id-gold", "g3": "id-gold-2"}
    days = api.get("/admin/usage", headers=ADMIN, params={**dates, "tenant": "gold", "group_by": "day"}).json()
    second_day = [(t["tenant_id"], t["tier"], t["requests"]) for t in days["data"] if t["period_start"] > "2026-11-02"]
    assert second_day == [("id-gold", "premium", 1), ("id-gold-2", "standard", 1)]


def test_admin_usage_refuses_bad_parameters(api):
    for query in ("group_by=week", "since=yesterday"):
        response = api.get(f"/admin/usage?{query}", headers=ADMIN)
        assert response.status_code == 400, response.text


def _pages(api, params: dict, limit: int) -> list[dict]:
    """Every page of /admin/usage at `limit` rows a page, each checked."""
    pages, cursor = [], None
    while True:
        response = api.get("/admin/usage", headers=ADMIN,
                           params={**params, "limit": limit, **({"cursor": cursor} if cursor else {})})
        assert response.status_code == 200, response.text
        page = response.json()
        assert page["has_more"] == (page["next_cursor"] is not None)
        assert len(page["data"]) == limit if page["has_more"] else len(page["data"]) <= limit
        pages.append(page)
        if not page["has_more"]:
            return pages
        cursor = page["next_cursor"]
        assert len(pages) < 100, "the cursor does not move"


@pytest.mark.parametrize("query", [{}, {"group_by": "day"}, {"group_by": "hour"}, {"tenant": "silver"},
                                   {"group_by": "day", "tenant": "gold"}])
@pytest.mark.parametrize("limit", [1, 2, 3, 5, 100])
def test_admin_usage_pages_are_the_export_in_order(api, export, query, limit):
    """The pages, one after another, are what the export writes unpaged:
    each row once, in its order, whatever the page size."""
    params = {"since": "2026-11-01", "until": "2026-11-03", **query}
    flags = [*RANGE, *PRICE_FLAGS, "--format", "jsonl", *(["--group-by", query["group_by"]] if "group_by" in query
                                                           else []), *(["--tenant", query["tenant"]] if "tenant" in
                                                                       query else [])]
    exported = [json.loads(line) for line in export(*flags).splitlines()]
    pages = _pages(api, params, limit)
    assert [row for page in pages for row in page["data"]] == exported
    assert len(pages) == max(1, -(-len(exported) // limit))  # a full last page says so: no empty page after it


def test_admin_usage_paging_holds_while_records_arrive(api, ledger_db):
    """Records appended between two pages: those there all along come once
    each (an offset would repeat one), and the new ones that sort later
    come on the later pages."""
    first = api.get("/admin/usage", headers=ADMIN, params={"limit": 3}).json()
    assert [r["request_id"] for r in first["data"]] == ["adapter-load/1", "g1", "s1/recompute/g1"]

    async def append_more():
        engine = create_engine(ledger_db)
        try:
            await Ledger(engine).append([rec("early", REQUEST, "gold", "premium", at(0, 0), gpu_us=1),
                                         rec("late", REQUEST, "gold", "premium", at(5, 0), gpu_us=1)])
        finally:
            await engine.dispose()

    asyncio.run(append_more())
    rest = _pages_from(api, first["next_cursor"])
    ids = [r["request_id"] for r in first["data"]] + [r["request_id"] for r in rest]
    assert ids == [r.request_id for r in sorted(RECORDS, key=lambda r: (r.ended_at_us, r.request_id))] + ["late"]


def _pages_from(api, cursor: str) -> list[dict]:
    rows = []
    while cursor:
        page = api.get("/admin/usage", headers=ADMIN, params={"limit": 2, "cursor": cursor}).json()
        rows += page["data"]
        cursor = page["next_cursor"]
    return rows


def test_admin_usage_takes_its_largest_page_and_the_lowest_totals_cursor(api):
    from gateway.schemas.admin import USAGE_PAGE_MAX_ROWS

    page = api.get("/admin/usage", headers=ADMIN, params={"limit": USAGE_PAGE_MAX_ROWS})
    assert page.status_code == 200 and len(page.json()["data"]) == len(RECORDS)
    padded = api.get("/admin/usage", headers=ADMIN, params={"limit": "0000002"})  # an integer in range, as documented
    assert padded.status_code == 200 and len(padded.json()["data"]) == 2
    # A period at BIGINT's floor: the totals' time bound below it would overflow.
    lowest = _cursor(["hour", -2**63, "", "", ""])
    totals = api.get("/admin/usage", headers=ADMIN, params={"group_by": "hour", "cursor": lowest})
    assert totals.status_code == 200, totals.text
    assert totals.json()["data"] == api.get("/admin/usage", headers=ADMIN, params={"group_by": "hour"}).json()["data"]


def test_admin_usage_answers_a_page_of_its_default_size(api, ledger_db):
    from gateway.schemas.admin import USAGE_PAGE_ROWS

    async def fill():
        engine = create_engine(ledger_db)
        try:
            await Ledger(engine).append([rec(f"bulk-{i:05d}", REQUEST, "silver", "standard", at(3, 0) + i, gpu_us=1)
                                         for i in range(USAGE_PAGE_ROWS)])
        finally:
            await engine.dispose()

    asyncio.run(fill())
    page = api.get("/admin/usage", headers=ADMIN).json()
    assert len(page["data"]) == USAGE_PAGE_ROWS and page["has_more"]
    last = api.get("/admin/usage", headers=ADMIN, params={"cursor": page["next_cursor"]}).json()
    assert len(last["data"]) == len(RECORDS) and not last["has_more"] and last["next_cursor"] is None


def _cursor(value) -> str:
    """As the endpoint spells a cursor, so that each bad one below is bad for its own reason."""
    return _b64(json.dumps(value, ensure_ascii=False, separators=(",", ":")).encode())


def _b64(raw: bytes) -> str:
    return base64.urlsafe_b64encode(raw).decode().rstrip("=")


@pytest.mark.parametrize("params, param", [
    ({"limit": "0"}, "limit"),
    ({"limit": "10001"}, "limit"),
    ({"limit": "-1"}, "limit"),
    ({"limit": ""}, "limit"),
    ({"limit": "1_0"}, "limit"),
    ({"limit": " 10"}, "limit"),
    ({"limit": "１０"}, "limit"),
    ({"limit": "1" * 5000}, "limit"),  # int() refuses past 4,300 digits: it was a 500
    ({"tenant": "Gold"}, "tenant"),  # no tenant can have the name: a mistake, not an empty list
    ({"tenant": "gold\n"}, "tenant"),
    ({"tenant": ""}, "tenant"),
    ({"tenant": "g" * 65}, "tenant"),
    ({"cursor": "not a cursor"}, "cursor"),
    ({"cursor": "!!!!"}, "cursor"),
    ({"cursor": _cursor(["none", 1, "g1"]) + "!"}, "cursor"),  # b64decode would drop the "!"
    ({"cursor": _cursor(["none", 1, "g1"]) + "\n"}, "cursor"),  # and the newline
    ({"cursor": _b64(b'["none", 1, "g1"]')}, "cursor"),  # the same key, spelt another way
    ({"cursor": _cursor(["hour", -2**63, "gold", "id-gold", "premium"])}, "cursor"),  # another grouping's
    ({"cursor": _cursor({"a": 1})}, "cursor"),
    ({"cursor": _cursor(["none", 1])}, "cursor"),
    ({"cursor": _cursor(["none", "1", "x"])}, "cursor"),
    ({"cursor": _cursor(["none", True, "x"])}, "cursor"),
    ({"cursor": _cursor(["none", 2**70, "x"])}, "cursor"),  # past BIGINT: was it a driver error?
    ({"cursor": _cursor(["none", 1, "x\u0000y"])}, "cursor"),
    ({"cursor": _b64(b'["none",1,"\\ud800"]')}, "cursor"),
    ({"cursor": _cursor(["week", 1, "x"])}, "cursor"),
    ({"cursor": _cursor(["day", 1, "gold", "id-gold", "premium"])}, "cursor"),  # another grouping's
    ({"cursor": _cursor([[[[["none"]]]]])}, "cursor"),
    ({"cursor": _b64(b"[" * 3000)}, "cursor"),  # json's RecursionError
    ({"cursor": _b64(b"[" * 100_000)[:8000]}, "cursor"),
    ({"cursor": _cursor(["none", 1, "x" * 5000])}, "cursor"),
])
def test_admin_usage_refuses_a_bad_page_request(api, params, param):
    response = api.get("/admin/usage", headers=ADMIN, params=params)
    assert response.status_code == 400, response.text
    assert response.json()["error"]["param"] == param
