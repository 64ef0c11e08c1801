"""Usage exports: per-record rows, or per-tenant totals per hour or day,
with prices applied, as CSV, JSONL or plain dicts (the admin API's JSON).

Money and GPU-seconds are decimal strings (no float rounding); every other
figure is an integer."""

from __future__ import annotations

import base64
import binascii
import csv
import datetime as dt
import io
import json
import re
from decimal import Decimal
from typing import Iterable

from billing.ledger import PERIOD_US, Ledger, UsageTotals, record_key, totals_key
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
    """What `loragw usage export` writes: every row in range."""
    rows, _ = await usage_page(ledger, prices, group_by=group_by, since_us=since_us, until_us=until_us,
                               tenant=tenant)
    return rows


async def usage_page(ledger: Ledger, prices: PriceBook, *, group_by: str = "none", since_us: int | None = None,
                     until_us: int | None = None, tenant: str | None = None, after: tuple | None = None,
                     limit: int | None = None) -> tuple[list[dict], str | None]:
    """A page of `usage_rows` (what `GET /admin/usage` answers): at most
    `limit` rows, those after the key `after` (`decode_cursor`), and the
    cursor of the next page, None after the last."""
    if group_by not in GROUP_BY:
        raise ValueError(f"group_by must be one of {', '.join(GROUP_BY)}")
    if limit is not None and limit < 1:
        raise ValueError("limit must be at least 1")  # the cursor is the last row's: a page must have one
    more = None if limit is None else limit + 1  # one past the page says whether another follows
    if group_by == "none":
        found = await ledger.records(since_us=since_us, until_us=until_us, tenant=tenant, after=after, limit=more)
        rows = [record_row(r, prices) for r in found[:limit]]
        key = record_key
    else:
        found = await ledger.totals(group_by=group_by, since_us=since_us, until_us=until_us, tenant=tenant,
                                    after=after, limit=more)
        rows = [totals_row(t, prices) for t in found[:limit]]
        key = totals_key
    if limit is None or len(found) <= limit:
        return rows, None
    return rows, encode_cursor(group_by, key(found[limit - 1]))


# What a cursor may hold, by grouping: the sort key of the last row of a page
# (billing.ledger.record_key, totals_key). Checked on the way in: a cursor
# comes back from the client, so it is input like any other.
_KEY_TYPES = {"none": (int, str), **{period: (int, str, str, str) for period in PERIOD_US}}
_INT64 = (-2**63, 2**63 - 1)
# Longer than any cursor of keys the ledger's columns can hold (a 200-character
# record id of 4-byte characters is about 1,100).
MAX_CURSOR = 4096
CURSOR_PATTERN = r"^[A-Za-z0-9_-]*$"  # unpadded base64url (the OpenAPI document's pattern too)


def encode_cursor(group_by: str, key: tuple) -> str:
    text = json.dumps([group_by, *key], ensure_ascii=False, separators=(",", ":"))
    return base64.urlsafe_b64encode(text.encode()).decode().rstrip("=")


def decode_cursor(group_by: str, cursor: str) -> tuple:
    """The key `encode_cursor` wrote, for a page of the same grouping: a
    ValueError for anything else."""
    # The length first: the decoding below is linear, but json.loads nests.
    if len(cursor) > MAX_CURSOR or not re.fullmatch(CURSOR_PATTERN, cursor):
        raise ValueError("not a cursor this endpoint gave")
    try:
        raw = base64.urlsafe_b64decode(cursor + "=" * (-len(cursor) % 4))
        value = json.loads(raw.decode())
    except (ValueError, binascii.Error, UnicodeError, RecursionError):
        raise ValueError("not a cursor this endpoint gave") from None
    types = _KEY_TYPES[group_by]
    if not (isinstance(value, list) and value and value[0] in GROUP_BY):
        raise ValueError("not a cursor this endpoint gave")
    if value[0] != group_by:
        raise ValueError(f"a cursor of group_by={value[0]}, not {group_by}")
    key = value[1:]
    if len(key) != len(types) or not all(type(v) is t for v, t in zip(key, types)):  # type(): bool is no int here
        raise ValueError("not a cursor this endpoint gave")
    if not _INT64[0] <= key[0] <= _INT64[1] or not all(_sendable(v) for v in key[1:]):
        raise ValueError("not a cursor this endpoint gave")
    # One key, one spelling: b64decode drops a trailing newline and ignores
    # the last character's spare bits, and JSON allows spaces.
    if encode_cursor(group_by, tuple(key)) != cursor:
        raise ValueError("not a cursor this endpoint gave")
    return tuple(key)


def _sendable(text: str) -> bool:
    """Whether PostgreSQL takes it as text: no NUL, and valid UTF-8 (a JSON
    string may hold a lone surrogate); an integer past BIGINT fails in the
    driver the same way, hence the range check above."""
    try:
        text.encode()
    except UnicodeEncodeError:
        return False
    return "\x00" not in text


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
