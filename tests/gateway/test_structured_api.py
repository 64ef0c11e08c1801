"""Structured output and tool calls end to end: the real SmolLM2 behind a
live server, driven by the official `openai` client, every output checked
against its schema with the jsonschema library (or `re` for a regex).

Outputs are kept short (tiny schemas, small max_tokens): on a CPU each
token costs a step of the 135M model plus a grammar mask.
"""

from __future__ import annotations

import json
import re
from typing import Literal

import jsonschema
import pytest
from pydantic import BaseModel

from tests.gateway.structured_live import CHAT, TIME, TOOLS, chat, client, post, structured_gateway

pytestmark = pytest.mark.smollm

PARAMETERS = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}
NAMED_TIME = {"type": "function", "function": {"name": "get_time"}}


class Verdict(BaseModel):
    answer: Literal["yes", "no"]
    sure: bool


@pytest.fixture(scope="module")
def live(smollm_dir, tmp_path_factory):
    with structured_gateway(smollm_dir, tmp_path_factory.mktemp("structured-smollm")) as server:
        yield server


def _check_call(call) -> None:
    assert call.type == "function" and call.id.startswith("call_")
    jsonschema.validate(json.loads(call.function.arguments), PARAMETERS[call.function.name])


def _accumulate(stream) -> dict[int, dict]:
    """Each choice's streamed content, tool calls (by index) and finish reason."""
    choices: dict[int, dict] = {}
    for chunk in stream:
        for c in chunk.choices:
            got = choices.setdefault(c.index, {"content": "", "calls": {}, "finish": None, "logprobs": 0})
            got["content"] += c.delta.content or ""
            for d in c.delta.tool_calls or []:
                call = got["calls"].setdefault(d.index, {"id": None, "name": None, "arguments": ""})
                call["id"] = call["id"] or d.id
                call["name"] = call["name"] or d.function.name
                call["arguments"] += d.function.arguments or ""
            got["logprobs"] += len(c.logprobs.content) if c.logprobs and c.logprobs.content else 0
            got["finish"] = c.finish_reason or got["finish"]
    return choices


def test_parse_returns_the_pydantic_object(live):
    resp = client(live).chat.completions.parse(
        model=live.model, messages=[{"role": "user", "content": "Is Paris in France?"}],
        response_format=Verdict, max_tokens=24, temperature=0)
    (choice,) = resp.choices
    assert isinstance(choice.message.parsed, Verdict)
    jsonschema.validate(json.loads(choice.message.content), Verdict.model_json_schema())
    assert " " not in choice.message.content  # compact JSON


def test_required_tool_choice_gives_valid_calls_for_every_choice(live):
    resp = client(live).chat.completions.create(
        model=live.model, messages=CHAT, tools=TOOLS, tool_choice="required", n=2, temperature=1.0, seed=5,
        max_tokens=48)
    assert len(resp.choices) == 2
    for choice in resp.choices:
        assert choice.finish_reason == "tool_calls" and choice.message.content is None
        (call,) = choice.message.tool_calls
        _check_call(call)


def test_named_tool_choice_streams_the_same_arguments_as_the_whole_response(live):
    whole = client(live).chat.completions.create(
        model=live.model, messages=CHAT, tools=TOOLS, tool_choice=NAMED_TIME, max_tokens=32, temperature=0)
    (choice,) = whole.choices
    assert choice.finish_reason == "tool_calls"
    (call,) = choice.message.tool_calls
    assert call.function.name == "get_time"
    _check_call(call)

    stream = client(live).chat.completions.create(
        model=live.model, messages=CHAT, tools=TOOLS, tool_choice=NAMED_TIME, max_tokens=32, temperature=0,
        stream=True, logprobs=True)
    (streamed,) = _accumulate(stream).values()
    (streamed_call,) = streamed["calls"].values()
    assert streamed_call["name"] == "get_time" and streamed_call["id"].startswith("call_")
    assert streamed_call["arguments"] == call.function.arguments
    assert streamed["finish"] == "tool_calls" and streamed["content"] == ""
    assert streamed["logprobs"] == whole.usage.completion_tokens


def test_the_sdks_stream_helper_assembles_a_named_call(live):
    """The helper copies every key of a delta into its call: a later piece
    that sent `"type": null` broke it (an AssertionError inside the SDK)."""
    with client(live).chat.completions.stream(model=live.model, messages=CHAT, tools=TOOLS,
                                              tool_choice=NAMED_TIME, max_tokens=32, temperature=0) as stream:
        final = stream.get_final_completion()
    (call,) = final.choices[0].message.tool_calls
    assert call.function.name == "get_time"
    _check_call(call)


def test_a_named_call_cut_by_max_tokens_is_that_call_with_partial_arguments(live):
    args = dict(model=live.model, messages=CHAT, tools=TOOLS, tool_choice=NAMED_TIME, max_tokens=3, temperature=0)
    (whole,) = client(live).chat.completions.create(**args).choices
    assert whole.finish_reason == "length" and whole.message.content is None
    (call,) = whole.message.tool_calls
    assert call.function.name == "get_time" and call.function.arguments.startswith('{"zone":')
    (streamed,) = _accumulate(client(live).chat.completions.create(**args, stream=True)).values()
    (streamed_call,) = streamed["calls"].values()
    assert streamed["finish"] == "length" and streamed_call["arguments"] == call.function.arguments


def test_required_tool_choice_streams_one_whole_call_per_choice(live):
    stream = client(live).chat.completions.create(
        model=live.model, messages=CHAT, tools=TOOLS, tool_choice="required", n=2, temperature=1.0, seed=11,
        max_tokens=48, stream=True, logprobs=True, stream_options={"include_usage": True})
    choices = _accumulate(stream)
    assert sorted(choices) == [0, 1]
    for got in choices.values():
        assert got["finish"] == "tool_calls" and got["content"] == "" and got["logprobs"] > 0
        (call,) = got["calls"].values()
        assert call["name"] in PARAMETERS
        jsonschema.validate(json.loads(call["arguments"]), PARAMETERS[call["name"]])


def test_max_tokens_inside_a_call_gives_length_and_the_partial_text(live):
    resp = client(live).chat.completions.create(
        model=live.model, messages=CHAT, tools=TOOLS, tool_choice="required", max_tokens=3, temperature=0)
    (choice,) = resp.choices
    assert choice.finish_reason == "length" and not choice.message.tool_calls
    assert choice.message.content.startswith('{"name":') and resp.usage.completion_tokens == 3


def test_auto_tool_choice_answers_in_text_or_one_valid_call(live):
    resp = client(live).chat.completions.create(
        model=live.model, messages=CHAT, tools=[TIME], n=2, temperature=1.0, seed=3, max_tokens=24)
    for choice in resp.choices:
        if choice.finish_reason == "tool_calls":
            (call,) = choice.message.tool_calls
            _check_call(call)
        else:
            assert not choice.message.content.startswith("<") and not choice.message.tool_calls


def test_structured_outputs_regex_and_choice(live):
    regex = r"[0-9]{3}-[a-z]{2}"
    body = chat(live, structured_outputs={"regex": regex}, max_tokens=12, n=2, temperature=1.0, seed=1).json()
    for choice in body["choices"]:
        assert re.fullmatch(regex, choice["message"]["content"]) and choice["finish_reason"] == "stop"
    colours = ["red", "green", "blue"]
    text = post(live, "completions", {"prompt": "My favourite colour is", "max_tokens": 4,
                                      "structured_outputs": {"choice": colours}}).json()
    assert text["choices"][0]["text"] in colours


def test_tool_calls_and_results_in_the_history_are_rendered(live, smollm_dir):
    """With SmolLM2's template an earlier call is its `<tool_call>` text and
    a result a "tool" turn: the prompt is the HF template's rendering of that."""
    from transformers import AutoTokenizer

    call = {"id": "call_1", "type": "function", "function": {"name": "get_time", "arguments": '{"zone":"CET"}'}}
    history = [*CHAT, {"role": "assistant", "content": None, "tool_calls": [call]},
               {"role": "tool", "tool_call_id": "call_1", "content": "12:00"}]
    resp = client(live).chat.completions.create(model=live.model, messages=history, max_tokens=2)
    expected = [*CHAT, {"role": "assistant", "content": '<tool_call>{"name":"get_time","arguments":{"zone":"CET"}}'
                                                        '</tool_call>'},
                {"role": "tool", "content": "12:00"}]
    tokenizer = AutoTokenizer.from_pretrained(smollm_dir)
    text = tokenizer.apply_chat_template(expected, add_generation_prompt=True, tokenize=False)
    assert resp.usage.prompt_tokens == len(tokenizer(text, add_special_tokens=False).input_ids)


def test_image_parts_are_still_refused(live):
    image = {"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}}
    r = chat(live, messages=[{"role": "user", "content": [image]}], tools=TOOLS)
    assert r.status_code == 400 and r.json()["error"]["param"].startswith("messages[0].content")
