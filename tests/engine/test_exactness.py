"""Greedy output is token-for-token identical to HF transformers `generate`.

Both sides run float32 on the same safetensors weights. EOS is suppressed on
both sides (HF `min_new_tokens`, our `min_tokens`) so every prompt produces
exactly NEW_TOKENS tokens and the comparison covers all of them.
"""

from __future__ import annotations

import pytest
import torch

from engine import LLM, SamplingParams

NEW_TOKENS = 24

_SENTENCES = [
    "The quick brown fox jumps over the lazy dog.",
    "Paged attention stores keys and values in fixed-size blocks.",
    "A scheduler decides which requests run in each step.",
    "Continuous batching admits new work as soon as a sequence finishes.",
    "Prefix caching lets requests reuse the keys of a shared system prompt.",
    "The river bends twice before it reaches the old mill by the bridge.",
    "Write a short poem about autumn leaves falling in the park.",
    "Explain why the sky is blue in two sentences.",
]


def make_prompts() -> list[str]:
    """16 prompts from a few words to ~450 tokens, crossing block boundaries."""
    prompts = ["Hello", "Why is the sky blue?"]
    for i in range(2, 16):
        repeats = [1, 2, 3, 5, 8, 13, 21, 34][i % 8] if i % 3 else 1 + i
        body = " ".join(_SENTENCES[(i + j) % len(_SENTENCES)] for j in range(repeats))
        prompts.append(f"Question {i}: {body} Answer:")
    return prompts


def hf_greedy(model_dir, prompts: list[str]) -> list[list[int]]:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    outs = []
    with torch.inference_mode():
        for p in prompts:
            ids = tok(p, return_tensors="pt").input_ids
            gen = model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False,
                                 max_new_tokens=NEW_TOKENS, min_new_tokens=NEW_TOKENS,
                                 pad_token_id=tok.eos_token_id)
            outs.append(gen[0, ids.shape[1]:].tolist())
    return outs


GREEDY = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, min_tokens=NEW_TOKENS)


@pytest.fixture(scope="module", params=["tiny", pytest.param("smollm", marks=pytest.mark.smollm)])
def case(request):
    model_dir = request.getfixturevalue("tiny_llama_dir" if request.param == "tiny" else "smollm_dir")
    prompts = make_prompts()
    return model_dir, prompts, hf_greedy(model_dir, prompts)


def _tokens(outs) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in outs]


def test_prompts_cross_block_boundaries(case):
    model_dir, prompts, _ = case
    llm = LLM(str(model_dir), num_kv_blocks=64)
    lengths = [len(llm.engine.tokenize(p)) for p in prompts]
    assert max(lengths) > 300 and min(lengths) < 16
    assert len({n // 16 for n in lengths}) > 5


def test_one_request_at_a_time(case):
    model_dir, prompts, expected = case
    llm = LLM(str(model_dir))
    got = [llm.generate(p, GREEDY)[0].outputs[0].token_ids for p in prompts]
    assert got == expected


def test_continuous_batching(case):
    model_dir, prompts, expected = case
    llm = LLM(str(model_dir))
    assert _tokens(llm.generate(prompts, GREEDY)) == expected


def test_chunked_prefill_with_tiny_budget(case):
    model_dir, prompts, expected = case
    llm = LLM(str(model_dir), max_num_batched_tokens=37)
    assert _tokens(llm.generate(prompts, GREEDY)) == expected


def test_prefix_cache_second_pass(case):
    model_dir, prompts, expected = case
    llm = LLM(str(model_dir))
    assert _tokens(llm.generate(prompts, GREEDY)) == expected
    second = llm.generate(prompts, GREEDY)
    assert _tokens(second) == expected
    long_ones = [o for o in second if len(o.prompt_token_ids) >= 32]
    assert long_ones and all(o.num_cached_tokens >= 16 for o in long_ones)


def test_preemption_by_recompute(case):
    model_dir, prompts, expected = case
    # 40 blocks of 16 tokens hold the longest request, but not all of them at once.
    llm = LLM(str(model_dir), num_kv_blocks=40, enable_prefix_caching=False)
    assert _tokens(llm.generate(prompts, GREEDY)) == expected
    assert sum(llm.engine.scheduler.num_preemptions.values()) > 0
    assert llm.engine.scheduler.kv.num_free_blocks() == 40



def _run(engine, prompts, tiers, interrupt) -> list[list[int]]:
    ids = [engine.add_request(p, GREEDY, tier=t) for p, t in zip(prompts, tiers)]
    done = {}
    while engine.has_unfinished():
        done.update((o.request_id, o.outputs[0].token_ids) for o in engine.step(final_only=True, interrupt=interrupt))
    return [done[i] for i in ids]


def test_steps_dropped_for_premium_change_no_token(case):
    """Steps dropped at every point the runner allows, twice over the
    prompts (the second pass on prefix hits): outputs as HF's; every
    request billed its prompt and decode tokens once; dropped steps billed
    to no request."""
    model_dir, prompts, expected = case
    llm = LLM(str(model_dir), max_num_batched_tokens=64)
    engine = llm.engine
    usage = []
    engine.usage_sinks.append(usage.append)
    asks = iter(range(10**9))
    interrupt = lambda: next(asks) % 3 == 0  # noqa: E731 - drops steps at layer 0, 1, ...
    tiers = ["premium" if i % 5 == 0 else "standard" for i in range(len(prompts))]
    assert _run(engine, prompts, tiers, interrupt) == expected
    assert _run(engine, prompts, tiers, interrupt) == expected

    dropped = [u for u in usage if not u.requests]
    assert len(dropped) > 5 and engine.scheduler.num_steps_dropped == len(dropped)
    per_request: dict[str, list[int]] = {}
    for u in usage:
        for r in u.requests:
            totals = per_request.setdefault(r.request_id, [0, 0])
            totals[0] += r.prompt_tokens_computed + r.prompt_tokens_cached
            totals[1] += r.decode_tokens
    assert sorted(t[0] for t in per_request.values()) == sorted([len(engine.tokenize(p)) for p in prompts] * 2)
    assert all(t[1] == NEW_TOKENS - 1 for t in per_request.values())
    kv = engine.scheduler.kv
    assert kv.usage().num_used == 0


def test_the_runner_drops_only_within_the_share_and_reports_what_had_run(case):
    """A step asked to stop before layer k drops there, when k is within
    its droppable share, and says that k of n layers had run; past the
    share it is not asked and completes."""
    model_dir, prompts, _ = case
    engine = LLM(str(model_dir), max_num_batched_tokens=64).engine
    runner, scheduler = engine.core.runner, engine.scheduler
    n = runner.model.num_layers
    engine.add_request(prompts[0], GREEDY)
    for share, stop_at, drops in ((1.0, n - 1, True), (0.5, n // 2, True), (0.5, n // 2 + 1, False)):
        sched = scheduler.schedule()
        sched.droppable_share = share
        asked = []
        out = runner.execute(sched, lambda: asked.append(1) or len(asked) > stop_at)
        assert out.interrupted is drops and len(asked) == min(stop_at + 1, int(share * n) + 1)
        if drops:
            assert out.share_done == stop_at / n and not out.sampled
            scheduler.interrupted(sched, out)
        else:
            assert out.sampled
            scheduler.update(sched, out)


def test_a_premium_prompt_gets_no_hit_on_what_a_dropped_step_was_to_fill(case):
    model_dir, prompts, expected = case
    engine = LLM(str(model_dir), max_num_batched_tokens=64).engine
    long_prompt = max(prompts, key=len)
    first = engine.add_request(long_prompt, GREEDY)
    assert engine.step(interrupt=lambda: True) == []
    assert engine.core.last_schedule.droppable_share > 0
    done = {}
    second = engine.add_request(long_prompt, GREEDY, tier="premium")
    while engine.has_unfinished():
        done.update((o.request_id, o.outputs[0].token_ids) for o in engine.step(final_only=True))
    assert done[first] == done[second] == expected[prompts.index(long_prompt)]
