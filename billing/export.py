"""Usage exports: per-record rows, or per-tenant totals per hour or day,
with prices applied, as CSV, JSONL or plain dicts (the admin API's JSON).

Money and GPU-seconds are decimal strings (no float rounding); every other
figure is an integer."""

from __future__ import annotations

import csv
import datetime as dt
import io
import json
from decimal import Decimal
from typing import Iterable

from billing.ledger import Ledger, UsageTotals
from billing.pricing import PriceBook
from billing.records import UsageRecord, from_us, to_us

FORMATS = ("csv", "jsonl")
RECORD_FIELDS = ["request_id", "kind", "tenant", "tier", "key_id", "adapter", "adapter_version", "finish_reason",
                 "started_at", "ended_at", "prompt_tokens", "cached_prompt_tokens", "completion_tokens", "gpu_us",
                 "recompute_us", "adapter_load_us", "gpu_seconds", "queue_us", "ttft_us", "e2e_us", "caused_by",
                 "cost", "tenant_id"]
TOTALS_FIELDS = ["tenant", "tier", "period_start", "requests", "prompt_tokens", "cached_prompt_tokens",
                 "completion_tokens", "gpu_us", "recompute_us", "adapter_load_us", "gpu_seconds", "cost", "tenant_id"]
GROUP_BY = ("none", "hour", "day")


def _seconds(us: int) -> str:
    return str(Decimal(us) / 1_000_000)


def _iso(us: int | None) -> str | None:
    return None if us is None else from_us(us).isoformat()


def record_row(r: UsageRecord, prices: PriceBook) -> dict:
    cost = prices.for_tier(r.tier).cost(charged_us=r.charged_us,
                                        billable_prompt_tokens=r.prompt_tokens - r.cached_prompt_tokens,
                                        completion_tokens=r.completion_tokens)
    return {
        "request_id": r.request_id, "kind": r.kind, "tenant": r.tenant, "tier": r.tier, "key_id": r.key_id,
        "adapter": r.adapter, "adapter_version": r.adapter_version, "finish_reason": r.finish_reason,
        "started_at": _iso(r.started_at_us), "ended_at": _iso(r.ended_at_us),
        "prompt_tokens": r.prompt_tokens, "cached_prompt_tokens": r.cached_prompt_tokens,
        "completion_tokens": r.completion_tokens, "gpu_us": r.gpu_us, "recompute_us": r.recompute_us,
        "adapter_load_us": r.adapter_load_us, "gpu_seconds": _seconds(r.charged_us),
        "queue_us": r.queue_us, "ttft_us": r.ttft_us, "e2e_us": r.e2e_us, "caused_by": r.caused_by,
        "cost": str(cost),
        # Last, so that a CSV read by column position before it existed still reads.
        "tenant_id": r.tenant_id,
    }


def totals_row(t: UsageTotals, prices: PriceBook) -> dict:
    cost = prices.for_tier(t.tier).cost(charged_us=t.charged_us,
                                        billable_prompt_tokens=t.prompt_tokens - t.cached_prompt_tokens,
                                        completion_tokens=t.completion_tokens)
    return {
        "tenant": t.tenant, "tier": t.tier, "period_start": _iso(t.period_start_us), "requests": t.requests,
        "prompt_tokens": t.prompt_tokens, "cached_prompt_tokens": t.cached_prompt_tokens,
        "completion_tokens": t.completion_tokens, "gpu_us": t.gpu_us, "recompute_us": t.recompute_us,
        "adapter_load_us": t.adapter_load_us, "gpu_seconds": _seconds(t.charged_us), "cost": str(cost),
        "tenant_id": t.tenant_id,
    }


async def usage_rows(ledger: Ledger, prices: PriceBook, *, group_by: str = "none", since_us: int | None = None,
                     until_us: int | None = None, tenant: str | None = None) -> list[dict]:
    """What `loragw usage export` writes and `GET /admin/usage` answers."""
    if group_by not in GROUP_BY:
        raise ValueError(f"group_by must be one of {', '.join(GROUP_BY)}")
    if group_by == "none":
        records = await ledger.records(since_us=since_us, until_us=until_us, tenant=tenant)
        return [record_row(r, prices) for r in records]
    totals = await ledger.totals(group_by=group_by, since_us=since_us, until_us=until_us, tenant=tenant)
    return [totals_row(t, prices) for t in totals]


def parse_time(text: str | None) -> int | None:
    """An ISO date or datetime as microseconds since the epoch; naive means UTC."""
    if text is None or text == "":
        return None
    try:
        when = dt.datetime.fromisoformat(text)
    except ValueError:
        raise ValueError(f"not an ISO date or datetime: {text!r}") from None
    try:
        return to_us(when if when.tzinfo is not None else when.replace(tzinfo=dt.UTC))
    except OverflowError:  # 0001-01-01T00:00+01:00 is before datetime.min in UTC
        raise ValueError(f"{text!r} is out of range once converted to UTC") from None


def write(rows: Iterable[dict], fmt: str, out: io.TextIOBase, *, group_by: str = "none") -> None:
    rows = list(rows)
    if fmt == "jsonl":
        for row in rows:
            out.write(json.dumps(row) + "\n")
    elif fmt == "csv":
        writer = csv.DictWriter(out, fieldnames=RECORD_FIELDS if group_by == "none" else TOTALS_FIELDS,
                                lineterminator="\n")
        writer.writeheader()
        writer.writerows(rows)
    else:
        raise ValueError(f"format must be one of {', '.join(FORMATS)}")
