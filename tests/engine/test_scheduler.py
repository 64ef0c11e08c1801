"""Scheduler behaviour, driven by hand-built runner outputs."""

from __future__ import annotations

import pytest

from engine.errors import ValidationError
from engine.request import FinishReason, RequestStatus, Tier
from engine.tier_steps import MAX_DEFERRED_IN_A_ROW
from tests.engine.sched_helpers import make_request, make_scheduler, run_output, slices, step


def test_premium_is_admitted_before_earlier_standard():
    s = make_scheduler(budget=8)
    s.add_request(make_request("std", 8))
    s.add_request(make_request("pre", 8, tier=Tier.PREMIUM))
    out, _ = step(s)
    assert slices(out) == {"pre": 8}
    out, _ = step(s)
    assert slices(out) == {"pre": 1, "std": 7}


def test_fcfs_within_a_tier():
    s = make_scheduler(budget=8)
    for rid in ("a", "b", "c"):
        s.add_request(make_request(rid, 8))
    order = []
    for _ in range(3):
        out, _ = step(s)
        order += [r.request_id for r in out.requests if r.start_pos == 0]
    assert order == ["a", "b", "c"]


def test_tiers_disabled_is_plain_fcfs():
    s = make_scheduler(budget=8, tiers=False)
    s.add_request(make_request("std", 8))
    s.add_request(make_request("pre", 8, tier=Tier.PREMIUM))
    out, _ = step(s)
    assert slices(out) == {"std": 8}


def test_premium_prefill_goes_before_a_standard_prefill_in_progress():
    s = make_scheduler(budget=16, block_size=4)
    s.add_request(make_request("std", 40))
    out, _ = step(s)
    assert slices(out) == {"std": 16}
    s.add_request(make_request("pre", 12, tier=Tier.PREMIUM))
    out, _ = step(s)
    # The standard chunk gets only what premium leaves of the budget.
    assert slices(out) == {"pre": 12, "std": 4}
    out, _ = step(s)
    assert slices(out) == {"pre": 1, "std": 15}


def test_a_step_that_prefills_premium_carries_no_standard_prefill():
    s = make_scheduler(budget=64, block_size=4, premium_prefill_alone=True)
    s.config.premium_prefill_defers_decodes = False
    s.add_request(make_request("dec", 4, max_tokens=50))
    step(s)
    s.add_request(make_request("std", 40))
    s.add_request(make_request("pre", 12, tier=Tier.PREMIUM, max_tokens=2))
    out, _ = step(s)
    # Decodes still run; the standard prompt waits for the next step.
    assert slices(out) == {"dec": 1, "pre": 12}
    out, _ = step(s)
    assert slices(out) == {"dec": 1, "pre": 1, "std": 40}


def test_standard_decodes_wait_out_premium_prefill_steps_but_never_three_in_a_row():
    assert MAX_DEFERRED_IN_A_ROW == 2  # the steps below count on it
    s = make_scheduler(budget=64, block_size=4, premium_prefill_alone=True)
    s.add_request(make_request("dec", 4, max_tokens=50))
    step(s)
    s.add_request(make_request("pdec", 4, tier=Tier.PREMIUM, max_tokens=50))
    out, _ = step(s)
    assert slices(out) == {"pdec": 4}
    out, _ = step(s)
    assert slices(out) == {"dec": 1, "pdec": 1}  # no premium prefill due
    s.add_request(make_request("pre", 12, tier=Tier.PREMIUM, max_tokens=2))
    out, _ = step(s)
    # The premium prompt's first step carries the premium decode only.
    assert slices(out) == {"pdec": 1, "pre": 12}
    s.add_request(make_request("pre2", 12, tier=Tier.PREMIUM, max_tokens=2))
    out, _ = step(s)
    # A second premium prompt that came in meanwhile gets a step without them too.
    assert slices(out) == {"pdec": 1, "pre": 1, "pre2": 12}
    s.add_request(make_request("pre3", 12, tier=Tier.PREMIUM, max_tokens=2))
    out, _ = step(s)
    # Deferred twice in a row, so not a third time: the standard decode runs
    # beside the next premium prompt.
    assert slices(out) == {"dec": 1, "pdec": 1, "pre2": 1, "pre3": 12}
    s.add_request(make_request("pre4", 12, tier=Tier.PREMIUM, max_tokens=2))
    out, _ = step(s)
    assert "dec" not in slices(out)  # the count starts again
    out, _ = step(s)
    assert slices(out)["dec"] == 1  # no premium prefill due: nothing deferred


def test_standard_prefill_per_step_is_capped_with_tiers_on():
    s = make_scheduler(budget=64, block_size=4)
    s.config.max_standard_prefill_tokens = 10
    s.config.standard_prefill_cap_steps = 0  # capped whether premium comes or not
    s.add_request(make_request("a", 8))
    s.add_request(make_request("b", 8))
    out, _ = step(s)
    assert slices(out) == {"a": 8, "b": 2}
    out, _ = step(s)
    assert slices(out) == {"a": 1, "b": 6}
    s.add_request(make_request("p", 30, tier=Tier.PREMIUM))
    out, _ = step(s)
    assert slices(out)["p"] == 30  # premium is not capped
    fcfs = make_scheduler(budget=64, block_size=4, tiers=False)
    fcfs.config.max_standard_prefill_tokens = 10
    fcfs.config.standard_prefill_cap_steps = 0
    fcfs.add_request(make_request("a", 30))
    out, _ = step(fcfs)
    assert slices(out) == {"a": 30}  # with tiers off there is no cap


def test_the_standard_prefill_cap_holds_only_for_its_window_after_a_premium_arrival():
    s = make_scheduler(budget=64, block_size=4)
    s.config.max_standard_prefill_tokens = 10
    s.config.standard_prefill_cap_steps = 3
    s.add_request(make_request("a", 30))
    out, _ = step(s)
    assert slices(out) == {"a": 30}  # no premium request yet: no cap
    s.add_request(make_request("p", 2, tier=Tier.PREMIUM, max_tokens=1))
    s.add_request(make_request("b", 60))
    prefilled = [slices(step(s)[0])["b"] for _ in range(4)]
    # The 3 steps after the arrival are inside the window; the 4th is past it.
    assert prefilled == [10, 10, 10, 30]


def test_chunked_prefill_splits_long_prompt_and_mixes_with_decodes():
    s = make_scheduler(budget=16, block_size=4)
    s.add_request(make_request("short", 4, max_tokens=10))
    out, _ = step(s)
    assert slices(out) == {"short": 4}
    s.add_request(make_request("long", 40))
    out, _ = step(s)
    # The decode goes first and the prefill chunk takes the rest of the budget.
    assert slices(out) == {"short": 1, "long": 15}
    assert [r.sample for r in out.requests] == [True, False]
    out, _ = step(s)
    assert slices(out) == {"short": 1, "long": 15}
    out, _ = step(s)
    assert slices(out) == {"short": 1, "long": 10}
    assert out.requests[1].sample  # the last chunk samples the first token
    assert all(o.num_batched_tokens <= 16 for o in [out])


def test_max_num_seqs_bounds_running():
    s = make_scheduler(budget=1000, max_seqs=2)
    for rid in "abc":
        s.add_request(make_request(rid, 4))
    out, _ = step(s)
    assert set(slices(out)) == {"a", "b"}


def test_standard_never_uses_premium_reserve():
    # 10 blocks of 4 tokens, 4 reserved: standard may hold at most 6 blocks.
    s = make_scheduler(num_blocks=10, block_size=4, reserved=4, budget=1000)
    for i in range(4):
        s.add_request(make_request(f"s{i}", 7, max_tokens=50))  # 2 blocks each
    out, _ = step(s)
    assert set(slices(out)) == {"s0", "s1", "s2"}
    assert s.kv.num_free_blocks() == 4
    s.add_request(make_request("p", 16, tier=Tier.PREMIUM, max_tokens=50))
    out, _ = step(s)
    # The decodes need no new block; s3 still does not fit, premium does.
    assert slices(out) == {"s0": 1, "s1": 1, "s2": 1, "p": 16}
    assert [r.request_id for r in s.waiting[Tier.STANDARD]] == ["s3"]
    assert s.kv.num_free_blocks() == 0


def test_premium_uses_reserve_when_standard_cannot():
    s = make_scheduler(num_blocks=10, block_size=4, reserved=4, budget=1000)
    for i in range(3):
        s.add_request(make_request(f"s{i}", 8, max_tokens=50))
    step(s)
    s.add_request(make_request("p", 16, tier=Tier.PREMIUM, max_tokens=50))
    out, _ = step(s)
    assert slices(out)["p"] == 16
    assert s.kv.num_free_blocks() == 0


def test_standard_prompt_larger_than_its_share_is_rejected():
    s = make_scheduler(num_blocks=10, block_size=4, reserved=4)
    with pytest.raises(ValidationError) as err:
        s.add_request(make_request("big", 24))
    assert err.value.param == "prompt"
    s.add_request(make_request("big-premium", 24, tier=Tier.PREMIUM))


def test_empty_prompt_and_duplicate_id_are_rejected():
    s = make_scheduler()
    with pytest.raises(ValidationError):
        s.add_request(make_request("e", 0))
    s.add_request(make_request("x"))
    with pytest.raises(ValidationError):
        s.add_request(make_request("x"))


@pytest.mark.parametrize("state", ["waiting", "prefilling", "decoding", "preempted"])
def test_abort_in_every_state_frees_everything(state):
    num_blocks = 2 if state == "preempted" else 4
    s = make_scheduler(num_blocks=num_blocks, block_size=4, budget=4)
    s.add_request(make_request("victim", 8 if state == "prefilling" else 4, max_tokens=100))
    if state in ("prefilling", "decoding", "preempted"):
        step(s)
    if state == "decoding":
        step(s)
        assert s.requests["victim"].output_token_ids
    if state == "preempted":
        s.add_request(make_request("p", 4, tier=Tier.PREMIUM, max_tokens=100))
        step(s)
        assert s.requests["victim"].status is RequestStatus.PREEMPTED
    ended = s.abort("victim")
    assert [r.finish_reason for r in ended] == [FinishReason.ABORT]
    assert "victim" not in s.requests
    assert not s.kv.has_blocks("victim")
    assert all(r.request_id != "victim" for q in s.waiting.values() for r in q)
    s.abort("p")
    assert s.kv.num_free_blocks() == num_blocks
    s.kv.check_invariants()


def test_abort_after_schedule_is_still_billed():
    s = make_scheduler()
    s.add_request(make_request("a", 8))
    out = s.schedule()
    s.abort("a")
    result = s.update(out, run_output(out))
    assert [u.prompt_tokens_computed for u in result.usage.requests] == [8]
    assert result.updates == []


def test_stop_conditions():
    s = make_scheduler()
    s.add_request(make_request("eos", 4, max_tokens=10))
    _, res = step(s, token=0)
    assert res.updates[0].finish_reason is FinishReason.STOP
    s.add_request(make_request("min", 4, max_tokens=10, min_tokens=2))
    _, res = step(s, token=0)
    assert res.updates[0].finish_reason is None
    s.add_request(make_request("len", 4, max_tokens=1))
    _, res = step(s)
    assert {u.request_id: u.finish_reason for u in res.updates}["len"] is FinishReason.LENGTH
    s.add_request(make_request("ids", 4, max_tokens=10, stop_token_ids=[9]))
    _, res = step(s, token=9)
    assert {u.request_id: u.finish_reason for u in res.updates}["ids"] is FinishReason.STOP


def test_n_forks_children_that_share_prompt_blocks():
    s = make_scheduler(num_blocks=20, block_size=4)
    s.add_request(make_request("g", 6, n=3, max_tokens=3))
    out, res = step(s)
    assert out.requests[0].num_samples == 3
    assert sorted(u.request_id for u in res.updates) == ["g", "g#1", "g#2"]
    tables = [s.kv.block_table(r) for r in ("g", "g#1", "g#2")]
    assert tables[0] == tables[1] == tables[2]
    out, _ = step(s)
    # Each child writes into the shared, partly filled last block: copy-on-write.
    assert len(out.copies) == 2
    tables = [s.kv.block_table(r) for r in ("g", "g#1", "g#2")]
    assert tables[0][0] == tables[1][0] == tables[2][0]  # the full first block stays shared
    assert len({t[1] for t in tables}) == 3
    s.kv.check_invariants()


def test_usage_record_splits_tokens():
    s = make_scheduler(budget=6, block_size=4)
    s.add_request(make_request("a", 8, max_tokens=3))
    _, r1 = step(s)
    _, r2 = step(s)
    _, r3 = step(s)
    get = lambda r: r.usage.requests[0]  # noqa: E731
    assert (get(r1).prompt_tokens_computed, get(r1).decode_tokens) == (6, 0)
    assert (get(r2).prompt_tokens_computed, get(r2).decode_tokens) == (2, 0)
    assert (get(r3).prompt_tokens_computed, get(r3).decode_tokens) == (0, 1)
    assert r1.usage.busy_time_us == 1000


def test_prefix_hit_is_reported_once_as_cached():
    s = make_scheduler(budget=100, block_size=4)
    s.add_request(make_request("a", 10, max_tokens=1, first_token=1))
    step(s)
    s.add_request(make_request("b", 10, max_tokens=2, first_token=1))
    out, res = step(s)
    assert slices(out) == {"b": 2}
    u = res.usage.requests[0]
    assert (u.prompt_tokens_cached, u.prompt_tokens_computed) == (8, 2)
    _, res = step(s)
    assert res.usage.requests[0].prompt_tokens_cached == 0
