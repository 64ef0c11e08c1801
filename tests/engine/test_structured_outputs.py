"""Structured output on the real SmolLM2: every constrained generation is
checked by an independent judge (the `jsonschema` library, `re.fullmatch`,
list membership), 100 generations a schema in one batched call, greedy rows
beside seeded sampling at several temperatures.

Every string is bounded (maxLength) and numbers are bounded or stepped, so
each grammar has a finite longest output and `max_tokens` is set above it:
a generation that ends with "length" is a grammar that failed to close.
"""

from __future__ import annotations

import json
import re

import jsonschema
import pytest

from engine import LLM, SamplingParams
from engine.structured.spec import StructuredSpec

pytestmark = pytest.mark.smollm

ROWS = 100
MAX_TOKENS = 96
_ASKS = [
    "Reply with a JSON object.",
    "Describe a customer as JSON.",
    "Give me some data in JSON format.",
    "Output one record, nothing else.",
]

PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 12},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "tags": {"type": "array", "items": {"enum": ["red", "green", "blue"]}, "maxItems": 3},
    },
    "required": ["name", "age"],
    "additionalProperties": False,
}
ORDER = {  # objects nested in an array nested in an object
    "type": "object",
    "properties": {
        "order": {
            "type": "object",
            "properties": {
                "id": {"type": "integer", "minimum": 1, "maximum": 9999},
                "items": {
                    "type": "array",
                    "maxItems": 2,
                    "items": {
                        "type": "object",
                        "properties": {"sku": {"type": "string", "maxLength": 6},
                                       "qty": {"type": "integer", "minimum": 1, "maximum": 99}},
                        "required": ["sku", "qty"],
                        "additionalProperties": False,
                    },
                },
            },
            "required": ["id", "items"],
            "additionalProperties": False,
        },
        "status": {"enum": ["open", "shipped", "closed"]},
    },
    "required": ["order", "status"],
    "additionalProperties": False,
}
POINT = {  # a plain number may take any number of fraction digits: these are stepped
    "type": "object",
    "properties": {
        "lat": {"type": "number", "minimum": -90, "maximum": 90, "multipleOf": 0.25},
        "lon": {"type": "number", "minimum": -180, "maximum": 180, "multipleOf": 0.5},
        "elevation": {"type": "integer", "minimum": -500, "maximum": 9000},
        "ok": {"type": "boolean"},
    },
    "required": ["lat", "lon", "ok"],
    "additionalProperties": False,
}
REVIEW = {  # two optional fields of four
    "type": "object",
    "properties": {
        "title": {"type": "string", "maxLength": 16},
        "rating": {"type": "integer", "minimum": 1, "maximum": 5},
        "comment": {"type": "string", "maxLength": 10},
        "verified": {"type": "boolean"},
    },
    "required": ["title", "rating"],
    "additionalProperties": False,
}


@pytest.fixture(scope="module")
def llm():
    return LLM(num_threads=2)


@pytest.fixture(scope="module")
def prompts(llm) -> list[list[int]]:
    return [llm.engine.apply_chat_template([{"role": "user", "content": ask}]) for ask in _ASKS]


def batch(prompts, spec: StructuredSpec, rows: int = ROWS, max_tokens: int = MAX_TOKENS):
    """`rows` requests over the prompts: a greedy row per prompt, the rest
    seeded samples at three temperatures (one with top_p)."""
    temps = [(0.7, 1.0), (1.0, 1.0), (1.3, 0.95)]
    params = [SamplingParams(temperature=0.0, max_tokens=max_tokens, structured=spec) for _ in prompts]
    for i in range(rows - len(prompts)):
        temperature, top_p = temps[i % len(temps)]
        params.append(SamplingParams(temperature=temperature, top_p=top_p, seed=1000 + i,
                                     max_tokens=max_tokens, structured=spec))
    return [prompts[i % len(prompts)] for i in range(rows)], params


def completions(outs):
    return [c for o in outs for c in o.outputs]


def assert_all_stopped(comps) -> None:
    unfinished = [(c.finish_reason, c.text) for c in comps if c.finish_reason != "stop"]
    assert not unfinished, f"{len(unfinished)} did not end on the grammar: {unfinished[:3]}"


@pytest.mark.parametrize("schema", [PERSON, ORDER, POINT, REVIEW], ids=["person", "order", "point", "review"])
def test_json_schema_outputs_validate(llm, prompts, schema):
    outs = llm.generate(*batch(prompts, StructuredSpec.json_schema(schema)))
    comps = completions(outs)
    assert len(comps) == ROWS
    assert_all_stopped(comps)
    for c in comps:
        jsonschema.validate(json.loads(c.text), schema)
    # Sampling really sampled: a grammar that admitted a single string would pass the rest.
    assert len({c.text for c in comps}) > ROWS // 4


def test_optional_fields_appear_and_are_left_out(llm, prompts):
    comps = completions(llm.generate(*batch(prompts, StructuredSpec.json_schema(REVIEW))))
    keys = [set(json.loads(c.text)) for c in comps]
    assert all({"title", "rating"} <= k for k in keys)
    assert any("comment" in k or "verified" in k for k in keys)
    assert any(k == {"title", "rating"} for k in keys)


def test_json_object_outputs_are_objects(llm, prompts):
    # Any object: unbounded, so only the rows that closed are parsed.
    comps = completions(llm.generate(*batch(prompts, StructuredSpec.json_object(), rows=24)))
    closed = [c for c in comps if c.finish_reason == "stop"]
    assert closed
    for c in closed:
        assert isinstance(json.loads(c.text), dict)


@pytest.mark.parametrize("pattern", [
    r"(19|20)\d\d-(0[1-9]|1[0-2])-(0[1-9]|[12]\d|3[01])",
    r"(yes|no|maybe)(, because [a-z ]{1,12})?\.",
], ids=["date", "answer"])
def test_regex_outputs_fullmatch(llm, prompts, pattern):
    comps = completions(llm.generate(*batch(prompts, StructuredSpec.regex(pattern), max_tokens=48)))
    assert_all_stopped(comps)
    for c in comps:
        assert re.fullmatch(pattern, c.text), c.text
    assert len({c.text for c in comps}) > 1


def test_choice_outputs_are_in_the_list(llm, prompts):
    choices = ["yes", "yesterday", "no", "Nothing at all"]  # one choice a prefix of another
    comps = completions(llm.generate(*batch(prompts, StructuredSpec.choice(choices), max_tokens=8)))
    assert_all_stopped(comps)
    assert {c.text for c in comps} <= set(choices)
    assert len({c.text for c in comps}) > 1


def test_n_completions_with_a_seed(llm, prompts):
    spec = StructuredSpec.json_schema(PERSON)
    params = SamplingParams(n=8, temperature=1.0, seed=21, max_tokens=MAX_TOKENS, structured=spec)
    comps = completions(llm.generate(prompts[:1], params))
    assert len(comps) == 8
    assert_all_stopped(comps)
    for c in comps:
        jsonschema.validate(json.loads(c.text), PERSON)
    assert len({c.text for c in comps}) > 2
    # Forked children get their own grammar state: the same seed replays the same outputs.
    again = completions(llm.generate(prompts[:1], params))
    assert [c.token_ids for c in again] == [c.token_ids for c in comps]
