"""Adapter-slot pressure: at most max_loras adapters per step, and no request
waits more than a bounded number of steps for a slot."""

from __future__ import annotations

import random

import pytest

from engine.adapter_slots import AdapterSlotPolicy
from engine.errors import ValidationError
from tests.engine.sched_helpers import make_request, make_scheduler, slices, step


def _adapters_in(out, s):
    keys = set()
    for r in out.requests:
        req = s.requests.get(r.request_id)
        if r.adapter_key is not None:
            keys.add(r.adapter_key)
        assert req is None or req.adapter_key == r.adapter_key
    return keys


def test_five_adapters_two_slots_everyone_finishes_with_bounded_wait():
    rng = random.Random(0)
    wait_limit = 8
    s = make_scheduler(num_blocks=256, block_size=4, budget=64, max_seqs=16,
                       max_loras=2, max_slot_wait_steps=wait_limit)
    added, admitted, max_tokens = {}, {}, 12
    for i in range(40):
        adapter = None if i % 6 == 5 else f"lora-{rng.randrange(5)}"
        rid = f"r{i}"
        s.add_request(make_request(rid, rng.randrange(3, 12), adapter=adapter,
                                   max_tokens=rng.randrange(1, max_tokens + 1)))
        added[rid] = 0
    steps = 0
    while s.has_unfinished():
        steps += 1
        out, _ = step(s)
        assert len(_adapters_in(out, s)) <= 2
        assert len(s.adapters.running) <= 2
        for r in out.requests:
            admitted.setdefault(r.request_id, steps)
        assert steps < 2000
    assert set(admitted) == set(added)
    # A blocked request becomes starving after wait_limit steps; the running
    # adapters then drain within their max_tokens (plus prefill steps).
    waits = sorted(admitted.values())
    assert waits[-1] <= len(added) * (wait_limit + max_tokens + 2)


def test_a_starving_adapter_gets_a_slot_despite_a_steady_stream_of_others():
    wait_limit = 5
    s = make_scheduler(num_blocks=512, block_size=4, budget=256, max_seqs=64,
                       max_loras=2, max_slot_wait_steps=wait_limit)
    for i in range(4):
        s.add_request(make_request(f"a{i}", 4, adapter="A", max_tokens=6))
        s.add_request(make_request(f"b{i}", 4, adapter="B", max_tokens=6))
    step(s)
    s.add_request(make_request("c", 4, adapter="C", max_tokens=3))
    admitted_at = None
    for n in range(1, 60):
        # New A and B requests keep arriving every step; they must not keep C out.
        s.add_request(make_request(f"a-late{n}", 4, adapter="A", max_tokens=6))
        s.add_request(make_request(f"b-late{n}", 4, adapter="B", max_tokens=6))
        out, _ = step(s)
        if any(r.request_id == "c" for r in out.requests):
            admitted_at = n
            break
    assert admitted_at is not None
    assert admitted_at <= wait_limit + 6 + 2


def test_base_requests_pass_a_request_blocked_on_slots():
    s = make_scheduler(max_loras=1, budget=64)
    s.add_request(make_request("a", 4, adapter="A", max_tokens=10))
    step(s)
    s.add_request(make_request("b", 4, adapter="B"))
    s.add_request(make_request("base", 4))
    out, _ = step(s)
    assert {r.request_id for r in out.requests} == {"a", "base"}


def test_requests_wait_while_adapter_weights_load():
    ready = set()
    policy = AdapterSlotPolicy(max_loras=4, is_ready=lambda key: key in ready)
    s = make_scheduler(adapter_policy=policy)
    s.add_request(make_request("slow", 4, adapter="X"))
    s.add_request(make_request("base", 4))
    out, _ = step(s)
    assert [r.request_id for r in out.requests] == ["base"]
    ready.add("X")
    out, _ = step(s)
    assert "slow" in {r.request_id for r in out.requests}


def test_preemption_and_abort_release_the_adapter():
    s = make_scheduler(max_loras=2)
    s.add_request(make_request("a", 4, adapter="A", max_tokens=50))
    s.add_request(make_request("b", 4, adapter="B", max_tokens=50))
    step(s)
    assert set(s.adapters.running) == {"A", "B"}
    s.abort("a")
    assert set(s.adapters.running) == {"B"}
    s.add_request(make_request("c", 4, adapter="C", max_tokens=2))
    out, _ = step(s)
    assert "c" in {r.request_id for r in out.requests}


def test_forked_children_count_for_their_adapter():
    s = make_scheduler(max_loras=1)
    s.add_request(make_request("g", 4, adapter="A", n=3, max_tokens=5))
    step(s)
    assert s.adapters.running["A"] == 3
    s.abort("g")
    assert not s.adapters.running


def test_adapters_are_refused_when_lora_is_off():
    s = make_scheduler(max_loras=0)
    with pytest.raises(ValidationError) as err:
        s.add_request(make_request("a", 4, adapter="A"))
    assert err.value.param == "adapter"


def test_premium_frees_a_slot_by_preempting_a_standard_adapter():
    from engine.request import RequestStatus, Tier

    s = make_scheduler(num_blocks=256, budget=64, max_loras=1)
    for i in range(2):
        s.add_request(make_request(f"std-{i}", 4, adapter="A", max_tokens=50))
    step(s)
    step(s)
    s.add_request(make_request("gold", 4, adapter="B", tier=Tier.PREMIUM, max_tokens=3))
    out, _ = step(s)
    # Both of A's sequences made way at once, caused by the premium head,
    # which ran this very step with its adapter in the freed slot.
    assert {(p.victim_id, p.caused_by) for p in out.preemptions} == {("std-0", "gold"), ("std-1", "gold")}
    assert "gold" in slices(out) and _adapters_in(out, s) == {"B"}
    assert all(s.requests[f"std-{i}"].status is RequestStatus.PREEMPTED for i in range(2))
    while s.has_unfinished():
        out, _ = step(s)
        assert len(_adapters_in(out, s)) <= 1
    assert s.kv.num_free_blocks() == 256


def test_premium_never_preempts_another_premium_adapter():
    from engine.request import Tier

    s = make_scheduler(num_blocks=256, budget=64, max_loras=1)
    s.add_request(make_request("gold-a", 4, adapter="A", tier=Tier.PREMIUM, max_tokens=6))
    s.add_request(make_request("std-a", 4, adapter="A", max_tokens=6))
    step(s)
    s.add_request(make_request("gold-b", 4, adapter="B", tier=Tier.PREMIUM, max_tokens=3))
    for _ in range(4):
        out, _ = step(s)
        assert not out.preemptions and "gold-b" not in slices(out)
    while "gold-b" not in slices(out):  # it runs once A drains
        out, _ = step(s)


def test_a_starving_standard_adapter_does_not_hold_premium_back():
    from engine.request import Tier

    s = make_scheduler(num_blocks=256, budget=64, max_loras=2, max_slot_wait_steps=1)
    s.add_request(make_request("a", 4, adapter="A", max_tokens=40))
    s.add_request(make_request("b", 4, adapter="B", max_tokens=40))
    step(s)
    s.add_request(make_request("c", 4, adapter="C", max_tokens=3))  # blocked, then starving
    for _ in range(3):
        step(s)
    assert s.adapters._starving_key(s._step_id) == "C"
    s.add_request(make_request("gold", 4, adapter="D", tier=Tier.PREMIUM, max_tokens=3))
    out, _ = step(s)
    assert "gold" in slices(out)
