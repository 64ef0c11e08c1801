"""Admission control: decide, before the engine sees a request, whether it
may queue now or must come back later (429 + Retry-After).

Two kinds of limit, checked in this order:

1. Per tier: requests waiting for their first token (`max_waiting`) and the
   prompt tokens they hold (`max_queued_tokens`, by default the tier's
   usable KV cache times `kv_overcommit`). Each tier has its own counters,
   so a flood of standard requests can fill the standard queue but never
   takes a premium request's place: premium has its own budget.
2. Per tenant: concurrent requests, requests per minute and tokens per
   minute (prompt plus max_tokens, refunded down to what was generated when
   the request ends). Rates are token buckets refilled continuously.

`precheck` runs the tenant limits alone before the request is parsed, at
the least cost any request has, and `admit` runs everything once the prompt
is tokenized. Everything runs on the event loop, so there are no locks; time comes from
the injected clock, so tests never sleep. With tiers off (the FCFS baseline
of benchmarks/tiers.py) the tier limits are skipped; tenant limits, being
part of each tenant's contract, still hold.
"""

from __future__ import annotations

import collections
from dataclasses import dataclass, field
from typing import Callable

from gateway.config import TierLimits
from gateway.engine_client import KVCapacity
from gateway.errors import RateLimited
from gateway.tenancy import Principal, Tier

# How many recent first-token times estimate a tier's drain rate.
_RATE_WINDOW = 32
_DEFAULT_RETRY_S = 1.0


class TokenBucket:
    """`capacity` units, refilled at `capacity` per `period_s`."""

    def __init__(self, capacity: int, period_s: float, now: float):
        self.capacity = capacity
        self.rate = capacity / period_s
        self.level = float(capacity)
        self.stamp = now

    def _refill(self, now: float) -> None:
        self.level = min(self.capacity, self.level + (now - self.stamp) * self.rate)
        self.stamp = now

    def wait_time(self, cost: int, now: float) -> float:
        """Seconds until `cost` units fit; 0 if they fit now. A cost above the
        capacity fits once the bucket is full (it then runs into debt), so an
        oversized request is delayed, never refused forever."""
        self._refill(now)
        need = min(cost, self.capacity)
        return 0.0 if self.level >= need else (need - self.level) / self.rate

    def take(self, cost: int, now: float) -> None:
        self._refill(now)
        self.level -= cost

    def give_back(self, amount: int, now: float) -> None:
        self._refill(now)
        self.level = min(self.capacity, self.level + amount)


@dataclass
class _TierState:
    limits: TierLimits
    waiting: int = 0
    queued_tokens: int = 0
    starts: collections.deque = field(default_factory=lambda: collections.deque(maxlen=_RATE_WINDOW))
    rejected: collections.Counter = field(default_factory=collections.Counter)

    def start_rate(self, now: float) -> float | None:
        """First tokens per second over the recent window; None until known."""
        if len(self.starts) < 2 or now <= self.starts[0]:
            return None
        return len(self.starts) / (now - self.starts[0])

    def drain_estimate_s(self, now: float) -> float:
        """How long until a waiting slot frees, from the recent start rate."""
        if len(self.starts) < 2 or now <= self.starts[0]:
            return _DEFAULT_RETRY_S
        rate = len(self.starts) / (now - self.starts[0])
        return max(_DEFAULT_RETRY_S, 1.0 / rate)


@dataclass
class _TenantState:
    active: int = 0
    requests: TokenBucket | None = None
    tokens: TokenBucket | None = None
    limits_seen: tuple = ()


class Ticket:
    """One admitted request's hold on the queues. `started()` when its first
    output arrives, `release()` when it ends; both are idempotent."""

    def __init__(self, controller: AdmissionController, tier: Tier, tenant_id: str,
                 prompt_tokens: int, reserved_tokens: int):
        self._controller = controller
        self.tier = tier
        self.tenant_id = tenant_id
        self.prompt_tokens = prompt_tokens
        self.reserved_tokens = reserved_tokens
        self._waiting = True
        self._released = False

    def started(self) -> None:
        if self._waiting and not self._released:
            self._waiting = False
            self._controller._leave_queue(self, started=True)

    def release(self, *, completion_tokens: int | None = None) -> None:
        """End the hold. `completion_tokens`, when known, refunds the unused
        part of the tokens-per-minute reservation."""
        if self._released:
            return
        if self._waiting:
            self._waiting = False
            self._controller._leave_queue(self, started=False)
        self._released = True
        self._controller._finish(self, completion_tokens)


class AdmissionController:
    def __init__(self, tiers: dict[Tier, TierLimits], capacity: Callable[[], KVCapacity], *,
                 enabled: bool = True, clock: Callable[[], float]):
        self.enabled = enabled
        self._capacity = capacity
        self._clock = clock
        self._tiers = {tier: _TierState(limits) for tier, limits in tiers.items()}
        self._tenants: dict[str, _TenantState] = {}

    def admit(self, principal: Principal, *, prompt_tokens: int, max_tokens: int) -> Ticket:
        """A ticket for the request, or RateLimited naming the limit hit.
        `max_tokens` is the most this request can generate (all n choices)."""
        now = self._clock()
        tenant = principal.tenant
        tier = self._tiers[tenant.tier]
        if self.enabled:
            self._check_tier(tenant.tier, tier, prompt_tokens, now)
        state = self._tenant_state(principal, now)
        try:
            self._check_tenant(tenant.name, tenant.limits, state, prompt_tokens + max_tokens, now)
        except RateLimited as exc:
            tier.rejected[exc.limit] += 1  # counted by the tenant's tier, for metrics
            raise

        state.active += 1
        if state.requests is not None:
            state.requests.take(1, now)
        if state.tokens is not None:
            state.tokens.take(prompt_tokens + max_tokens, now)
        tier.waiting += 1
        tier.queued_tokens += prompt_tokens
        return Ticket(self, tenant.tier, tenant.id, prompt_tokens, max_tokens)

    def precheck(self, principal: Principal) -> None:
        """RateLimited if the tenant is at its concurrency limit or out of
        requests (or tokens) per minute: checked before the request's body is
        read, parsed or tokenized, so a tenant over its limits costs the
        server almost nothing. Takes nothing. It judges tokens per minute at
        one token, the least any request costs, so it refuses only what
        `admit` would refuse too; `admit` checks everything again, the tier
        limits and the real token count included."""
        now = self._clock()
        tenant = principal.tenant
        state = self._tenant_state(principal, now)
        try:
            self._check_tenant(tenant.name, tenant.limits, state, 1, now)
        except RateLimited as exc:
            self._tiers[tenant.tier].rejected[exc.limit] += 1
            raise

    def _check_tier(self, tier_name: Tier, tier: _TierState, prompt_tokens: int, now: float) -> None:
        limits = tier.limits
        if tier.waiting >= limits.max_waiting:
            tier.rejected["max_waiting"] += 1
            raise RateLimited(
                f"the {tier_name.value} tier's queue is full ({limits.max_waiting} requests waiting "
                f"for their first token); retry later", limit="tier_queue_full",
                retry_after_s=tier.drain_estimate_s(now))
        rate = tier.start_rate(now)
        if limits.max_queue_wait_s is not None and tier.waiting > 0 and rate is not None:
            expected = (tier.waiting + 1) / rate
            if expected > limits.max_queue_wait_s:
                tier.rejected["max_queue_wait"] += 1
                raise RateLimited(
                    f"the {tier_name.value} tier's queue would hold this request about {expected:.0f} s "
                    f"before its first token (limit {limits.max_queue_wait_s:g} s); retry later",
                    limit="tier_queue_wait", retry_after_s=expected - limits.max_queue_wait_s)
        budget = self.queued_token_budget(tier_name)
        # An empty queue takes any single prompt, so a large one is never
        # refused forever; the engine checks it against the context length.
        if tier.waiting > 0 and tier.queued_tokens + prompt_tokens > budget:
            tier.rejected["max_queued_tokens"] += 1
            raise RateLimited(
                f"the {tier_name.value} tier's queued prompt tokens would exceed its KV budget "
                f"({tier.queued_tokens} queued + {prompt_tokens} > {budget}); retry later",
                limit="tier_kv_budget", retry_after_s=tier.drain_estimate_s(now))

    def _check_tenant(self, name: str, limits, state: _TenantState, tokens: int, now: float) -> None:
        if limits.max_concurrent is not None and state.active >= limits.max_concurrent:
            raise RateLimited(f"tenant {name!r} is at its limit of {limits.max_concurrent} concurrent requests",
                              limit="max_concurrent", retry_after_s=_DEFAULT_RETRY_S)
        if state.requests is not None:
            wait = state.requests.wait_time(1, now)
            if wait > 0:
                raise RateLimited(f"tenant {name!r} is over its limit of {limits.requests_per_minute} "
                                  f"requests per minute", limit="requests_per_minute", retry_after_s=wait)
        if state.tokens is not None:
            wait = state.tokens.wait_time(tokens, now)
            if wait > 0:
                raise RateLimited(f"tenant {name!r} is over its limit of {limits.tokens_per_minute} "
                                  f"tokens per minute", limit="tokens_per_minute", retry_after_s=wait)

    def queued_token_budget(self, tier: Tier) -> int:
        limits = self._tiers[tier].limits
        if limits.max_queued_tokens is not None:
            return limits.max_queued_tokens
        return int(self._capacity().usable_tokens(tier) * limits.kv_overcommit)

    def _tenant_state(self, principal: Principal, now: float) -> _TenantState:
        limits = principal.tenant.limits
        state = self._tenants.setdefault(principal.tenant.id, _TenantState())
        seen = (limits.requests_per_minute, limits.tokens_per_minute)
        if seen != state.limits_seen:  # new tenant, or its limits were updated
            state.limits_seen = seen
            state.requests = None if seen[0] is None else TokenBucket(seen[0], 60.0, now)
            state.tokens = None if seen[1] is None else TokenBucket(seen[1], 60.0, now)
        return state

    def _leave_queue(self, ticket: Ticket, *, started: bool) -> None:
        tier = self._tiers[ticket.tier]
        tier.waiting -= 1
        tier.queued_tokens -= ticket.prompt_tokens
        if started:
            tier.starts.append(self._clock())

    def _finish(self, ticket: Ticket, completion_tokens: int | None) -> None:
        state = self._tenants.get(ticket.tenant_id)
        if state is None:
            return
        state.active -= 1
        if completion_tokens is not None and state.tokens is not None:
            unused = ticket.reserved_tokens - completion_tokens
            if unused > 0:
                state.tokens.give_back(unused, self._clock())

    def snapshot(self) -> dict[str, dict]:
        """Per-tier queue state and rejection counts, for metrics. Rejection
        reasons: max_waiting and max_queued_tokens (the tier's limits), and
        max_concurrent, requests_per_minute and tokens_per_minute (a tenant's
        limits, counted under the tenant's tier)."""
        return {tier.value: {"waiting": s.waiting, "queued_tokens": s.queued_tokens,
                             "rejected": dict(s.rejected)} for tier, s in self._tiers.items()}
