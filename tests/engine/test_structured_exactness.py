"""Structured output leaves what it does not constrain alone, and survives
preemption: on the tiny random Llama (SmolLM2's tokenizer, so the grammars
are real), against HF transformers' greedy output and against each request
run alone.
"""

from __future__ import annotations

import json
import re

import jsonschema
import pytest

from engine import LLM, SamplingParams
from engine.structured.spec import StructuredSpec
from tests.engine.test_exactness import GREEDY, NEW_TOKENS, hf_greedy, make_prompts

PERSON = {
    "type": "object",
    "properties": {"name": {"type": "string", "maxLength": 10},
                   "age": {"type": "integer", "minimum": 0, "maximum": 99}},
    "required": ["name", "age"],
    "additionalProperties": False,
}
# SmolLM2 spells every digit as its own token, so these are 40 tokens and
# more: long enough to be preempted in the middle.
DIGITS = r"[0-9]{40}"
TICKET = {
    "type": "object",
    "properties": {"code": {"type": "string", "pattern": "^[0-9]{40}$"},
                   "name": {"type": "string", "maxLength": 10}},
    "required": ["code", "name"],
    "additionalProperties": False,
}


@pytest.fixture(scope="module")
def prompts():
    return make_prompts()[:8]


@pytest.fixture(scope="module")
def expected(tiny_llama_dir, prompts):
    return hf_greedy(tiny_llama_dir, prompts)


def constrained(spec: StructuredSpec, i: int, max_tokens: int = 64) -> SamplingParams:
    """Greedy for even i, seeded sampling for odd i."""
    if i % 2 == 0:
        return SamplingParams(temperature=0.0, max_tokens=max_tokens, structured=spec)
    return SamplingParams(temperature=1.0, seed=100 + i, max_tokens=max_tokens, structured=spec)


def test_unconstrained_rows_beside_constrained_ones_equal_hf(tiny_llama_dir, prompts, expected):
    llm = LLM(str(tiny_llama_dir), num_threads=2)
    spec = StructuredSpec.json_schema(PERSON)
    params = [GREEDY] * len(prompts) + [constrained(spec, i) for i in range(len(prompts))]
    outs = llm.generate(prompts + prompts, params)
    assert [o.outputs[0].token_ids for o in outs[:len(prompts)]] == expected
    for o in outs[len(prompts):]:
        assert o.outputs[0].finish_reason == "stop"
        jsonschema.validate(json.loads(o.outputs[0].text), PERSON)
    # The same engine, its grammar stage now built, still matches HF alone.
    assert [o.outputs[0].token_ids for o in llm.generate(prompts, GREEDY)] == expected


def test_a_grammar_that_admits_the_greedy_tokens_changes_nothing(tiny_llama_dir, prompts, expected):
    """The mask only forbids: a grammar that admits any text leaves every
    ordinary token's logit as it was, so the output is HF's, token for token.
    (A grammar that forces bytes is no such test: there llguidance admits
    only the canonical tokenization of the forced text.)"""
    llm = LLM(str(tiny_llama_dir), num_threads=2)
    special = set(llm.tokenizer.all_special_ids)
    assert not special & {t for ids in expected for t in ids}
    any_text = StructuredSpec.regex(r"(?s:.)*")
    # ignore_eos, not min_tokens (refused with a grammar): EOS stays allowed,
    # so were it the greedy choice anywhere here, the comparison would show it.
    params = [SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, ignore_eos=True, structured=any_text),
              GREEDY]
    outs = llm.generate([p for p in prompts for _ in params], params * len(prompts))
    assert [o.outputs[0].token_ids for o in outs[0::2]] == expected
    assert [o.outputs[0].token_ids for o in outs[1::2]] == expected


def _run_alone(model_dir, prompts, params) -> list[list[int]]:
    llm = LLM(str(model_dir), num_threads=2)
    return [llm.generate(p, sp)[0].outputs[0].token_ids for p, sp in zip(prompts, params)]


@pytest.mark.parametrize("spec", [StructuredSpec.regex(DIGITS), StructuredSpec.json_schema(TICKET)],
                         ids=["digits", "json"])
def test_preempted_constrained_requests_resume_exactly(tiny_llama_dir, prompts, spec):
    params = [constrained(spec, i) for i in range(len(prompts))]
    alone = _run_alone(tiny_llama_dir, prompts, params)

    # 40 blocks of 16 tokens hold the longest prompt (~450) and its output, not all at once.
    llm = LLM(str(tiny_llama_dir), num_threads=2, num_kv_blocks=40, enable_prefix_caching=False)
    engine = llm.engine
    preempted_mid_decode = set()

    def note_preemptions(usage):
        for p in usage.preemptions:
            victim = engine.scheduler.requests.get(p.victim_id)
            if victim is not None and victim.output_token_ids:
                preempted_mid_decode.add(p.victim_id)

    engine.usage_sinks.append(note_preemptions)
    ids = [engine.add_request(p, sp) for p, sp in zip(prompts, params)]
    done = {}
    while engine.has_unfinished():
        done.update((o.request_id, o) for o in engine.step(final_only=True) if o.finished)
    assert preempted_mid_decode, "nothing was preempted after it had started to decode"
    assert any(int(i.split("-")[1]) % 2 for i in preempted_mid_decode), "no sampled request was preempted"
    got = [done[i].outputs[0] for i in ids]
    assert [c.token_ids for c in got] == alone
    for c in got:
        assert c.finish_reason == "stop"
        if spec.kind.value == "regex":
            assert re.fullmatch(DIGITS, c.text)
        else:
            jsonschema.validate(json.loads(c.text), TICKET)
    assert engine.scheduler.kv.num_free_blocks() == 40
    engine.step()  # an ended sequence's state is dropped with the next step
    assert len(engine.core.runner.grammar) == 0


def test_constraints_hold_with_an_adapter_a_stop_string_and_the_premium_tier(tiny_llama_dir, prompts, tmp_path):
    from tests.adapters.conftest import build_peft_adapter

    adapter_dir = tmp_path / "lora"
    build_peft_adapter(tiny_llama_dir, adapter_dir, seed=5, r=4, lora_alpha=16,
                       target_modules=["q_proj", "v_proj", "o_proj"])
    llm = LLM(str(tiny_llama_dir), data_dir=str(tmp_path / "data"), max_loras=1, max_lora_rank=8)
    llm.adapters.import_dir("lora", adapter_dir)
    spec = StructuredSpec.regex(r"[0-9]{12}")
    free = SamplingParams(temperature=0.0, max_tokens=40, structured=spec)
    with_lora = [o.outputs[0].text for o in llm.generate(prompts, free, adapter="lora", tier="premium")]
    base = [o.outputs[0].text for o in llm.generate(prompts, free)]
    assert all(re.fullmatch(r"[0-9]{12}", t) for t in with_lora + base), with_lora + base
    assert with_lora != base, "the adapter changed nothing under the constraint"
    # A stop string cuts the constrained output where it first appears.
    stop = SamplingParams(temperature=0.0, max_tokens=40, structured=spec, stop=["7"])
    cut = [o.outputs[0].text for o in llm.generate(prompts, stop, adapter="lora", tier="premium")]
    assert any("7" in t for t in with_lora), "no output to cut: pick another stop string"
    assert cut == [t.split("7")[0] for t in with_lora]
