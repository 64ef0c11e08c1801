"""Metering with speculative decoding: drafts are compute of the request
that drafted them, accepted or not, and busy time is still conserved
exactly, preemption and recompute included.

Ground truth is the scheduler's slices: each step's busy time split by the
tokens each slice carried ([last token] + drafts for a drafting one)."""

from __future__ import annotations

from collections import Counter

from billing.meter import Account, Meter
from engine import LLM
from engine.step_io import split_exact
from tests.engine.spec_decode.test_spec_exactness import GREEDY, SPEC, mixed_prompts, with_oracle


def test_drafts_are_charged_to_their_request_and_busy_time_is_conserved(tiny_llama_dir):
    prompts = mixed_prompts()
    plain = LLM(str(tiny_llama_dir)).generate(prompts, GREEDY)
    llm = with_oracle(LLM(str(tiny_llama_dir), num_kv_blocks=40, enable_prefix_caching=False, **SPEC), plain)
    engine, meter = llm.engine, Meter()
    truth_us: Counter[str] = Counter()
    truth_tokens: Counter[str] = Counter()
    steps = []

    def record(usage) -> None:
        sched = engine.core.last_schedule  # the step this usage is of
        weights = [item.num_tokens for item in sched.requests]
        for item, us in zip(sched.requests, split_exact(usage.busy_time_us, weights)):
            truth_us[item.group_id] += us
            truth_tokens[item.group_id] += item.num_tokens
        steps.append(usage)

    engine.usage_sinks += [meter.on_step, record]
    ids = [f"r{i}" for i in range(len(prompts))]
    for rid, prompt in zip(ids, prompts):
        meter.register(rid, Account(tenant_id="t", tenant="t", key_id=None, tier="standard"))
        engine.add_request(prompt, GREEDY, request_id=rid)
    while engine.has_unfinished():
        engine.step()
    settled = {rid: meter.settle(rid) for rid in ids}

    stats = engine.scheduler.speculation.stats
    assert 0 < stats.num_accepted_tokens < stats.num_draft_tokens  # some drafts were rejected
    assert any(s.preemptions for s in steps)
    busy = sum(s.busy_time_us for s in steps)
    charged = sum(u.gpu_us + sum(c.recompute_us for c in u.recompute_charges) for u in settled.values())
    assert charged + meter.take_overhead_us() == busy  # exact
    for rid, usage in settled.items():
        assert usage.computed_tokens == truth_tokens[rid]
        assert usage.gpu_us + sum(c.recompute_us for c in usage.recompute_charges) == truth_us[rid]
    # Rejected drafts are billed: more positions computed than the tokens the
    # requests hold, beyond what recompute after preemption explains.
    recomputed = sum(r.recomputed_tokens for s in steps for r in s.requests)
    held = sum(len(o.prompt_token_ids) + len(o.outputs[0].token_ids) - 1 for o in plain)
    assert sum(truth_tokens.values()) - recomputed > held
