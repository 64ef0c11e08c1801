"""The scheduler with speculative decoding, driven by hand-built runner
outputs: what a speculating slice carries, how verified runs advance a
request, and what never happens to rejected drafts' KV."""

from __future__ import annotations

import itertools

from engine.block_hash import hash_full_blocks
from engine.config import SpeculativeConfig
from engine.request import FinishReason, Request, RequestStatus
from engine.sampling_params import SamplingParams
from engine.spec_decode.policy import SpeculationPolicy
from engine.step_io import RequestStepUsage, RunnerOutput, SampledToken, SchedulerOutput
from engine.structured.spec import StructuredSpec
from tests.engine.sched_helpers import EOS, make_request, make_scheduler

PATTERN = [11, 12, 13, 14]
_arrivals = itertools.count(10_000)


def spec_scheduler(k=3, disable_batch_size=8, min_n=1, **kwargs):
    s = make_scheduler(**kwargs)
    s.speculation = SpeculationPolicy(SpeculativeConfig(
        speculative="ngram", num_speculative_tokens=k, prompt_lookup_min=min_n,
        speculative_disable_batch_size=disable_batch_size))
    return s


def repetitive(rid: str, *, repeats=3, max_tokens=20, temperature=0.0, **params) -> Request:
    """A prompt that repeats PATTERN, so its continuation drafts PATTERN."""
    return Request(request_id=rid, prompt_token_ids=PATTERN * repeats,
                   sampling_params=SamplingParams(max_tokens=max_tokens, temperature=temperature, **params),
                   arrival_seq=next(_arrivals), eos_token_ids=frozenset({EOS}))


def runner_output(out: SchedulerOutput, runs: dict[str, list[int]] | None = None, token=7) -> RunnerOutput:
    """Plain sampling slices draw `token`; a drafting slice emits runs[id]
    (default: every draft accepted, then `token` as the bonus)."""
    sampled = {}
    for r in out.requests:
        if not r.sample:
            continue
        if r.draft_token_ids:
            run = (runs or {}).get(r.request_id, r.draft_token_ids + [token])
            sampled[r.request_id] = [SampledToken(t) for t in run]
        else:
            sampled[r.request_id] = [SampledToken(token + j) for j in range(r.num_samples)]
    return RunnerOutput(sampled=sampled, busy_time_us=1000)


def prefill(s, *reqs, token=PATTERN[0]):
    """Admit and prefill `reqs`; each samples `token` (the pattern goes on)."""
    for req in reqs:
        s.add_request(req)
    while any(not r.output_token_ids for r in reqs):  # chunks, with a small budget
        out = s.schedule()
        assert not any(r.draft_token_ids for r in out.requests)
        s.update(out, runner_output(out, token=token))


def first_draft(k=3):
    """One repetitive request, prefilled, and its first drafting step: the
    scheduler, the request, the position of its last token, the step."""
    s = spec_scheduler(k=k)
    req = repetitive("a")
    prefill(s, req)
    start = req.num_tokens - 1
    return s, req, start, s.schedule()


def by_id(out: SchedulerOutput):
    return {r.request_id: r for r in out.requests}


def test_a_decode_slice_carries_the_last_token_and_its_drafts():
    s = spec_scheduler(k=3)
    req = repetitive("a")
    prefill(s, req)
    out = s.schedule()
    item = by_id(out)["a"]
    assert item.draft_token_ids == PATTERN[1:4]
    assert item.token_ids == [PATTERN[0]] + PATTERN[1:4]
    assert item.start_pos == req.num_tokens - 1 and item.sample
    assert len(s.kv.block_table("a")) * s.block_size >= item.start_pos + 4  # slots for every draft
    assert out.num_batched_tokens == 4


def test_all_accepted_advances_by_the_run_and_counts_the_bonus_token():
    s, req, start, out = first_draft()
    result = s.update(out, runner_output(out, {"a": [12, 13, 14, 11]}))
    assert [t.token_id for t in result.updates[0].new_tokens] == [12, 13, 14, 11]
    assert req.output_token_ids == [11, 12, 13, 14, 11]
    assert req.num_computed_tokens == start + 4  # the last token and three drafts
    assert req.num_remaining_tokens == 1
    stats = s.speculation.stats
    assert (stats.num_drafts, stats.num_draft_tokens, stats.num_accepted_tokens) == (1, 3, 3)


def test_some_and_none_accepted():
    s, req, start, out = first_draft()
    s.update(out, runner_output(out, {"a": [12, 14]}))  # one accepted, then a correction
    assert req.output_token_ids == [11, 12, 14]
    assert req.num_computed_tokens == start + 2
    out = s.schedule()
    item = by_id(out)["a"]
    assert item.start_pos == start + 2 and item.token_ids[0] == 14
    assert item.draft_token_ids == [11, 12, 14]  # after the latest earlier 14: the tokens just output
    s.update(out, runner_output(out, {"a": [98]}))
    assert req.output_token_ids[-1] == 98
    assert req.num_computed_tokens == start + 3  # only the last token: every draft rejected
    s.kv.check_invariants()
    stats = s.speculation.stats
    assert (stats.num_drafts, stats.num_draft_tokens, stats.num_accepted_tokens) == (2, 6, 1)


def test_eos_and_stop_tokens_inside_a_run_end_it_there():
    s = spec_scheduler(k=3)
    a, b = repetitive("a"), repetitive("b", stop_token_ids=[13])
    prefill(s, a, b)
    out = s.schedule()
    result = s.update(out, runner_output(out, {"a": [12, EOS], "b": [12, 13, 14, 11]}))
    ups = {u.request_id: u for u in result.updates}
    assert [t.token_id for t in ups["a"].new_tokens] == [12, EOS]
    assert ups["a"].finish_reason is FinishReason.STOP
    assert [t.token_id for t in ups["b"].new_tokens] == [12, 13]  # cut at the stop token
    assert ups["b"].finish_reason is FinishReason.STOP
    assert b.output_token_ids == [11, 12, 13]
    assert not s.has_unfinished() and s.kv.num_free_blocks() == 64


def test_drafts_never_pass_max_tokens_or_the_length_limit():
    s = spec_scheduler(k=4)
    req = repetitive("a", max_tokens=3)
    prefill(s, req)  # one token out, two to go: one draft at most
    out = s.schedule()
    assert by_id(out)["a"].draft_token_ids == [12]
    result = s.update(out, runner_output(out, {"a": [12, 13]}))
    assert result.updates[0].finish_reason is FinishReason.LENGTH
    assert req.output_token_ids == [11, 12, 13]

    s = spec_scheduler(k=4, max_model_len=16)
    req = repetitive("b", max_tokens=50)  # 12 prompt tokens, room for 4 in all
    prefill(s, req)
    out = s.schedule()
    assert by_id(out)["b"].draft_token_ids == [12, 13]  # 13 known + 2 drafts + 1 bonus = 16
    s.update(out, runner_output(out))
    assert req.num_tokens == 16 and req.finish_reason is FinishReason.LENGTH


def test_drafts_fit_the_token_budget_and_never_preempt():
    s = spec_scheduler(k=4, budget=3)
    req = repetitive("a")
    prefill(s, req)
    assert by_id(s.schedule())["a"].draft_token_ids == [12, 13]  # budget 3: last token + 2

    # One free block: the decode of the 13th token fits, its drafts would need a second.
    s = spec_scheduler(k=4, num_blocks=8, block_size=4)
    req = repetitive("b", repeats=3)  # 12 tokens: 3 full blocks
    prefill(s, req)
    s.kv.block_pool.allocate(s.kv.num_free_blocks() - 1)  # held by something else
    out = s.schedule()
    item = by_id(out)["b"]
    assert item.draft_token_ids == [] and item.num_tokens == 1
    assert not out.preemptions and req.status is RequestStatus.RUNNING


def test_speculation_is_off_for_a_step_above_the_batch_threshold():
    s = spec_scheduler(k=2, disable_batch_size=2)
    reqs = [repetitive(f"r{i}") for i in range(3)]
    prefill(s, *reqs)
    out = s.schedule()
    assert all(not r.draft_token_ids and r.num_tokens == 1 for r in out.requests)
    s.update(out, runner_output(out, token=PATTERN[1]))
    s.finish_request("r2", FinishReason.STOP)
    out = s.schedule()
    assert [len(r.draft_token_ids) for r in out.requests] == [2, 2]


def test_requests_that_cannot_be_verified_exactly_decode_plainly():
    s = spec_scheduler(k=2)
    grammar = StructuredSpec(kind="regex", source="[a-z]+")
    plain = [repetitive("pen", repetition_penalty=1.2), repetitive("freq", frequency_penalty=0.5),
             repetitive("grammar", structured=grammar), repetitive("n2", n=2)]
    prefill(s, repetitive("ok", min_tokens=5, logprobs=2, temperature=0.7, seed=3), *plain)
    out = s.schedule()
    drafted = {r.request_id for r in out.requests if r.draft_token_ids}
    assert drafted == {"ok", "n2", "n2#1"}  # n > 1 speculates once forked


def test_rejected_drafts_are_never_hashed_and_recompute_is_billed_by_valid_tokens():
    s = spec_scheduler(k=3, block_size=4, num_blocks=64)
    req = repetitive("a", max_tokens=40)
    prefill(s, req)
    for accept in (0, 0, 1, 0, 2, 0):  # mostly rejected: garbage KV past the valid tokens
        out = s.schedule()
        drafts = by_id(out)["a"].draft_token_ids
        assert len(drafts) > accept
        wrong = next(t for t in PATTERN if t != drafts[accept])  # drafting goes on from pattern tokens
        s.update(out, runner_output(out, {"a": drafts[:accept] + [wrong]}))
    s.kv.check_invariants()
    true_hashes = set(hash_full_blocks(req.all_token_ids, 4, (None, None)))
    held = [s.kv.block_pool.blocks[b].block_hash for b in s.kv.block_table("a")]
    assert all(h is None or h in true_hashes for h in held)
    assert req.computed_high_water == req.num_computed_tokens == req.num_tokens - 1

    # Preempted and readmitted: only the valid positions count as recompute.
    valid = req.num_computed_tokens
    s.kv.free(req)
    s.running.remove(req)
    req.status, req.num_computed_tokens = RequestStatus.PREEMPTED, 0
    s.waiting[req.tier].appendleft(req)
    s.kv.reset_prefix_cache()
    out = s.schedule()
    usage = RequestStepUsage.from_slice(by_id(out)["a"])
    assert usage.recomputed_tokens == valid
    assert usage.decode_tokens == 1  # the last known token, never computed before


def test_a_drafting_slice_bills_its_drafts_as_decode_tokens():
    s = spec_scheduler(k=3)
    req = repetitive("a")
    other = make_request("b", 8, max_tokens=30)
    prefill(s, req, other)
    out = s.schedule()
    result = s.update(out, runner_output(out, {"a": [99]}))  # every draft rejected
    usage = {u.request_id: u for u in result.usage.requests}
    assert usage["a"].decode_tokens == 4 and usage["a"].computed_tokens == 4
    assert usage["b"].computed_tokens == 1
