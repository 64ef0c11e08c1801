"""A standard step dropped part way for a premium arrival: which steps may
be, and what the scheduler and the KV cache look like afterwards. Driven by
hand-built runner outputs; tests/engine/test_exactness.py runs it on a model."""

from __future__ import annotations

from engine.request import Tier
from engine.step_io import RunnerOutput
from tests.engine.sched_helpers import make_request, make_scheduler, slices, step


def dropped(s, out, busy_us=400):
    """The runner's side of a dropped step."""
    return s.interrupted(out, RunnerOutput(sampled={}, busy_time_us=busy_us, interrupted=True))


def test_a_dropped_step_leaves_its_requests_as_they_were_and_bills_no_request():
    s = make_scheduler(budget=16, block_size=4, premium_prefill_alone=True)
    s.add_request(make_request("dec", 4, max_tokens=50))
    s.add_request(make_request("std", 40))
    step(s)
    out = s.schedule()
    assert out.interruptible and slices(out) == {"dec": 1, "std": 15}
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
    assert not out.interruptible  # premium prefill
    out, _ = step(s)
    assert slices(out) == {"pre": 1} and not out.interruptible  # no standard work to drop
    s.add_request(make_request("std", 8, max_tokens=20))
    out = s.schedule()
    assert out.interruptible  # a premium decode does not protect the step
    dropped(s, out)
    out, _ = step(s)
    assert slices(out) == {"pre": 1, "std": 8} and not out.interruptible  # never two in a row
    out = s.schedule()
    assert out.interruptible
    dropped(s, out)
    s.add_request(make_request("pre2", 8, tier=Tier.PREMIUM, max_tokens=2))
    out, _ = step(s)
    assert "pre2" in slices(out) and "std" not in slices(out) and not out.interruptible
    # The standard step after the dropped one completes, even with the premium step between.
    out, _ = step(s)
    assert "std" in slices(out) and not out.interruptible


def test_no_step_is_dropped_with_tiers_off_or_the_setting_off():
    for tiers, setting in ((False, True), (True, False)):
        s = make_scheduler(budget=64, block_size=4, tiers=tiers)
        s.config.premium_interrupts_steps = setting
        s.add_request(make_request("std", 8))
        assert not s.schedule().interruptible


def test_a_dropped_prefill_leaves_no_prefix_hit_on_unwritten_blocks():
    s = make_scheduler(budget=8, block_size=4, premium_prefill_alone=True)
    s.add_request(make_request("a", 16, first_token=1, max_tokens=2))
    out = s.schedule()
    assert slices(out) == {"a": 8} and out.interruptible
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
    assert not out.interruptible
