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
   the request ends), judged by a `TenantLimiter` (gateway/tenant_limits.py):
   in this process, or in Redis so that they hold across gateway replicas.

The tier limits describe this gateway's own queue and stay in memory.
`precheck` runs both kinds before the request is parsed, at the least cost
any request has (one prompt token), and `admit` runs everything again once
the prompt is tokenized. Both are coroutines because the tenant limiter may
need I/O; the tier state is touched only on the event loop, so there are no
locks. Time comes from the injected clock, so tests never sleep. With tiers
off (the FCFS baseline of benchmarks/tiers.py) the tier limits are skipped;
tenant limits, being part of each tenant's contract, still hold.
"""

from __future__ import annotations

import collections
import math
from dataclasses import dataclass, field
from typing import Callable

from gateway.config import TierLimits
from gateway.engine_client import KVCapacity
from gateway.errors import RateLimited
from gateway.tenancy import Principal, Tier
from gateway.tenant_limits import InMemoryTenantLimiter, LimiterHealth, TenantHold, TenantLimiter

# How many recent groups of first tokens (engine steps) estimate a tier's pace.
_RATE_WINDOW = 32
_DEFAULT_RETRY_S = 1.0


@dataclass
class _StartGroup:
    """First tokens that one engine step produced together."""

    step: float  # the step's time on its engine's clock: the same for every output of the step
    number: int  # its place in the tier's sequence of groups
    held_s: float  # seconds the queue held someone before it
    count: int = 1
    saturated: bool = False  # requests that were queued when its step was formed still waited after it


@dataclass
class _TierState:
    """A tier's queue: requests admitted and still without a first token.

    Its pace counts only the time the queue held someone. A time between
    first tokens while it stood empty measures how fast requests came, not
    how fast the server starts them. Counted over the whole time since the
    window's first start, the rate fell toward zero while the server was
    idle, and the first burst after a pause was refused from its second
    request, as if the queue would hold it for minutes.

    First tokens come in groups, one per engine step, and a step starts as
    many waiting requests as its token budget and free seats allow. So a
    request's wait is the number of steps ahead of it times the time
    between groups, and the number of steps depends on how many a step can
    start: known only from steps that left requests waiting that were
    queued when the step was formed. Taken as one request a group, the
    pace of a queue served one at a time (a closed loop of 16 clients)
    refused 24 requests of a burst of 64 for waits over 10 s, and the
    burst's TTFT p99 was then 1.9 s (benchmarks/serve_peer.py on a 2-core
    Xeon)."""

    limits: TierLimits
    waiting: int = 0
    queued_tokens: int = 0
    groups: collections.deque = field(default_factory=lambda: collections.deque(maxlen=_RATE_WINDOW))
    groups_made: int = 0  # a request's arrival is stamped with it
    waiting_since: collections.Counter = field(default_factory=collections.Counter)  # stamp -> requests waiting
    busy_from: float | None = None  # since when, without a first token yet; None while empty
    unstarted_s: float = 0.0  # held time that ended with the queue emptied by requests leaving unstarted
    rejected: collections.Counter = field(default_factory=collections.Counter)

    def enter(self, now: float, prompt_tokens: int) -> int:
        """Queue a request; returns its arrival stamp, for `leave`."""
        if self.waiting == 0:
            self.busy_from = now
        self.waiting += 1
        self.queued_tokens += prompt_tokens
        self.waiting_since[self.groups_made] += 1
        return self.groups_made

    def leave(self, now: float, prompt_tokens: int, *, arrived: int, started: bool,
              step: float | None = None) -> None:
        """A request leaves the queue: with its first token from engine step
        `step`, or unstarted (refused, cancelled, failed). A first token
        whose step is unknown counts as unstarted: it says nothing of the
        pace."""
        self.waiting -= 1
        self.queued_tokens -= prompt_tokens
        self.waiting_since[arrived] -= 1
        if not self.waiting_since[arrived]:
            del self.waiting_since[arrived]
        held = now - self.busy_from + self.unstarted_s
        if started and step is not None:
            group = next((g for g in reversed(self.groups) if g.step == step), None)
            if group is None:
                self.groups_made += 1
                group = _StartGroup(step, self.groups_made, held)
                self.groups.append(group)
            else:
                group.count += 1
                group.held_s += held
            # A step is formed while the gateway still handles the outputs of
            # the one before, so only a request that arrived before the group
            # two back was surely queued when this group's step was formed.
            group.saturated = any(since <= group.number - 3 for since in self.waiting_since)
            self.unstarted_s = 0.0
            self.busy_from = now if self.waiting else None
        elif self.waiting == 0:
            self.unstarted_s = held
            self.busy_from = None

    def _open_s(self, now: float) -> float:
        return now - self.busy_from if self.busy_from is not None else 0.0

    def _held_s(self, now: float) -> float:
        """The window's held time, the wait since the last first token
        included (a queue that stops starting anyone slows its pace)."""
        return sum(g.held_s for g in self.groups) + self.unstarted_s + self._open_s(now)

    def start_rate(self, now: float) -> float | None:
        """First tokens per second the queue held someone, over the recent
        window; None until two are known."""
        starts, held = sum(g.count for g in self.groups), self._held_s(now)
        if starts < 2 or held <= 0:
            return None
        return starts / held

    def expected_wait_s(self, position: int, now: float) -> float | None:
        """Seconds until the request at `position` (1: next) gets its first
        token: the steps it waits for, times the time per group. A step
        starts as many as the window's saturated groups did on average; with
        fewer than two of those, a step starts everyone waiting. The step in
        progress takes at least what it has taken so far, so a stall is not
        diluted by the window's quick groups; the steps after it take the
        mean (one slow gap, common while first tokens wait for seats to
        free, does not make every later step slow). None until two groups
        are known."""
        held = self._held_s(now)
        if len(self.groups) < 2 or held <= 0:
            return None
        full = [g.count for g in self.groups if g.saturated]
        steps = math.ceil(position * len(full) / sum(full)) if len(full) >= 2 else 1
        mean = held / len(self.groups)
        return max(mean, self._open_s(now)) + (steps - 1) * mean

    def drain_estimate_s(self, now: float) -> float:
        """How long until a waiting slot frees, from the recent start rate."""
        rate = self.start_rate(now)
        return _DEFAULT_RETRY_S if rate is None else max(_DEFAULT_RETRY_S, 1.0 / rate)


class Ticket:
    """One admitted request's hold on the queues. `started()` when its first
    output arrives, `release()` when it ends; both are idempotent."""

    def __init__(self, controller: AdmissionController, tier: Tier, hold: TenantHold,
                 prompt_tokens: int, reserved_tokens: int, arrived: int):
        self._controller = controller
        self.tier = tier
        self.arrived = arrived  # the tier queue's stamp
        self._hold = hold
        self.prompt_tokens = prompt_tokens
        self.reserved_tokens = reserved_tokens
        self._waiting = True
        self._released = False

    def started(self, step: float | None = None) -> None:
        """`step`: when the engine step that made the first token ran, on
        its engine's clock, so that the tier sees which starts came
        together."""
        if self._waiting and not self._released:
            self._waiting = False
            self._controller._leave_queue(self, started=True, step=step)

    def release(self, *, completion_tokens: int | None = None) -> None:
        """End the hold. `completion_tokens`, when known, refunds the unused
        part of the tokens-per-minute reservation."""
        if self._released:
            return
        if self._waiting:
            self._waiting = False
            self._controller._leave_queue(self, started=False)
        self._released = True
        unused = 0 if completion_tokens is None else max(0, self.reserved_tokens - completion_tokens)
        self._hold.release(unused)


class AdmissionController:
    def __init__(self, tiers: dict[Tier, TierLimits], capacity: Callable[[], KVCapacity], *,
                 enabled: bool = True, clock: Callable[[], float], tenant_limiter: TenantLimiter | None = None):
        self.enabled = enabled
        self._capacity = capacity
        self._clock = clock
        self._tiers = {tier: _TierState(limits) for tier, limits in tiers.items()}
        self.tenant_limiter = tenant_limiter or InMemoryTenantLimiter(clock=clock)

    async def admit(self, principal: Principal, *, prompt_tokens: int, max_tokens: int) -> Ticket:
        """A ticket for the request, or RateLimited naming the limit hit.
        `max_tokens` is the most this request can generate (all n choices)."""
        now = self._clock()
        tenant = principal.tenant
        tier = self._tiers[tenant.tier]
        if self.enabled:
            self._check_tier(tenant.tier, tier, prompt_tokens, now)
        # The queue place is taken before the tenant limiter is awaited, so
        # requests admitted meanwhile count it; given back if refused.
        arrived = tier.enter(now, prompt_tokens)
        try:
            hold = await self.tenant_limiter.acquire(tenant, prompt_tokens + max_tokens)
        except BaseException as exc:
            tier.leave(self._clock(), prompt_tokens, arrived=arrived, started=False)
            if isinstance(exc, RateLimited):
                tier.rejected[exc.limit] += 1  # counted by the tenant's tier, for metrics
            raise
        return Ticket(self, tenant.tier, hold, prompt_tokens, max_tokens, arrived)

    async def precheck(self, principal: Principal) -> None:
        """RateLimited if the tenant's tier queue is full (or would hold the
        request past its wait limit), or the tenant is at its concurrency
        limit or out of requests (or tokens) per minute: checked before the
        request's body is read, parsed or tokenized, so a flood that the
        queue or the tenant's limits would refuse costs the server almost
        nothing. Takes nothing. It judges a prompt and the tokens per minute
        at one token, the least any request holds (an empty prompt is a
        400), so it refuses only what `admit` would refuse at the same
        moment; `admit` checks everything again with the real token count."""
        tenant = principal.tenant
        if self.enabled:
            self._check_tier(tenant.tier, self._tiers[tenant.tier], 1, self._clock())
        try:
            await self.tenant_limiter.check(tenant, 1)
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
        if limits.max_queue_wait_s is not None and tier.waiting > 0:
            expected = tier.expected_wait_s(tier.waiting + 1, now)
            if expected is not None and expected > limits.max_queue_wait_s:
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

    def queued_token_budget(self, tier: Tier) -> int:
        limits = self._tiers[tier].limits
        if limits.max_queued_tokens is not None:
            return limits.max_queued_tokens
        return int(self._capacity().usable_tokens(tier) * limits.kv_overcommit)

    def _leave_queue(self, ticket: Ticket, *, started: bool, step: float | None = None) -> None:
        self._tiers[ticket.tier].leave(self._clock(), ticket.prompt_tokens, arrived=ticket.arrived,
                                       started=started, step=step)

    def snapshot(self) -> dict[str, dict]:
        """Per-tier queue state and rejection counts, for metrics. Rejection
        reasons: max_waiting and max_queued_tokens (the tier's limits), and
        max_concurrent, requests_per_minute and tokens_per_minute (a tenant's
        limits, counted under the tenant's tier)."""
        return {tier.value: {"waiting": s.waiting, "queued_tokens": s.queued_tokens,
                             "rejected": dict(s.rejected)} for tier, s in self._tiers.items()}

    def limiter_health(self) -> LimiterHealth:
        return self.tenant_limiter.health()
