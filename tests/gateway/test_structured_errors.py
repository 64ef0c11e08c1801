"""Bad constraints and tools are 400s naming the field, never an engine
error; and a fuzz of response_format / tools / tool_choice bodies finds no
5xx. The tiny Llama serves: it has SmolLM2's tokenizer and template, and
whether a constraint compiles depends on those alone.
"""

from __future__ import annotations

import json

import hypothesis
import pytest
from hypothesis import strategies as st

from tests.gateway.structured_live import CHAT as CHAT_TURN
from tests.gateway.structured_live import TIME, TOOLS, chat, post, structured_gateway

FUEL_GRAMMAR = "\n".join(["start: r0", *(f'r{i}: r{i + 1} r{i + 1} | "x"' for i in range(2000)), 'r2000: "y"'])


def _nested(depth: int) -> dict:
    """A schema 2 * depth + 1 levels deep (a body nests at most 32: deeper
    schemas come as a JSON string)."""
    schema: dict = {"type": "string"}
    for _ in range(depth):
        schema = {"type": "object", "properties": {"a": schema}}
    return schema


def _tool(name: str, parameters: object = None) -> dict:
    function = {"name": name} if parameters is None else {"name": name, "parameters": parameters}
    return {"type": "function", "function": function}


def _schema_format(schema: object) -> dict:
    return {"type": "json_schema", "json_schema": {"name": "out", "schema": schema}}


@pytest.fixture(scope="module")
def live(tiny_llama_dir, tmp_path_factory):
    with structured_gateway(tiny_llama_dir, tmp_path_factory.mktemp("structured-tiny")) as server:
        yield server


@pytest.mark.parametrize("body, param", [
    ({"response_format": _schema_format({"type": "wat"})}, "response_format.json_schema.schema"),
    ({"structured_outputs": {"json": json.dumps(_nested(20))}}, "structured_outputs.json"),  # too deep
    ({"response_format": _schema_format({"enum": ["x" * 1000] * 80})}, "response_format.json_schema.schema"),
    ({"response_format": {"type": "json_schema"}}, "response_format"),
    ({"response_format": {"type": "xml"}}, "response_format.type"),
    ({"structured_outputs": {"regex": "(a"}}, "structured_outputs.regex"),
    ({"structured_outputs": {"grammar": "start: foo"}}, "structured_outputs.grammar"),
    ({"structured_outputs": {"grammar": FUEL_GRAMMAR}}, "structured_outputs.grammar"),
    ({"structured_outputs": {"json": "{not json"}}, "structured_outputs.json"),
    ({"structured_outputs": {"json": '{"type": "string", "const": "\\ud800"}'}}, "structured_outputs.json"),
    # Too complex only once their forced tokens are consumed.
    ({"structured_outputs": {"regex": "a{1000000}"}}, "structured_outputs.regex"),
    ({"response_format": _schema_format({"type": "object", "properties": {"a": {"$ref": "#"}}, "required": ["a"]})},
     "response_format.json_schema.schema"),
    ({"structured_outputs": {"choice": []}}, "structured_outputs.choice"),
    ({"structured_outputs": {"regex": "a", "choice": ["a"]}}, "structured_outputs"),
    ({"structured_outputs": {"regex": "a"}, "response_format": {"type": "json_object"}}, "structured_outputs"),
    ({"tools": [_tool("f", {"type": "wat"})]}, "tools[0].function.parameters"),
    ({"tools": [_tool("f", {"type": "string"})], "tool_choice": "required"}, "tools[0].function.parameters"),
    ({"tools": [TIME, _tool("g", {"properties": {"a": {"type": "wat"}}})]}, "tools[1].function.parameters"),
    ({"tools": [_tool("bad name")]}, "tools[0].function.name"),
    ({"tools": [_tool("f"), _tool("f")]}, "tools"),
    ({"tools": [_tool(f"f{i}") for i in range(129)]}, "tools"),
    ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice"),
    ({"tools": TOOLS, "tool_choice": "sometimes"}, "tool_choice"),
    ({"tool_choice": "required"}, "tool_choice"),
    ({"tools": TOOLS, "response_format": {"type": "json_object"}}, "response_format"),
    ({"tools": TOOLS, "structured_outputs": {"regex": "a"}}, "structured_outputs"),
    ({"functions": [{"name": "f"}]}, "functions"),
    ({"messages": [{"role": "user", "content": "hi", "tool_calls": []}, {"role": "user", "content": "x",
      "tool_calls": [{"id": "1", "type": "function", "function": {"name": "f", "arguments": "{}"}}]}]},
     "messages[1].tool_calls"),
])
def test_bad_constraints_and_tools_are_400s_naming_the_field(live, body, param):
    r = chat(live, **body)
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["param"] == param and error["type"] == "invalid_request_error", error


def test_bad_structured_outputs_on_text_completions(live):
    r = post(live, "completions", {"prompt": "x", "max_tokens": 2, "structured_outputs": {"regex": "[z-a]"}})
    assert r.status_code == 400 and r.json()["error"]["param"] == "structured_outputs.regex"


def test_a_normal_request_still_works_after_the_refusals(live):
    for body in ({"structured_outputs": {"grammar": FUEL_GRAMMAR}}, {"structured_outputs": {"json": json.dumps(_nested(20))}}):
        assert chat(live, **body).status_code == 400
    r = chat(live, response_format={"type": "json_object"}, max_tokens=2)
    assert r.status_code == 200 and r.json()["choices"][0]["message"]["content"].startswith("{")
    assert chat(live).status_code == 200


def test_json_inside_a_field_holding_a_lone_surrogate_is_sent_on_as_text(live):
    """An earlier call's arguments are JSON text; where their escapes make a
    lone surrogate, no encoder downstream (the tokenizer) takes the value,
    so the text goes into the prompt as it came (pure ASCII)."""
    call = {"id": "c1", "type": "function", "function": {"name": "get_time", "arguments": '{"zone": "\\ud800"}'}}
    messages = [*CHAT_TURN, {"role": "assistant", "content": None, "tool_calls": [call]},
                {"role": "tool", "tool_call_id": "c1", "content": "5"}]
    r = chat(live, messages=messages, tools=TOOLS)
    assert r.status_code == 200, r.text


def test_a_tool_schema_that_names_no_type_is_an_objects(live):
    """Clients often send only `properties`: the arguments are held to them
    as an object's, and come back as a call."""
    tool = _tool("set_level", {"properties": {"level": {"enum": [1, 2]}}, "required": ["level"],
                               "additionalProperties": False})
    r = chat(live, tools=[tool], tool_choice="required", max_tokens=40)
    assert r.status_code == 200, r.text
    choice = r.json()["choices"][0]
    assert choice["finish_reason"] == "tool_calls", choice
    (call,) = choice["message"]["tool_calls"]
    assert call["function"]["name"] == "set_level"
    assert json.loads(call["function"]["arguments"]) in ({"level": 1}, {"level": 2})


# ---- fuzz ----

_json = st.recursive(
    st.none() | st.booleans() | st.integers(-3, 3) | st.text(max_size=6),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=6), inner, max_size=3),
    max_leaves=12)
_keywords = st.sampled_from(["type", "properties", "required", "items", "enum", "const", "anyOf", "pattern",
                             "minLength", "maxItems", "additionalProperties", "$ref", "format"])
_types = st.sampled_from(["object", "string", "integer", "number", "boolean", "array", "null", "wat"])
_schema = st.recursive(
    st.fixed_dictionaries({"type": _types}) | st.booleans(),
    lambda inner: st.dictionaries(_keywords, inner | _json | _types | st.lists(inner, max_size=2), max_size=3),
    max_leaves=8)
_names = st.sampled_from(["get_time", "get_weather", "f", "", "bad name", "x" * 65]) | st.text(max_size=8)
_tool_strategy = st.fixed_dictionaries(
    {"type": st.sampled_from(["function", "function", "code"]),
     "function": st.fixed_dictionaries({"name": _names}, optional={"parameters": _schema | _json,
                                                                   "description": st.text(max_size=8)})}) | _json
_tool_choice = (st.sampled_from(["none", "auto", "required", "any"])
                | st.fixed_dictionaries({"type": st.just("function"),
                                         "function": st.fixed_dictionaries({"name": _names})}) | _json)
_response_format = (
    st.fixed_dictionaries({"type": st.sampled_from(["text", "json_object", "json_schema", "yaml"])},
                          optional={"json_schema": st.fixed_dictionaries({"name": _names},
                                                                         optional={"schema": _schema | _json})})
    | _json)
_body = st.fixed_dictionaries({}, optional={
    "response_format": _response_format, "tools": st.lists(_tool_strategy, max_size=3) | _json,
    "tool_choice": _tool_choice, "structured_outputs": st.dictionaries(
        st.sampled_from(["regex", "choice", "grammar", "json"]), _json | _schema, max_size=2)})


def test_fuzzed_response_format_and_tools_give_no_5xx(live):
    statuses: dict[int, int] = {}

    @hypothesis.given(_body)
    @hypothesis.settings(max_examples=150, derandomize=True, deadline=None, database=None,
                         suppress_health_check=list(hypothesis.HealthCheck))
    def call(body):
        r = chat(live, **body, max_tokens=4)
        statuses[r.status_code] = statuses.get(r.status_code, 0) + 1
        assert r.status_code in (200, 400), (body, r.text)
        if r.status_code == 400:
            assert r.json()["error"]["param"], (body, r.text)

    call()
    assert statuses.get(200) and statuses.get(400), statuses  # both paths were reached
