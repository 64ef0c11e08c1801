"""The meter: engine step time -> integer microseconds per request.

Each `StepUsage` (on the engine thread, through `EngineClient.add_usage_sink`)
is split exactly, with nothing lost to rounding:

1. adapter slot loads inside the step are carved out first, each charged to
   the adapter (its owner pays; see `AdapterLoadCharge`);
2. the rest of the step's busy time is split among the step's sequences in
   proportion to the tokens each computed, by largest remainder, so the
   shares sum to the step's busy time exactly;
3. within a sequence's share, the part for recomputed tokens (recompute
   after a preemption) goes to whoever caused that preemption (the payer
   recorded at preemption time), or to the platform-overhead account when
   the sequence preempted itself. The rest is the request's own `gpu_us`.

Sequences of an n>1 request (forks) are summed into their group (the
caller's request id). Time for requests nobody registered, or that arrives
after a request was settled, goes to overhead, so that over any run
    sum(request gpu_us) + sum(recompute charges) + loads + overhead == sum(busy_time_us).
See docs/billing.md.
"""

from __future__ import annotations

import threading
import uuid
from dataclasses import dataclass, field
from typing import Hashable

from engine.step_io import RequestStepUsage, StepUsage, split_exact


@dataclass(frozen=True)
class Account:
    """Who pays: a tenant (through one of its keys), at its tier."""

    tenant_id: str
    tenant: str
    key_id: str | None
    tier: str


PLATFORM_OVERHEAD = Account(tenant_id="platform-overhead", tenant="platform-overhead", key_id=None, tier="platform")


@dataclass(frozen=True)
class RecomputeCharge:
    """Recompute of `victim_id`'s tokens, paid by the request that preempted it."""

    victim_id: str
    payer_request_id: str | None  # None: the platform-overhead account pays
    payer: Account
    recompute_us: int


@dataclass(frozen=True)
class AdapterLoadCharge:
    load_id: str  # unique: the ledger's idempotency key for this load
    adapter_key: Hashable  # (name, version, digest)
    load_us: int


@dataclass(frozen=True)
class MeteredUsage:
    """One request's figures, when it is settled."""

    request_id: str
    gpu_us: int  # its own compute, recompute excluded
    cached_prompt_tokens: int
    computed_tokens: int
    recompute_charges: tuple[RecomputeCharge, ...]  # recompute of its tokens, owed by others


@dataclass
class _Open:
    account: Account
    gpu_us: int = 0
    cached_prompt_tokens: int = 0
    computed_tokens: int = 0
    seq_ids: set[str] = field(default_factory=set)
    # (payer request id, payer account) -> recompute us of this request's tokens
    owed: dict[tuple[str | None, Account], int] = field(default_factory=dict)


class Meter:
    """Thread-safe: `on_step` runs on the engine thread, the rest on the
    event loop. Each call holds the lock for O(requests in the step)."""

    def __init__(self):
        self._lock = threading.Lock()
        self._open: dict[str, _Open] = {}  # group (request) id -> running figures
        self._seq_group: dict[str, str] = {}  # sequence id -> group id
        self._payer: dict[str, tuple[str | None, Account]] = {}  # victim sequence -> who pays its recompute
        self._loads: list[AdapterLoadCharge] = []
        self._overhead_pending_us = 0
        self.busy_total_us = 0  # every step's busy time, for conservation checks
        self.overhead_total_us = 0

    # ---- the gateway's side (event loop) ----------------------------------------

    def register(self, request_id: str, account: Account) -> None:
        """Before the request reaches the engine: its steps are charged to `account`."""
        with self._lock:
            self._open[request_id] = _Open(account)

    def settle(self, request_id: str) -> MeteredUsage | None:
        """Close the request: its figures, then forget it. Later steps of it
        (an abort racing a running step) go to overhead. None if unknown."""
        with self._lock:
            entry = self._open.pop(request_id, None)
            if entry is None:
                return None
            for seq_id in entry.seq_ids:
                self._seq_group.pop(seq_id, None)
                self._payer.pop(seq_id, None)
        charges = tuple(RecomputeCharge(request_id, payer_id, payer, us)
                        for (payer_id, payer), us in entry.owed.items() if us > 0)
        return MeteredUsage(request_id, entry.gpu_us, entry.cached_prompt_tokens, entry.computed_tokens, charges)

    def take_adapter_loads(self) -> list[AdapterLoadCharge]:
        with self._lock:
            loads, self._loads = self._loads, []
        return loads

    def take_overhead_us(self) -> int:
        """Overhead accrued since the last call (for the overhead account's ledger rows)."""
        with self._lock:
            us, self._overhead_pending_us = self._overhead_pending_us, 0
        return us

    # ---- the engine's side (engine thread) ----------------------------------------

    def on_step(self, step: StepUsage) -> None:
        with self._lock:
            self.busy_total_us += step.busy_time_us
            for p in step.preemptions:
                self._payer[p.victim_id] = self._payer_of(p.caused_by)
            load_shares = split_exact(min(step.busy_time_us, sum(x.load_us for x in step.adapter_loads)),
                                      [x.load_us for x in step.adapter_loads])
            for load, us in zip(step.adapter_loads, load_shares):
                self._loads.append(AdapterLoadCharge(uuid.uuid4().hex, load.adapter_key, us))
            rest = step.busy_time_us - sum(load_shares)
            shares = split_exact(rest, [r.computed_tokens for r in step.requests])
            if not step.requests:
                self._charge_overhead(rest)
            for usage, share in zip(step.requests, shares):
                self._charge(usage, share)
            # A payer is kept only for a sequence of an open request (settle
            # drops it); one nobody registered, or already settled, is
            # overhead anyway and would otherwise stay here for good.
            for p in step.preemptions:
                if p.victim_id not in self._seq_group:
                    self._payer.pop(p.victim_id, None)

    def _payer_of(self, caused_by: str | None) -> tuple[str | None, Account]:
        if caused_by is not None:
            group = self._seq_group.get(caused_by, caused_by)
            entry = self._open.get(group)
            if entry is not None:
                return group, entry.account
        return None, PLATFORM_OVERHEAD

    def _charge(self, usage: RequestStepUsage, share_us: int) -> None:
        group = usage.group_id or usage.request_id
        entry = self._open.get(group)
        if entry is None:
            self._charge_overhead(share_us)
            return
        self._seq_group[usage.request_id] = group
        entry.seq_ids.add(usage.request_id)
        entry.cached_prompt_tokens += usage.prompt_tokens_cached
        entry.computed_tokens += usage.computed_tokens
        recompute_us = share_us * usage.recomputed_tokens // max(1, usage.computed_tokens)
        entry.gpu_us += share_us - recompute_us
        if recompute_us:
            payer = self._payer.get(usage.request_id, (None, PLATFORM_OVERHEAD))
            entry.owed[payer] = entry.owed.get(payer, 0) + recompute_us

    def _charge_overhead(self, us: int) -> None:
        self._overhead_pending_us += us
        self.overhead_total_us += us
