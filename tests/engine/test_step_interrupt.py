"""A standard step dropped part way for a premium arrival: which steps may
be, and what the scheduler and the KV cache look like afterwards. Driven by
hand-built runner outputs; tests/engine/test_exactness.py runs it on a model."""

from __future__ import annotations

import pytest

from engine.request import Tier
from engine.step_io import RunnerOutput
from engine.tier_steps import DROP_COST_MIN, DROP_CREDIT_EARNED, DROP_CREDIT_MAX
from tests.engine.sched_helpers import make_request, make_scheduler, run_output, slices, step


def dropped(s, out, busy_us=400, share_done=0.5):
    """The runner's side of a step dropped with `share_done` of its layers run."""
    assert 0 <= share_done <= out.droppable_share
    return s.interrupted(out, RunnerOutput(sampled={}, busy_time_us=busy_us, interrupted=True,
                                           share_done=share_done))


def test_a_dropped_step_leaves_its_requests_as_they_were_and_bills_no_request():
    s = make_scheduler(budget=16, block_size=4, premium_prefill_alone=True)
    s.add_request(make_request("dec", 4, max_tokens=50))
    s.add_request(make_request("std", 40))
    step(s)
    out = s.schedule()
    assert out.droppable_share == 1 and slices(out) == {"dec": 1, "std": 15}
    result = dropped(s, out)
    # The meter books a step that names no request as platform overhead.
    assert result.updates == [] and result.usage.busy_time_us == 400 and result.usage.requests == ()
    s.add_request(make_request("pre", 8, tier=Tier.PREMIUM, max_tokens=2))
    out, _ = step(s)
    assert slices(out) == {"pre": 8}  # premium alone: its prefill, decodes deferred
    out, res = step(s)
    # The dropped requests again, from where they were, billed as fresh work.
    assert {(r.request_id, r.start_pos, r.num_tokens) for r in out.requests} == {
        ("pre", 8, 1), ("dec", 4, 1), ("std", 12, 14)}
    std = next(u for u in res.usage.requests if u.request_id == "std")
    assert (std.prompt_tokens_computed, std.recomputed_tokens) == (14, 0)
    s.kv.check_invariants()


def test_which_steps_may_be_dropped():
    s = make_scheduler(budget=64, block_size=4, premium_prefill_alone=True)
    s.add_request(make_request("pre", 8, tier=Tier.PREMIUM, max_tokens=20))
    out, _ = step(s)
    assert not out.droppable_share  # premium prefill
    out, _ = step(s)
    assert slices(out) == {"pre": 1} and not out.droppable_share  # no standard work to drop
    s.add_request(make_request("std", 8, max_tokens=20))
    out = s.schedule()
    assert out.droppable_share == 1  # a premium decode does not protect the step
    dropped(s, out)
    s.add_request(make_request("pre2", 8, tier=Tier.PREMIUM, max_tokens=2))
    out, _ = step(s)
    assert "pre2" in slices(out) and "std" not in slices(out) and not out.droppable_share


def test_a_burst_of_premium_arrivals_drops_steps_within_the_credit():
    """The step that redoes a dropped one may be dropped too, while the
    work thrown away stays within one step's worth; then standard work
    completes, and each completed step earns half a step back."""
    s = make_scheduler(budget=64, block_size=4, premium_prefill_alone=True)
    s.add_request(make_request("std", 8, max_tokens=20))
    out = s.schedule()
    assert out.droppable_share == DROP_CREDIT_MAX == 1 and (DROP_CREDIT_EARNED, DROP_COST_MIN) == (0.5, 0.25)
    dropped(s, out, share_done=0.25)  # credit 0.75
    s.add_request(make_request("pre", 8, tier=Tier.PREMIUM, max_tokens=2))
    out, _ = step(s)
    assert slices(out) == {"pre": 8} and not out.droppable_share  # premium prefill is never dropped
    out = s.schedule()
    assert slices(out) == {"pre": 1, "std": 8} and out.droppable_share == 0.75  # the redo
    dropped(s, out, share_done=0.5)  # credit 0.25
    s.add_request(make_request("pre2", 8, tier=Tier.PREMIUM, max_tokens=2))
    out, _ = step(s)
    assert slices(out) == {"pre": 1, "pre2": 8}  # the standard decode deferred
    out = s.schedule()
    assert "std" in slices(out) and out.droppable_share == 0.25  # no further than the credit
    dropped(s, out, share_done=0.125)  # credit 0: a drop costs a quarter step at least
    out, _ = step(s)
    assert "std" in slices(out) and out.droppable_share == 0  # it completes
    out, _ = step(s)
    assert out.droppable_share == DROP_CREDIT_EARNED
    out, _ = step(s)
    assert out.droppable_share == 1
    s.kv.check_invariants()


def test_the_credit_banks_no_more_than_one_step():
    """Many completed steps earn no more than DROP_CREDIT_MAX: four drops
    at the first layer spend it, and the fifth step is not droppable."""
    s = make_scheduler(budget=64, block_size=4, max_seqs=64, premium_prefill_alone=True)
    for i in range(8):
        s.add_request(make_request(f"std{i}", 8, max_tokens=40))
    for _ in range(10):
        step(s)
    for left in (1, 0.75, 0.5, 0.25):
        out = s.schedule()
        assert out.droppable_share == left
        dropped(s, out, share_done=0.0)  # costs DROP_COST_MIN
    out = s.schedule()
    assert out.requests and out.droppable_share == 0


@pytest.mark.parametrize("late", [True, False])
def test_a_premium_flood_costs_standard_work_at_most_a_third(late):
    """A premium arrival during every step, each drop as late as the runner
    may or at the first layer: the standard requests all finish, the work
    thrown away is at most half of what completes (a third of all
    computed), plus the credit it starts with, and at most two steps are
    dropped for each that completes, plus four."""
    s = make_scheduler(num_blocks=256, budget=64, block_size=4, max_seqs=64, premium_prefill_alone=True)
    for i in range(40):
        s.add_request(make_request(f"std{i}", 8, max_tokens=30))
    completed = drops = thrown = 0
    for _ in range(1000):
        if not s.has_unfinished():
            break
        out = s.schedule()
        if out.droppable_share:
            share = out.droppable_share if late else 0.0
            thrown, drops = thrown + share, drops + 1
            dropped(s, out, share_done=share)
        else:
            s.update(out, run_output(out))
            completed += 1
    assert not s.has_unfinished() and completed >= 30
    assert thrown <= DROP_CREDIT_MAX + DROP_CREDIT_EARNED * completed
    assert drops <= 4 + 2 * completed
    if late:
        assert thrown >= DROP_CREDIT_EARNED * (completed - 1)  # the credit is spent, not hoarded
    else:
        assert drops >= 2 * (completed - 1)
    s.kv.check_invariants()


def test_no_step_is_dropped_with_tiers_off_or_the_setting_off():
    for tiers, setting in ((False, True), (True, False)):
        s = make_scheduler(budget=64, block_size=4, tiers=tiers)
        s.config.premium_interrupts_steps = setting
        s.add_request(make_request("std", 8))
        assert not s.schedule().droppable_share


def test_a_dropped_prefill_leaves_no_prefix_hit_on_unwritten_blocks():
    s = make_scheduler(budget=8, block_size=4, premium_prefill_alone=True)
    s.add_request(make_request("a", 16, first_token=1, max_tokens=2))
    out = s.schedule()
    assert slices(out) == {"a": 8} and out.droppable_share
    dropped(s, out)
    s.kv.check_invariants()
    # Same prompt: nothing of it was computed, so nothing of it is a hit.
    s.add_request(make_request("b", 16, first_token=1, tier=Tier.PREMIUM, max_tokens=2))
    out, res = step(s)
    assert [(r.request_id, r.start_pos, r.num_tokens) for r in out.requests] == [("b", 0, 8)]
    assert res.usage.requests[0].prompt_tokens_cached == 0
    # Once "a" computes its chunk for real, its blocks are hashed again.
    step(s)
    step(s)
    s.kv.check_invariants()
    s.add_request(make_request("c", 16, first_token=1, max_tokens=2))
    assert s.kv.get_computed_blocks(s.requests["c"]).num_tokens == 12


def test_a_step_whose_admission_hits_blocks_it_also_fills_is_not_dropped():
    s = make_scheduler(budget=64, block_size=4)
    s.add_request(make_request("a", 12, first_token=1, max_tokens=2))
    s.add_request(make_request("b", 12, first_token=1, max_tokens=2))
    out = s.schedule()
    # "b" hits the blocks "a" fills in this very step: dropping the step
    # would leave "b" counting them as computed.
    assert slices(out) == {"a": 12, "b": 4}
    assert not out.droppable_share
