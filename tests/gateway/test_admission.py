"""Admission control with an injected clock: tier queues, KV budget, tenant limits."""

from __future__ import annotations

import pytest

from gateway.admission import AdmissionController
from gateway.config import TierLimits
from gateway.engine_client import KVCapacity
from gateway.errors import RateLimited
from gateway.tenancy import Principal, Tenant, TenantLimits, Tier

pytestmark = pytest.mark.anyio


class Clock:
    def __init__(self):
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def principal(name: str, tier: Tier, **limits) -> Principal:
    return Principal(Tenant(id=f"id-{name}", name=name, tier=tier, limits=TenantLimits(**limits)), key_id="k")


def controller(clock, *, enabled=True, capacity=KVCapacity(total_tokens=1000, premium_reserved_tokens=200),
               premium=TierLimits(max_waiting=4), standard=TierLimits(max_waiting=3)):
    return AdmissionController({Tier.PREMIUM: premium, Tier.STANDARD: standard}, lambda: capacity,
                               enabled=enabled, clock=clock)


async def test_full_standard_queue_is_429_while_premium_still_admitted():
    ctl = controller(Clock())
    std = principal("flood", Tier.STANDARD)
    held = [await ctl.admit(std, prompt_tokens=10, max_tokens=10) for _ in range(3)]
    with pytest.raises(RateLimited) as info:
        await ctl.admit(std, prompt_tokens=10, max_tokens=10)
    assert info.value.status == 429 and info.value.code == "tier_queue_full"
    assert "standard" in info.value.message and int(info.value.headers["Retry-After"]) >= 1
    vip = principal("vip", Tier.PREMIUM)
    premium_tickets = [await ctl.admit(vip, prompt_tokens=10, max_tokens=10) for _ in range(4)]
    assert len(premium_tickets) == 4
    held[0].started()  # first token: no longer waiting, a standard slot frees
    await ctl.admit(std, prompt_tokens=10, max_tokens=10)
    assert ctl.snapshot()["standard"]["rejected"] == {"max_waiting": 1}


async def test_started_and_release_are_idempotent_and_free_the_queue_once():
    ctl = controller(Clock())
    std = principal("a", Tier.STANDARD)
    ticket = await ctl.admit(std, prompt_tokens=7, max_tokens=3)
    assert ctl.snapshot()["standard"]["queued_tokens"] == 7
    ticket.started()
    ticket.started()
    ticket.release()
    ticket.release()
    snap = ctl.snapshot()["standard"]
    assert snap["waiting"] == 0 and snap["queued_tokens"] == 0
    # A request that ends before its first token (abort, error) leaves the queue too.
    other = await ctl.admit(std, prompt_tokens=5, max_tokens=3)
    other.release()
    assert ctl.snapshot()["standard"]["waiting"] == 0


async def test_queued_tokens_are_bounded_by_the_tiers_kv_share():
    # standard may use 1000 - 200 reserved = 800 tokens of KV; overcommit 1.5 -> 1200.
    ctl = controller(Clock(), standard=TierLimits(max_waiting=100, kv_overcommit=1.5),
                     premium=TierLimits(max_waiting=100, kv_overcommit=1.0))
    assert ctl.queued_token_budget(Tier.STANDARD) == 1200
    assert ctl.queued_token_budget(Tier.PREMIUM) == 1000
    std = principal("s", Tier.STANDARD)
    await ctl.admit(std, prompt_tokens=700, max_tokens=1)
    await ctl.admit(std, prompt_tokens=500, max_tokens=1)
    with pytest.raises(RateLimited) as info:
        await ctl.admit(std, prompt_tokens=1, max_tokens=1)
    assert info.value.code == "tier_kv_budget"
    # The premium budget is separate.
    await ctl.admit(principal("p", Tier.PREMIUM), prompt_tokens=999, max_tokens=1)


async def test_an_oversized_prompt_is_admitted_into_an_empty_queue():
    ctl = controller(Clock(), standard=TierLimits(max_waiting=10, max_queued_tokens=100))
    await ctl.admit(principal("s", Tier.STANDARD), prompt_tokens=5000, max_tokens=1)


async def test_tenant_concurrency_limit():
    ctl = controller(Clock(), standard=TierLimits(max_waiting=100))
    ten = principal("t", Tier.STANDARD, max_concurrent=2)
    a = await ctl.admit(ten, prompt_tokens=1, max_tokens=1)
    await ctl.admit(ten, prompt_tokens=1, max_tokens=1)
    with pytest.raises(RateLimited) as info:
        await ctl.admit(ten, prompt_tokens=1, max_tokens=1)
    assert info.value.code == "max_concurrent" and "'t'" in info.value.message
    a.release()
    await ctl.admit(ten, prompt_tokens=1, max_tokens=1)


async def test_requests_per_minute_refills_with_the_clock():
    clock = Clock()
    ctl = controller(clock, standard=TierLimits(max_waiting=100))
    ten = principal("t", Tier.STANDARD, requests_per_minute=6)  # one per 10 s
    for _ in range(6):
        (await ctl.admit(ten, prompt_tokens=1, max_tokens=1)).release()
    with pytest.raises(RateLimited) as info:
        await ctl.admit(ten, prompt_tokens=1, max_tokens=1)
    assert info.value.code == "requests_per_minute"
    assert info.value.headers["Retry-After"] == "10"
    clock.now += 9.0
    with pytest.raises(RateLimited) as info:
        await ctl.admit(ten, prompt_tokens=1, max_tokens=1)
    assert info.value.headers["Retry-After"] == "1"
    clock.now += 1.0
    await ctl.admit(ten, prompt_tokens=1, max_tokens=1)


async def test_tokens_per_minute_reserves_max_tokens_and_refunds_the_unused_part():
    clock = Clock()
    ctl = controller(clock, standard=TierLimits(max_waiting=100))
    ten = principal("t", Tier.STANDARD, tokens_per_minute=600)  # 10 tokens/s
    first = await ctl.admit(ten, prompt_tokens=100, max_tokens=400)
    with pytest.raises(RateLimited) as info:
        await ctl.admit(ten, prompt_tokens=100, max_tokens=100)  # 100 left, 200 needed
    assert info.value.code == "tokens_per_minute" and info.value.headers["Retry-After"] == "10"
    first.release(completion_tokens=50)  # 350 of the 400 reserved come back
    await ctl.admit(ten, prompt_tokens=100, max_tokens=100)


async def test_limits_update_takes_effect_on_the_next_request():
    ctl = controller(Clock(), standard=TierLimits(max_waiting=100))
    await ctl.admit(principal("t", Tier.STANDARD, requests_per_minute=1), prompt_tokens=1, max_tokens=1)
    with pytest.raises(RateLimited):
        await ctl.admit(principal("t", Tier.STANDARD, requests_per_minute=1), prompt_tokens=1, max_tokens=1)
    await ctl.admit(principal("t", Tier.STANDARD, requests_per_minute=100), prompt_tokens=1, max_tokens=1)


async def test_with_tiers_off_tier_limits_are_skipped_but_tenant_limits_hold():
    ctl = controller(Clock(), enabled=False, standard=TierLimits(max_waiting=1))
    ten = principal("t", Tier.STANDARD, max_concurrent=3)
    for _ in range(3):
        await ctl.admit(ten, prompt_tokens=1, max_tokens=1)
    with pytest.raises(RateLimited) as info:
        await ctl.admit(ten, prompt_tokens=1, max_tokens=1)
    assert info.value.code == "max_concurrent"


async def queued_one_at_a_time(clock, ctl, std, *, count: int, wait_s: float, gap_s: float = 0.0) -> None:
    """`count` requests, each waiting `wait_s` for its first token alone in
    the queue, `gap_s` of empty queue after each."""
    for _ in range(count):
        ticket = await ctl.admit(std, prompt_tokens=1, max_tokens=1)
        clock.now += wait_s
        ticket.started(step=clock.now)
        clock.now += gap_s


async def test_retry_after_follows_the_tiers_recent_start_rate():
    clock = Clock()
    ctl = controller(clock, standard=TierLimits(max_waiting=1))
    std = principal("s", Tier.STANDARD)
    await queued_one_at_a_time(clock, ctl, std, count=4, wait_s=3.0)  # one first token every 3 s
    await ctl.admit(std, prompt_tokens=1, max_tokens=1)
    with pytest.raises(RateLimited) as info:
        await ctl.admit(std, prompt_tokens=1, max_tokens=1)
    # 4 starts over the 12 s the queue held someone: a slot frees about every 3 s.
    assert info.value.headers["Retry-After"] == "3"


async def queued_together(clock, ctl, std, *, count: int, per_step: int, step_s: float) -> list:
    """`count` requests queued at once; every `step_s` an engine step starts
    `per_step` of them, the others still waiting. Returns the tickets."""
    tickets = [await ctl.admit(std, prompt_tokens=1, max_tokens=1) for _ in range(count)]
    for first in range(0, count, per_step):
        clock.now += step_s
        for ticket in tickets[first:first + per_step]:
            ticket.started(step=clock.now)
    return tickets


async def refused_for_queue_wait(ctl, std) -> RateLimited:
    """The next standard request, refused for the tier's expected queue wait."""
    with pytest.raises(RateLimited) as info:
        await ctl.admit(std, prompt_tokens=1, max_tokens=1)
    assert info.value.code == "tier_queue_wait"
    return info.value


async def test_a_queue_that_would_hold_a_request_too_long_refuses_it():
    clock = Clock()
    ctl = controller(clock, standard=TierLimits(max_waiting=100, max_queue_wait_s=5.0))
    std = principal("s", Tier.STANDARD)
    # Steps that left older requests waiting: the tier starts two a second.
    await queued_together(clock, ctl, std, count=12, per_step=2, step_s=1.0)
    held = [await ctl.admit(std, prompt_tokens=1, max_tokens=1) for _ in range(10)]  # the 10th expects 5 s
    assert (await refused_for_queue_wait(ctl, std)).headers["Retry-After"] == "1"  # 11th: 6 steps, 6 s
    clock.now += 0.5
    held[0].started(step=clock.now)  # one left the queue: the next fits again
    await ctl.admit(std, prompt_tokens=1, max_tokens=1)
    # Premium, with no bound of its own, is not affected.
    for _ in range(4):  # up to its own max_waiting
        await ctl.admit(principal("p", Tier.PREMIUM), prompt_tokens=1, max_tokens=1)


async def test_a_queue_served_one_at_a_time_says_nothing_of_how_many_a_step_starts():
    """First tokens one at a time, each alone in the queue, took a second
    each: one request a step only because the queue held one. A burst is
    admitted whole, and refused only once steps that left requests waiting
    that were queued when they were formed show how many a step starts."""
    clock = Clock()
    ctl = controller(clock, standard=TierLimits(max_waiting=100, max_queue_wait_s=4.0))
    std = principal("s", Tier.STANDARD)
    await queued_one_at_a_time(clock, ctl, std, count=5, wait_s=1.0)
    burst = [await ctl.admit(std, prompt_tokens=1, max_tokens=1) for _ in range(64)]  # each admitted
    for step in range(4):  # a step a second, 8 first tokens each
        clock.now += 1.0
        for ticket in burst[8 * step:8 * step + 8]:
            ticket.started(step=clock.now)
        if step == 1:
            # The burst may have arrived after these two steps were formed.
            await ctl.admit(std, prompt_tokens=1, max_tokens=1)
    # The last two left the burst waiting: 8 a step, a second each; 33
    # waiting, so the next is 5 steps off.
    await refused_for_queue_wait(ctl, std)


async def test_one_slow_gap_slows_the_step_in_progress_not_every_step_after_it():
    clock = Clock()
    ctl = controller(clock, standard=TierLimits(max_waiting=100, max_queue_wait_s=10.0))
    std = principal("s", Tier.STANDARD)
    await queued_together(clock, ctl, std, count=40, per_step=2, step_s=0.25)  # two a step, four steps a second
    for _ in range(40):
        await ctl.admit(std, prompt_tokens=1, max_tokens=1)
    clock.now += 0.5  # no first token for twice the usual gap, as while seats are full
    # The 41st: this step 0.5 s, then 20 more at the mean (0.275 s): 6 s.
    # Taking every step as slow as this one, 10.5 s, refused it.
    await ctl.admit(std, prompt_tokens=1, max_tokens=1)


async def test_a_first_token_whose_step_is_unknown_says_nothing_of_the_pace():
    """An output with no engine step (a failed request's) leaves the queue as
    an unstarted request does; as a group of one it would pull the pace
    toward one request a step."""

    async def admitted_until_refused(leave) -> int:
        clock = Clock()
        ctl = controller(clock, standard=TierLimits(max_waiting=100, max_queue_wait_s=4.0))
        std = principal("s", Tier.STANDARD)
        await queued_together(clock, ctl, std, count=12, per_step=2, step_s=1.0)  # two a step, a step a second
        tickets = [await ctl.admit(std, prompt_tokens=1, max_tokens=1) for _ in range(8)]
        for i, ticket in enumerate(tickets[:4]):
            clock.now += 0.5
            leave(ticket, i)
        for n in range(100):
            try:
                await ctl.admit(std, prompt_tokens=1, max_tokens=1)
            except RateLimited:
                return n
        raise AssertionError("never refused")

    # Four leave half a second apart: unstarted, the step in progress has
    # taken 2 s, and the next request is refused at once.
    unstarted = await admitted_until_refused(lambda ticket, i: ticket.release())
    assert await admitted_until_refused(lambda ticket, i: ticket.started()) == unstarted == 0
    # The same four in steps of their own: a quicker pace.
    assert await admitted_until_refused(lambda ticket, i: ticket.started(step=100.0 + i)) == 4


async def test_time_the_queue_stood_empty_is_not_counted_against_the_next_burst():
    """A pause says nothing of how fast the server starts requests: after a
    minute idle, a burst is admitted whole (counting the pause, the second
    request already expected a minute). A stall is not diluted by the
    window's quick steps."""
    clock = Clock()
    ctl = controller(clock, standard=TierLimits(max_waiting=100, max_queue_wait_s=10.0))
    std = principal("s", Tier.STANDARD)
    await queued_one_at_a_time(clock, ctl, std, count=32, wait_s=0.3, gap_s=1.0)
    clock.now += 60.0
    for _ in range(16):  # each admitted: a refusal raises
        await ctl.admit(std, prompt_tokens=1, max_tokens=1)
    # The queue holding someone and no first token for 10.5 s: the step in
    # progress has taken that long (the window's mean, 0.63 s, would not refuse).
    clock.now += 10.5
    await refused_for_queue_wait(ctl, std)


async def test_requests_that_leave_unstarted_keep_the_time_they_held_the_queue():
    clock = Clock()
    ctl = controller(clock, standard=TierLimits(max_waiting=100, max_queue_wait_s=4.0))
    std = principal("s", Tier.STANDARD)
    await queued_one_at_a_time(clock, ctl, std, count=2, wait_s=1.0)  # one a second
    cancelled = await ctl.admit(std, prompt_tokens=1, max_tokens=1)
    clock.now += 8.0
    cancelled.release()  # waited 8 s for nothing, then the queue stood empty
    clock.now += 100.0
    await ctl.admit(std, prompt_tokens=1, max_tokens=1)
    # 2 steps over 2 + 8 s held: one every 5 s, so a second waiting expects
    # 5 s (without the cancelled request's 8 s, 1 s).
    await refused_for_queue_wait(ctl, std)


async def test_precheck_refuses_only_what_admit_would_and_takes_nothing():
    clock = Clock()
    ctl = controller(clock)
    tenant = principal("a", Tier.STANDARD, max_concurrent=2, requests_per_minute=2, tokens_per_minute=100)
    for _ in range(5):
        await ctl.precheck(tenant)  # takes no request, token or seat
    first = await ctl.admit(tenant, prompt_tokens=60, max_tokens=40)  # spends the whole token budget
    with pytest.raises(RateLimited) as info:
        await ctl.precheck(tenant)
    assert info.value.code == "tokens_per_minute"
    with pytest.raises(RateLimited):
        await ctl.admit(tenant, prompt_tokens=1, max_tokens=1)
    first.release(completion_tokens=0)  # refunds 40 tokens
    await ctl.precheck(tenant)
    second = await ctl.admit(tenant, prompt_tokens=1, max_tokens=1)
    with pytest.raises(RateLimited) as info:
        await ctl.precheck(tenant)
    assert info.value.code == "requests_per_minute"
    clock.now += 60
    held = await ctl.admit(tenant, prompt_tokens=1, max_tokens=1)
    with pytest.raises(RateLimited) as info:
        await ctl.precheck(tenant)  # second and held are running
    assert info.value.code == "max_concurrent"
    second.release()
    held.release()
    await ctl.precheck(tenant)
    assert ctl.snapshot()["standard"]["rejected"] == {"tokens_per_minute": 2, "requests_per_minute": 1,
                                                      "max_concurrent": 1}


async def test_precheck_refuses_what_the_tier_queue_would_at_one_prompt_token():
    ctl = controller(Clock(), standard=TierLimits(max_waiting=2, max_queued_tokens=100))
    std = principal("flood", Tier.STANDARD)
    first = await ctl.admit(std, prompt_tokens=60, max_tokens=1)
    await ctl.precheck(std)  # 60 + 1 fits, and a place is free
    second = await ctl.admit(std, prompt_tokens=40, max_tokens=1)
    with pytest.raises(RateLimited) as info:
        await ctl.precheck(std)
    assert info.value.code == "tier_queue_full"
    with pytest.raises(RateLimited):
        await ctl.admit(std, prompt_tokens=1, max_tokens=1)
    await ctl.precheck(principal("vip", Tier.PREMIUM))  # premium's queue is its own
    first.started()  # a place frees, but 40 queued tokens + 1 still fit: nothing to refuse
    await ctl.precheck(std)
    ctl_full_budget = controller(Clock(), standard=TierLimits(max_waiting=5, max_queued_tokens=100))
    await ctl_full_budget.admit(std, prompt_tokens=100, max_tokens=1)
    with pytest.raises(RateLimited) as info:
        await ctl_full_budget.precheck(std)  # no prompt is shorter than one token
    assert info.value.code == "tier_kv_budget"
    second.release()
    snap = ctl.snapshot()["standard"]
    assert snap["waiting"] == 0 and snap["queued_tokens"] == 0  # prechecks took nothing
    assert snap["rejected"] == {"max_waiting": 2}


async def test_precheck_skips_the_tier_queues_with_tiers_off():
    ctl = controller(Clock(), enabled=False, standard=TierLimits(max_waiting=1))
    std = principal("a", Tier.STANDARD)
    await ctl.admit(std, prompt_tokens=10, max_tokens=1)
    await ctl.precheck(std)
