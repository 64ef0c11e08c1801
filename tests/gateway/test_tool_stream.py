"""One choice's streamed tool-call deltas, from hand-built engine deltas."""

from __future__ import annotations

from engine.outputs import CompletionOutput, TokenLogprob
from gateway.tool_stream import ToolCallStream
from gateway.tools import ToolMode, ToolReader

CALL = '<tool_call>{"name":"f","arguments":{"a":1}}</tool_call>'


def _feed(stream: ToolCallStream, pieces: list[str], finish: str = "stop") -> list:
    out = []
    for i, text in enumerate(pieces):
        last = i == len(pieces) - 1
        delta = CompletionOutput(index=0, text=text, finish_reason=finish if last else None,
                                 logprobs=[TokenLogprob(token_id=i, logprob=-0.5, top_logprobs=[])])
        out.append(stream.feed(delta))
    return out


def test_auto_text_streams_as_soon_as_it_cannot_be_a_call():
    pieces = _feed(ToolCallStream(ToolReader(ToolMode.AUTO)), ["", "Hi", " there"])
    assert pieces[0] is None  # empty so far: it may still become a call
    assert [p.delta.content for p in pieces[1:]] == ["Hi", " there"]
    assert len(pieces[1].logprobs) == 2 and pieces[-1].finish_reason == "stop"


def test_auto_call_is_held_and_sent_whole_with_its_logprobs():
    parts = [CALL[:4], CALL[4:20], CALL[20:]]
    pieces = _feed(ToolCallStream(ToolReader(ToolMode.AUTO)), parts)
    assert pieces[:2] == [None, None]
    (call,) = pieces[2].delta.tool_calls
    assert call.id.startswith("call_") and call.function.name == "f" and call.function.arguments == '{"a":1}'
    assert pieces[2].finish_reason == "tool_calls" and len(pieces[2].logprobs) == 3


def test_a_call_cut_by_max_tokens_goes_out_as_content():
    pieces = _feed(ToolCallStream(ToolReader(ToolMode.REQUIRED)), ['{"name":', '"f"'], finish="length")
    assert pieces[0] is None and pieces[1].delta.content == '{"name":"f"'
    assert pieces[1].finish_reason == "length" and not pieces[1].delta.tool_calls


def test_named_call_streams_arguments_after_an_opening_delta():
    stream = ToolCallStream(ToolReader(ToolMode.NAMED, "f"))
    first, second = _feed(stream, ['{"a"', ":1}"])
    (opening,) = first.delta.tool_calls
    assert opening.id == stream.call_id and opening.function.name == "f" and opening.function.arguments == '{"a"'
    (rest,) = second.delta.tool_calls
    assert rest.id is None and rest.function.name is None and rest.function.arguments == ":1}"
    assert second.finish_reason == "tool_calls"


def test_a_call_whose_arguments_escape_a_lone_surrogate_stays_a_call_that_encodes():
    """JSON output may hold `\\ud800`: parsed, that is a lone surrogate, which
    no UTF-8 answer carries; re-encoded it stays escaped, in every mode."""
    escaped = '{"a":"\\ud800"}'
    for reader, text in ((ToolReader(ToolMode.REQUIRED), f'{{"name":"f","arguments":{escaped}}}'),
                         (ToolReader(ToolMode.AUTO), f'<tool_call>{{"name":"f","arguments":{escaped}}}</tool_call>'),
                         (ToolReader(ToolMode.NAMED, "f"), escaped)):
        call = reader.parse(text)
        assert call is not None and call.name == "f", reader
        assert call.arguments == escaped and call.arguments.encode("utf-8")


def test_a_named_call_opens_with_the_first_delta_that_carries_text():
    """A delta of nothing sends no chunk (gateway/openai_format.py), so the
    opening (id, type, name) goes out with the first text; later pieces
    leave those keys out of the JSON altogether."""
    from gateway.openai_format import ResponseFormat

    fmt = ResponseFormat(id="c", model="m", created=0, chat=True, decode=str, tools=ToolReader(ToolMode.NAMED, "f"))
    empty = CompletionOutput(index=0, text="", finish_reason=None)
    assert fmt.delta_chunk(empty, 0) is None
    first = fmt.delta_chunk(CompletionOutput(index=0, text='{"a"', finish_reason=None), 0)
    (opening,) = first["choices"][0]["delta"]["tool_calls"]
    assert opening["id"].startswith("call_") and opening["type"] == "function" and opening["function"]["name"] == "f"
    later = fmt.delta_chunk(CompletionOutput(index=0, text=":1}", finish_reason="stop"), 4)
    (piece,) = later["choices"][0]["delta"]["tool_calls"]
    assert piece == {"index": 0, "function": {"arguments": ":1}"}}
    assert later["choices"][0]["finish_reason"] == "tool_calls"
