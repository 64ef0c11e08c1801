"""Preemption: who gives way to whom, premium's seats under a full
`max_num_seqs`, and what a preempted request keeps. Driven by hand-built
runner outputs, as tests/engine/test_scheduler.py."""

from __future__ import annotations

from engine.adapter_slots import AdapterSlotPolicy
from engine.request import RequestStatus, Tier
from tests.engine.sched_helpers import make_request, make_scheduler, slices, step


def _fill(s, specs, prompt_len=4):
    """Admits and prefills a request per spec: (id, tier) or (id, tier, adapter)."""
    for rid, tier, *adapter in specs:
        s.add_request(make_request(rid, prompt_len, tier=tier, max_tokens=100, adapter=(adapter or [None])[0]))
    step(s)


def _premium_arrive(s, rids, prompt_len=4, adapters=None, **params) -> None:
    for rid, adapter in zip(rids, adapters or [None] * len(rids)):
        s.add_request(make_request(rid, prompt_len, tier=Tier.PREMIUM, max_tokens=50, adapter=adapter, **params))


def _victims(out) -> list[tuple[str, str]]:
    return [(p.victim_id, p.caused_by) for p in out.preemptions]


def test_premium_takes_a_seat_from_the_newest_standard_when_max_num_seqs_is_full():
    s = make_scheduler(budget=64, max_seqs=2)
    s.add_request(make_request("s1", 4, max_tokens=50))
    s.add_request(make_request("s2", 4, max_tokens=50))
    step(s)
    s.add_request(make_request("p", 4, tier=Tier.PREMIUM, max_tokens=50))
    out, _ = step(s)
    assert _victims(out) == [("s2", "p")]
    assert slices(out) == {"s1": 1, "p": 4}
    assert [r.request_id for r in s.waiting[Tier.STANDARD]] == ["s2"]
    # With tiers off nobody takes a seat: premium waits like anyone else.
    s = make_scheduler(budget=64, max_seqs=2, tiers=False)
    s.add_request(make_request("s1", 4, max_tokens=50))
    s.add_request(make_request("s2", 4, max_tokens=50))
    step(s)
    s.add_request(make_request("p", 4, tier=Tier.PREMIUM, max_tokens=50))
    out, _ = step(s)
    assert not out.preemptions and slices(out) == {"s1": 1, "s2": 1}


def test_a_burst_of_premium_arrivals_takes_seats_together_when_max_num_seqs_is_full():
    # On an idle server two premium requests waiting together prefill in one
    # step; with every seat taken they must too, not one step after another.
    s = make_scheduler(budget=64, max_seqs=3)
    _fill(s, [("s1", Tier.STANDARD), ("s2", Tier.STANDARD), ("s3", Tier.STANDARD)])
    _premium_arrive(s, ["p1", "p2"])
    out, _ = step(s)
    assert _victims(out) == [("s3", "p1"), ("s2", "p2")]
    assert slices(out) == {"s1": 1, "p1": 4, "p2": 4}
    # Only as many as the step's budget reaches: a third prompt past it waits
    # for the next step, and no seat is taken for it before then.
    s = make_scheduler(budget=10, max_seqs=3)
    _fill(s, [("s1", Tier.STANDARD), ("s2", Tier.STANDARD), ("s3", Tier.STANDARD)])
    _premium_arrive(s, ["p1", "p2", "p3"], prompt_len=5)
    out, _ = step(s)
    assert _victims(out) == [("s3", "p1"), ("s2", "p2")]
    assert [r.request_id for r in s.waiting[Tier.PREMIUM]] == ["p3"]


def test_a_premium_burst_takes_no_seat_for_a_request_its_adapter_keeps_out():
    # Two adapter slots, one held by standard work on "a": the head takes the
    # other for "b", so "c" cannot run this step and nobody is preempted for it.
    s = make_scheduler(budget=64, max_seqs=2, max_loras=2)
    _fill(s, [("s1", Tier.STANDARD, "a"), ("s2", Tier.STANDARD, "a")])
    _premium_arrive(s, ["p1", "p2"], adapters=["b", "c"])
    out, _ = step(s)
    assert _victims(out) == [("s2", "p1")]
    assert slices(out) == {"s1": 1, "p1": 4}


def test_a_premium_burst_takes_no_seat_for_a_request_the_step_has_no_tokens_for():
    # The decodes take 3 of the 10 tokens and the head's prompt the rest:
    # a seat taken for p2 now would only have its holder recomputed.
    s = make_scheduler(budget=10, max_seqs=3)
    _fill(s, [("s1", Tier.STANDARD), ("s2", Tier.STANDARD), ("s3", Tier.STANDARD)], prompt_len=3)
    s.add_request(make_request("p1", 9, tier=Tier.PREMIUM, max_tokens=50))
    s.add_request(make_request("p2", 5, tier=Tier.PREMIUM, max_tokens=50))
    out, _ = step(s)
    assert _victims(out) == [("s3", "p1")]
    assert slices(out) == {"s1": 1, "s2": 1, "p1": 8}
    # A running premium prompt's chunk comes before admission too.
    s = make_scheduler(budget=16, max_seqs=4)
    _fill(s, [("s1", Tier.STANDARD), ("s2", Tier.STANDARD), ("s3", Tier.STANDARD)], prompt_len=3)
    s.add_request(make_request("pl", 40, tier=Tier.PREMIUM, max_tokens=50))
    out, _ = step(s)
    assert slices(out)["pl"] == 13  # 27 tokens of it left for the next step
    _premium_arrive(s, ["p1", "p2"])
    out, _ = step(s)
    assert [caused_by for _, caused_by in _victims(out)] == ["p1"]


def test_a_premium_burst_stops_at_a_request_whose_adapter_is_not_loaded():
    # Admission would stop at p2 with the seats full, so p3 gets no seat now.
    policy = AdapterSlotPolicy(4, 32, is_ready=lambda key: key != "loading")
    s = make_scheduler(budget=64, max_seqs=3, adapter_policy=policy)
    _fill(s, [("s1", Tier.STANDARD), ("s2", Tier.STANDARD), ("s3", Tier.STANDARD)])
    _premium_arrive(s, ["p1"])
    _premium_arrive(s, ["p2"], adapters=["loading"], n=2)
    _premium_arrive(s, ["p3"])
    out, _ = step(s)
    assert _victims(out) == [("s3", "p1")]
    assert slices(out) == {"s1": 1, "s2": 1, "p1": 4}


def test_a_premium_burst_counts_the_slot_its_head_takes_back():
    # Preempting s3 for p1's seat frees adapter a's slot, but p1 takes it
    # back: c has no slot this step, so nobody is preempted for p2.
    s = make_scheduler(budget=64, max_seqs=3, max_loras=2)
    _fill(s, [("s1", Tier.STANDARD, "x"), ("s2", Tier.STANDARD, "x"), ("s3", Tier.STANDARD, "a")])
    _premium_arrive(s, ["p1", "p2"], adapters=["a", "c"])
    out, _ = step(s)
    assert _victims(out) == [("s3", "p1")]


def test_preemption_victims_standard_first_newest_first_and_resume_at_head():
    # 4 blocks of 4: four 4-token prompts fill the pool, and every first
    # decode token needs a new block.
    s = make_scheduler(num_blocks=4, block_size=4, budget=100)
    _fill(s, [("p_old", Tier.PREMIUM), ("s_old", Tier.STANDARD),
              ("p_new", Tier.PREMIUM), ("s_new", Tier.STANDARD)])
    s.add_request(make_request("s_waiting", 4, max_tokens=100))
    out, _ = step(s)
    assert _victims(out) == [
        ("s_new", "p_old"), ("s_old", "p_new")]
    assert slices(out) == {"p_old": 1, "p_new": 1}
    assert s.num_preemptions == {Tier.PREMIUM: 0, Tier.STANDARD: 2}
    # Preempted requests sit at the head of the standard queue, older first,
    # ahead of the request that was already waiting.
    assert [r.request_id for r in s.waiting[Tier.STANDARD]] == ["s_old", "s_new", "s_waiting"]
    assert s.requests["s_old"].status is RequestStatus.PREEMPTED
    assert not s.kv.has_blocks("s_old")
    s.kv.check_invariants()


def test_standard_never_preempts_premium():
    # p's decode fits in its block; s needs a new one and may not take p's.
    s = make_scheduler(num_blocks=2, block_size=4, budget=100)
    s.add_request(make_request("p", 3, tier=Tier.PREMIUM, max_tokens=100))
    s.add_request(make_request("s", 4, max_tokens=100))
    step(s)
    out, _ = step(s)
    assert _victims(out) == [("s", None)]
    assert [r.request_id for r in s.running] == ["p"]


def test_waiting_premium_preempts_running_standard():
    s = make_scheduler(num_blocks=4, block_size=4, budget=100)
    _fill(s, [("s1", Tier.STANDARD), ("s2", Tier.STANDARD)])
    s.add_request(make_request("p", 12, tier=Tier.PREMIUM, max_tokens=5))
    out, _ = step(s)
    assert _victims(out) == [("s2", "p"), ("s1", "p")]
    assert slices(out) == {"p": 12}


def test_recompute_after_preemption_is_reported_and_output_kept():
    s = make_scheduler(num_blocks=3, block_size=4, budget=100, prefix_caching=False)
    _fill(s, [("p", Tier.PREMIUM), ("s", Tier.STANDARD)])
    step(s)  # p's decode takes the last block; s preempts itself
    assert s.requests["s"].status is RequestStatus.PREEMPTED
    assert s.requests["s"].output_token_ids == [7]
    s.abort("p")
    out, result = step(s)
    assert slices(out) == {"s": 5}  # prompt + kept output, recomputed together
    usage = result.usage.requests[0]
    assert (usage.recomputed_tokens, usage.prompt_tokens_computed, usage.decode_tokens) == (4, 0, 1)
    assert s.requests["s"].output_token_ids == [7, 7]
