"""`UsageRecord`: one line of the ledger, as a plain value.

Kinds: `request` (one per request: its tokens, its own GPU time, its
outcome), `recompute` (recompute of a preempted request's tokens, charged to
the tenant that caused the preemption, or to the platform), `adapter_load`
(an adapter copied into a device slot, charged to its owner) and `overhead`
(step time no request can be charged for). Every figure is an integer:
tokens, microseconds, and microseconds since the Unix epoch for times.
"""

from __future__ import annotations

import dataclasses
import datetime as dt
from dataclasses import dataclass

REQUEST, RECOMPUTE, ADAPTER_LOAD, OVERHEAD = "request", "recompute", "adapter_load", "overhead"
FINISH_REASONS = ("stop", "length", "abort", "client_disconnect", "error")
MAX_RECORD_ID = 200  # the ledger's key column is VARCHAR(200)


@dataclass(frozen=True)
class UsageRecord:
    request_id: str  # unique: the idempotency key (a request id, or a derived key for other kinds)
    kind: str
    tenant_id: str
    tenant: str
    tier: str
    ended_at_us: int  # when the charge was incurred (the request ended)
    key_id: str | None = None
    adapter: str | None = None
    adapter_version: int | None = None
    prompt_tokens: int = 0
    cached_prompt_tokens: int = 0
    completion_tokens: int = 0
    gpu_us: int = 0
    recompute_us: int = 0
    adapter_load_us: int = 0
    queue_us: int | None = None
    ttft_us: int | None = None
    e2e_us: int | None = None
    finish_reason: str | None = None
    started_at_us: int | None = None
    caused_by: str | None = None  # recompute: the request whose allocation preempted (the payer)

    @property
    def charged_us(self) -> int:
        """Device time this row charges its tenant."""
        return self.gpu_us + self.recompute_us + self.adapter_load_us

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, data: dict) -> UsageRecord:
        names = {f.name for f in dataclasses.fields(cls)}
        return cls(**{k: v for k, v in data.items() if k in names})


def to_us(when: dt.datetime) -> int:
    """Microseconds since the epoch, exactly (no float on the way)."""
    delta = when.astimezone(dt.UTC) - dt.datetime(1970, 1, 1, tzinfo=dt.UTC)
    return (delta.days * 86_400 + delta.seconds) * 1_000_000 + delta.microseconds


def from_us(us: int) -> dt.datetime:
    return dt.datetime(1970, 1, 1, tzinfo=dt.UTC) + dt.timedelta(microseconds=us)


def seconds_to_us(seconds: float | None) -> int | None:
    return None if seconds is None else round(seconds * 1_000_000)
