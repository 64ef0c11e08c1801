"""Speculative decoding changes no output: greedy (and seeded) tokens with
drafts are the ones plain decoding gives, batched, with adapters, under
preemption by recompute, with stop strings; and drafts were accepted, so
the runs really were speculative.

The tiny random Llama never copies its context, so n-gram drafts would all
be rejected there. Its tests draft from the plain run instead (an oracle
that is right, half right or wrong by turns), which drives the verifier
through accept-all, accept-some and accept-none steps and leaves rejected
drafts' KV behind; the n-gram proposer itself meets the real SmolLM2 on a
prompt it copies."""

from __future__ import annotations

import pytest

from engine import LLM, SamplingParams
from tests.engine.test_exactness import make_prompts

NEW_TOKENS = 32
GREEDY = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, min_tokens=NEW_TOKENS)
SPEC = dict(speculative="ngram", num_speculative_tokens=4, speculative_disable_batch_size=64)
_TEXT = ("Paged attention stores keys and values in fixed-size blocks, and a scheduler decides "
         "which requests run in each step.")


def mixed_prompts() -> list[str]:
    """The exactness prompts, and prompts whose answer copies them."""
    copies = [f"Repeat this text exactly: {_TEXT}\nRepeated: {_TEXT[:40]}",
              f"{_TEXT} {_TEXT} {_TEXT}", "one two three one two three one two three one two"]
    return make_prompts()[:10] + copies


class OracleProposer:
    """Drafts the plain run's next tokens, spoiled by turns: all right, one
    wrong in the middle, the first wrong."""

    def __init__(self, outs, vocab_size: int):
        self.seqs = [o.prompt_token_ids + o.outputs[0].token_ids for o in outs]
        self.vocab_size = vocab_size

    def propose(self, tokens: list[int], k: int) -> list[int]:
        n = len(tokens)
        seq = next((s for s in self.seqs if len(s) > n and s[:n] == tokens), None)
        if seq is None:
            return []
        draft = seq[n:n + k]
        spoil = {0: None, 1: len(draft) // 2, 2: 0}[n % 3]
        if spoil is not None:
            draft[spoil] = (draft[spoil] + 1) % self.vocab_size
        return draft


def with_oracle(llm: LLM, reference) -> LLM:
    llm.engine.scheduler.speculation.proposer = OracleProposer(reference, llm.engine.vocab_size)
    return llm


def tokens_of(outs) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in outs]


def accepted(llm: LLM) -> int:
    return llm.engine.scheduler.speculation.stats.num_accepted_tokens


@pytest.fixture(scope="module")
def plain(tiny_llama_dir):
    return LLM(str(tiny_llama_dir)).generate(mixed_prompts(), GREEDY)


def test_batched_greedy_output_is_unchanged(tiny_llama_dir, plain):
    llm = with_oracle(LLM(str(tiny_llama_dir), **SPEC), plain)
    assert tokens_of(llm.generate(mixed_prompts(), GREEDY)) == tokens_of(plain)
    stats = llm.engine.scheduler.speculation.stats
    assert 0 < stats.num_accepted_tokens < stats.num_draft_tokens
    assert llm.engine.scheduler.kv.num_free_blocks() == llm.engine.scheduler.kv.block_pool.num_blocks
    # The real proposer on the same batch: nothing to accept, nothing changed.
    ngram = LLM(str(tiny_llama_dir), **SPEC)
    assert tokens_of(ngram.generate(mixed_prompts(), GREEDY)) == tokens_of(plain)


def test_greedy_output_is_unchanged_under_preemption(tiny_llama_dir, plain):
    llm = with_oracle(LLM(str(tiny_llama_dir), num_kv_blocks=40, enable_prefix_caching=False, **SPEC), plain)
    assert tokens_of(llm.generate(mixed_prompts(), GREEDY)) == tokens_of(plain)
    assert sum(llm.engine.scheduler.num_preemptions.values()) > 0
    assert accepted(llm) > 0
    assert llm.engine.scheduler.kv.num_free_blocks() == 40


def test_greedy_output_is_unchanged_with_adapters(tiny_llama_dir, tmp_path):
    from tests.adapters.conftest import build_peft_adapter

    build_peft_adapter(tiny_llama_dir, tmp_path / "lora", seed=5, r=4, lora_alpha=16,
                       target_modules=["q_proj", "v_proj", "o_proj"])
    prompts = mixed_prompts()
    per_prompt = ["lora" if i % 2 else None for i in range(len(prompts))]
    outs = {}
    for name, extra in (("plain", {}), ("spec", SPEC)):
        llm = LLM(str(tiny_llama_dir), data_dir=str(tmp_path / name), max_loras=1, max_lora_rank=8, **extra)
        llm.adapters.import_dir("lora", tmp_path / "lora")
        if extra:
            with_oracle(llm, outs["plain"])
        outs[name] = llm.generate(prompts, GREEDY, adapters=per_prompt)
    assert tokens_of(outs["spec"]) == tokens_of(outs["plain"])
    assert accepted(llm) > 0


def test_seeded_sampling_min_tokens_logprobs_and_stop_strings_are_unchanged(tiny_llama_dir):
    prompts = mixed_prompts()
    # Top-3 of a flat random model: over its whole vocabulary float noise
    # (the slice shapes differ) moves CDF boundaries by more than some
    # tokens' width, and plain decoding is not batch-invariant there either.
    params = [SamplingParams(temperature=1.0, top_k=3, seed=100 + i, max_tokens=NEW_TOKENS, min_tokens=8,
                             logprobs=2) for i in range(len(prompts))]
    # Greedy with stop strings: a run may pass the token that completes one.
    params[-3:] = [SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, stop=["three", "es", " in"])] * 3
    runs, plain = {}, None
    for name, extra in (("plain", {}), ("spec", SPEC)):
        llm = LLM(str(tiny_llama_dir), **extra)
        if extra:
            with_oracle(llm, plain)
        plain = llm.generate(prompts, params)
        runs[name] = [o.outputs[0] for o in plain]
    assert [c.token_ids for c in runs["spec"]] == [c.token_ids for c in runs["plain"]]
    not_argmax = sum(t.token_id != t.top_logprobs[0][0] for c in runs["plain"] for t in c.logprobs or [])
    assert not_argmax > 10, "the seeded runs must really sample"
    assert [c.text for c in runs["spec"]] == [c.text for c in runs["plain"]]
    assert any(c.finish_reason == "stop" for c in runs["plain"][-3:]), "no stop string matched"
    for spec, plain in zip(runs["spec"], runs["plain"]):
        for a, b in zip(spec.logprobs or [], plain.logprobs or []):
            assert a.logprob == pytest.approx(b.logprob, abs=1e-4)
            assert [t for t, _ in a.top_logprobs] == [t for t, _ in b.top_logprobs]
    assert accepted(llm) > 0


@pytest.mark.smollm
def test_smollm_copying_a_text_accepts_drafts_and_changes_nothing(smollm_dir):
    prompt = [{"role": "user", "content": f"Repeat this sentence word for word, twice: {_TEXT}"}]
    params = SamplingParams(temperature=0.0, max_tokens=64)
    plain = LLM(str(smollm_dir)).chat(prompt, params)[0].outputs[0].token_ids
    llm = LLM(str(smollm_dir), **SPEC)
    assert llm.chat(prompt, params)[0].outputs[0].token_ids == plain
    stats = llm.engine.scheduler.speculation.stats
    assert stats.num_accepted_tokens >= len(plain) // 4, stats
