"""The grammar machinery on SmolLM2's real tokenizer: spec limits, the
compiled-grammar cache (bounds, per-owner share, in-flight dedupe), the
logits mask against a token-by-token reference, and the engine's handling
of grammars that fail or take too long to compile (on the tiny Llama)."""

from __future__ import annotations

import json
import threading
from concurrent.futures import Future

import pytest
import torch

from engine import LLM, SamplingParams
from engine.errors import ValidationError
from engine.structured.grammar import GrammarCompiler, check_spec, make_tokenizer
from engine.structured.runtime import GrammarRuntime
from engine.step_io import ScheduledRequest
from engine.structured.spec import MAX_CHOICES, MAX_SCHEMA_DEPTH, MAX_SPEC_BYTES, StructuredSpec


@pytest.fixture(scope="module")
def hf_tokenizer(smollm_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(smollm_dir)


@pytest.fixture(scope="module")
def ll_tokenizer(hf_tokenizer):
    return make_tokenizer(hf_tokenizer, len(hf_tokenizer), frozenset([hf_tokenizer.eos_token_id]))


def regexes(n: int, tag: str = "") -> list[StructuredSpec]:
    return [StructuredSpec.regex(f"{tag}[a-z]{{{i + 1}}}") for i in range(n)]


def compile_all(compiler: GrammarCompiler, specs, owner: str | None = None) -> None:
    for spec in specs:
        compiler.submit(spec, owner).result(timeout=30)


@pytest.fixture
def pool_blocked():
    """Holds a compiler's only pool thread until released, so that what is
    submitted meanwhile is still compiling when the test looks."""
    release = threading.Event()
    yield lambda compiler: compiler._pool.submit(release.wait, 30)
    release.set()


# ---- StructuredSpec limits ------------------------------------------------------


def nested(depth: int) -> dict:
    """A schema `depth` JSON levels deep: arrays of arrays of ... strings."""
    schema: dict = {"type": "string"}
    for _ in range(depth - 1):
        schema = {"type": "array", "items": schema}
    return schema


@pytest.mark.parametrize("make, param", [
    (lambda: StructuredSpec.regex("a" * (MAX_SPEC_BYTES + 1), param="structured_outputs.regex"),
     "structured_outputs.regex"),
    (lambda: StructuredSpec.json_schema({"enum": ["x" * MAX_SPEC_BYTES]}, param="response_format"),
     "response_format"),
    (lambda: StructuredSpec.json_schema(nested(MAX_SCHEMA_DEPTH + 1), param="tools[0]"), "tools[0]"),
    (lambda: StructuredSpec.choice([str(i) for i in range(MAX_CHOICES + 1)], param="choice"), "choice"),
    (lambda: StructuredSpec.choice([], param="choice"), "choice"),
    (lambda: StructuredSpec.choice(["a", ""], param="choice"), "choice"),
    (lambda: StructuredSpec.json_schema(True, param="response_format"), "response_format"),
    (lambda: StructuredSpec.json_schema({"maximum": float("nan")}, param="tools[1]"), "tools[1]"),
    (lambda: StructuredSpec.choice(["a", float("inf")], param="choice"), "choice"),
    (lambda: StructuredSpec.regex("", param="structured_outputs.regex"), "structured_outputs.regex"),
    (lambda: StructuredSpec.grammar("  ", param="structured_outputs.grammar"), "structured_outputs.grammar"),
])
def test_spec_limits_name_the_parameter(make, param):
    with pytest.raises(ValidationError) as err:
        make()
    assert err.value.param == param


def test_specs_at_the_limits_are_accepted():
    deepest = json.loads(StructuredSpec.json_schema(nested(MAX_SCHEMA_DEPTH)).source)
    assert deepest["items"]["type"] == "array"
    assert StructuredSpec.choice([str(i) for i in range(MAX_CHOICES)]).kind.value == "choice"
    assert len(StructuredSpec.regex("a" * MAX_SPEC_BYTES).source) == MAX_SPEC_BYTES


# ---- the compiled-grammar cache ---------------------------------------------------


def test_cache_is_bounded_in_entries(ll_tokenizer):
    compiler = GrammarCompiler(ll_tokenizer, max_entries=4, owner_share=1.0)
    specs = regexes(6)
    compile_all(compiler, specs)
    assert compiler.num_entries == 4 and compiler.misses == 6
    compile_all(compiler, specs[-1:])  # the newest is kept
    assert compiler.hits == 1
    compile_all(compiler, specs[:1])  # the oldest went first
    assert compiler.misses == 7 and compiler.num_entries == 4


def test_cache_is_bounded_in_bytes(ll_tokenizer):
    one = GrammarCompiler(ll_tokenizer, owner_share=1.0)
    compile_all(one, regexes(1))
    entry_bytes = one.num_bytes
    compiler = GrammarCompiler(ll_tokenizer, max_bytes=3 * entry_bytes + entry_bytes // 2, owner_share=1.0)
    compile_all(compiler, regexes(8))
    assert compiler.num_entries == 3
    assert compiler.num_bytes <= compiler.max_bytes
    assert compiler.owner_usage("") == (3, compiler.num_bytes)


def test_one_owner_evicts_only_its_own_entries(ll_tokenizer):
    compiler = GrammarCompiler(ll_tokenizer, max_entries=8, owner_share=0.25)
    other = StructuredSpec.choice(["yes", "no"])
    compile_all(compiler, [other], owner="tenant-b")
    compile_all(compiler, regexes(20, "a"), owner="tenant-a")
    entries, used = compiler.owner_usage("tenant-a")
    assert entries == 2 and used <= compiler.max_bytes * compiler.owner_share
    assert compiler.owner_usage("tenant-b")[0] == 1
    hits = compiler.hits
    compile_all(compiler, [other], owner="tenant-b")
    assert compiler.hits == hits + 1


def test_same_spec_compiling_is_compiled_once(ll_tokenizer, pool_blocked):
    compiler = GrammarCompiler(ll_tokenizer, max_workers=1)
    pool_blocked(compiler)
    spec = StructuredSpec.json_schema({"type": "object", "properties": {"a": {"type": "integer"}}})
    futures = [compiler.submit(spec, owner) for owner in ("x", "y", "x")]
    assert not any(f.done() for f in futures)
    assert (compiler.misses, compiler.hits) == (1, 2)


def test_each_waiter_gets_its_own_matcher(ll_tokenizer, hf_tokenizer):
    compiler = GrammarCompiler(ll_tokenizer)
    spec = StructuredSpec.choice(["yes", "no"])
    a, b = (compiler.submit(spec).result(timeout=30) for _ in range(2))
    yes = hf_tokenizer.encode("yes")
    assert all(a.consume_token(t) for t in yes)
    assert b.validate_tokens(hf_tokenizer.encode("no")) == len(hf_tokenizer.encode("no"))  # b is at the start


@pytest.mark.parametrize("spec", [
    StructuredSpec.regex("(unclosed", param="structured_outputs.regex"),
    StructuredSpec.json_schema({"type": "frobnicate"}, param="response_format"),
    StructuredSpec.grammar("start: undefined_rule", param="structured_outputs.grammar"),
], ids=["regex", "schema", "lark"])
def test_compile_errors_name_the_parameter(ll_tokenizer, spec):
    compiler = GrammarCompiler(ll_tokenizer)
    with pytest.raises(ValidationError) as err:
        compiler.submit(spec).result(timeout=30)
    assert err.value.param == spec.param
    with pytest.raises(ValidationError) as err:
        check_spec(spec, ll_tokenizer)
    assert err.value.param == spec.param
    # Not cached, and not left "compiling": asking again compiles again.
    assert compiler.num_entries == 0
    with pytest.raises(ValidationError):
        compiler.submit(spec).result(timeout=30)
    assert compiler.misses == 2


# ---- the logits mask ------------------------------------------------------------


def scheduled(request_id: str) -> ScheduledRequest:
    return ScheduledRequest(request_id=request_id, group_id=request_id, token_ids=[1], start_pos=0,
                            block_table=[0], sample=True, num_samples=1,
                            sampling_params=SamplingParams(), prompt_token_ids=[1], output_token_ids=[])


def matcher_after(compiler, hf_tokenizer, spec: StructuredSpec, text: str):
    matcher = compiler.submit(spec).result(timeout=30)
    for token in hf_tokenizer.encode(text):
        assert matcher.consume_token(token), text
    return matcher


def test_mask_forbids_exactly_what_the_grammar_forbids(ll_tokenizer, hf_tokenizer):
    compiler = GrammarCompiler(ll_tokenizer)
    vocab = len(hf_tokenizer)
    person = StructuredSpec.json_schema({"type": "object", "properties": {"name": {"type": "string"}}})
    states = {  # rows in states where the grammar does not force the next bytes
        "choice-start": matcher_after(compiler, hf_tokenizer, StructuredSpec.choice(["yes", "yesterday", "no"]), ""),
        "regex-mid": matcher_after(compiler, hf_tokenizer, StructuredSpec.regex("[a-z]{1,5}( [0-9]+)?"), "ab"),
        "json-string": matcher_after(compiler, hf_tokenizer, person, '{"name":"Al'),
        "regex-done": matcher_after(compiler, hf_tokenizer, StructuredSpec.regex("[0-9]{2}"), "42"),
    }
    runtime = GrammarRuntime(vocab)
    for seq_id, matcher in states.items():
        runtime.register(seq_id, matcher)
    order = ["free-0", "choice-start", "regex-mid", "free-1", "json-string", "regex-done"]
    # Wider than the vocabulary, as a padded LM head is: the padding is never allowed.
    logits = torch.randn(len(order), vocab + 64, generator=torch.Generator().manual_seed(0))
    before = logits.clone()
    runtime.apply(logits, [scheduled(r) for r in order])

    for row, seq_id in enumerate(order):
        if seq_id not in states:
            assert torch.equal(logits[row], before[row])
            continue
        matcher = states[seq_id]
        allowed = torch.tensor([matcher.validate_tokens([t]) == 1 for t in range(vocab)])
        allowed[hf_tokenizer.eos_token_id] = matcher.is_accepting()  # validate_tokens judges no EOS
        assert allowed.any()
        kept = torch.isfinite(logits[row])
        assert torch.equal(kept[:vocab], allowed), seq_id
        assert not kept[vocab:].any()
        assert torch.equal(logits[row][kept], before[row][kept])
    assert torch.isfinite(logits[order.index("regex-done")]).nonzero().flatten().tolist() == [
        hf_tokenizer.eos_token_id]


def test_mask_is_a_no_op_without_grammar_rows(ll_tokenizer):
    runtime = GrammarRuntime(100)
    runtime.register("other", GrammarCompiler(ll_tokenizer).submit(StructuredSpec.regex("a")).result(timeout=30))
    logits = torch.randn(2, 100)
    before = logits.clone()
    runtime.apply(logits, [scheduled("x"), scheduled("y")])
    assert torch.equal(logits, before)


# ---- the engine: failed and overdue compiles -------------------------------------------


@pytest.fixture(scope="module")
def tiny_llm(tiny_llama_dir):
    return LLM(str(tiny_llama_dir), num_threads=2)


def assert_idle_and_clean(llm) -> None:
    engine = llm.engine
    assert not engine.has_unfinished()
    engine.step()  # the step that drops ended sequences' state
    kv = engine.scheduler.kv
    assert kv.num_free_blocks() == kv.block_pool.num_blocks
    assert len(engine.core.runner.grammar) == 0


def test_a_grammar_that_fails_to_compile_ends_its_request_with_an_error(tiny_llm):
    bad = SamplingParams(max_tokens=8, structured=StructuredSpec.regex("(unclosed"))
    good = SamplingParams(temperature=0.0, max_tokens=8, structured=StructuredSpec.regex("[0-9]{3}"))
    plain = SamplingParams(temperature=0.0, max_tokens=8)
    failed, digits, free = tiny_llm.generate(["Hello", "Hello", "Hello"], [bad, good, plain])
    assert failed.outputs[0].finish_reason == "error" and failed.outputs[0].token_ids == []
    assert "structured output" in failed.error
    assert digits.outputs[0].finish_reason == "stop" and digits.outputs[0].text.isdigit()
    assert free.outputs[0].finish_reason == "length"
    again = tiny_llm.generate("Hello", good)[0]
    assert again.outputs[0].token_ids == digits.outputs[0].token_ids
    assert_idle_and_clean(tiny_llm)


def test_a_grammar_that_compiles_too_slowly_ends_its_request_with_an_error(tiny_llm, pool_blocked):
    engine = tiny_llm.engine
    compiler = engine.grammar_compiler()
    pool_blocked(compiler)  # the compile waits behind a stuck one
    spec = StructuredSpec.regex("[a-f]{4}")
    engine.grammar_compile_timeout_s = 0.01
    try:
        late = tiny_llm.generate("Hello", SamplingParams(max_tokens=8, structured=spec))[0]
    finally:
        engine.grammar_compile_timeout_s = 10.0
    assert late.outputs[0].finish_reason == "error" and "did not compile" in late.error
    assert_idle_and_clean(tiny_llm)


def test_a_compile_that_never_finishes_times_out(tiny_llm, monkeypatch):
    engine = tiny_llm.engine
    never: Future = Future()
    monkeypatch.setattr(engine.grammar_compiler(), "submit", lambda spec, owner=None: never)
    monkeypatch.setattr(engine, "grammar_compile_timeout_s", 0.01)
    spec = StructuredSpec.regex("[a-f]{4}")
    out = tiny_llm.generate("Hello", SamplingParams(max_tokens=8, structured=spec))[0]
    assert out.outputs[0].finish_reason == "error" and never.cancelled()
    monkeypatch.undo()
    # The compiler and the engine go on: the same spec now compiles and runs.
    ok = tiny_llm.generate("Hello", SamplingParams(max_tokens=8, structured=spec))[0]
    assert ok.outputs[0].finish_reason == "stop" and len(ok.outputs[0].text) == 4
    assert_idle_and_clean(tiny_llm)
