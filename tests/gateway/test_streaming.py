"""The SSE body of a streamed completion, from hand-built engine outputs:
the chunk rules, and an engine failure after the stream began."""

from __future__ import annotations

import asyncio
import json

from engine.errors import EngineDeadError
from engine.outputs import CompletionOutput, RequestOutput
from gateway.openai_format import ResponseFormat
from gateway.streaming import completion_events


def _out(*deltas: tuple[int, str, str | None], error: str | None = None, so_far: int = 0) -> RequestOutput:
    """One engine delta: (choice index, new text, finish_reason) per choice
    that changed, one token per character; `so_far` tokens came before."""
    outputs = [CompletionOutput(index=i, text=text, token_ids=[7] * len(text), finish_reason=finish)
               for i, text, finish in deltas]
    return RequestOutput(request_id="r", prompt=None, prompt_token_ids=[1, 2, 3], outputs=outputs,
                         finished=all(f is not None for _, _, f in deltas), error=error,
                         num_output_tokens=so_far + sum(len(text) for _, text, _ in deltas))


def _events(outputs: list, *, chat: bool, n: int = 1, include_usage: bool = False) -> list:
    fmt = ResponseFormat(id="cmpl-1", model="m", created=0, chat=chat, decode=lambda ids: f"<{ids[0]}>")
    seen = []

    async def rest():
        for item in outputs[1:]:
            if isinstance(item, Exception):
                raise item
            yield item

    async def collect():
        return [e async for e in completion_events(outputs[0], rest(), fmt, n=n, include_usage=include_usage,
                                                   on_output=seen.append)]

    raw = asyncio.run(collect())
    assert all(e.startswith(b"data: ") and e.endswith(b"\n\n") for e in raw)
    return [e[6:-2].decode() if e == b"data: [DONE]\n\n" else json.loads(e[6:-2]) for e in raw]


def test_chat_chunks_open_with_the_role_and_end_with_usage_then_done():
    last = _out((0, "c", "stop"), (1, "yz", "length"), so_far=3)
    events = _events([_out((0, "ab", None), (1, "x", None)), last], chat=True, n=2, include_usage=True)
    role, *deltas, usage, done = events
    assert done == "[DONE]"
    assert [c["delta"]["role"] for c in role["choices"]] == ["assistant", "assistant"]
    assert all(e["usage"] is None and e["object"] == "chat.completion.chunk" for e in [role, *deltas])
    by_index = {0: "", 1: ""}
    for e in deltas:
        (choice,) = e["choices"]
        by_index[choice["index"]] += choice["delta"]["content"]
    assert by_index == {0: "abc", 1: "xyz"}
    # Usage counts every delta's tokens, not just the last one's.
    assert usage["choices"] == []
    assert usage["usage"]["completion_tokens"] == 6
    assert usage["usage"]["prompt_tokens"] == 3


def test_a_choice_that_finished_early_gets_no_more_chunks():
    finished_early = _out((0, "a", "stop"), (1, "b", None))
    later = _out((1, "c", "stop"), so_far=2)
    events = _events([finished_early, later], chat=False, n=2)
    assert [(e["choices"][0]["index"], e["choices"][0]["finish_reason"]) for e in events[:-1]] == [
        (0, "stop"), (1, None), (1, "stop")]


def test_an_engine_failure_mid_stream_is_an_error_event():
    events = _events([_out((0, "ab", None)), EngineDeadError("boom")], chat=False)
    text, error, done = events
    assert text["choices"][0]["text"] == "ab"
    assert error["error"]["code"] == "engine_unavailable" and error["error"]["type"] == "service_unavailable"
    assert done == "[DONE]"


def test_a_request_the_engine_failed_is_an_error_event():
    events = _events([_out((0, "ab", None)), _out((0, "", "error"), error="adapter could not be loaded", so_far=2)],
                     chat=True)
    assert "adapter could not be loaded" in events[-2]["error"]["message"]
    assert events[-1] == "[DONE]"


def test_the_final_output_is_handed_on_before_its_chunk_is_sent():
    """Billing reports a request from `on_output`: a client that has the
    last token chunk must find the request in the ledger after a crash."""
    fmt = ResponseFormat(id="cmpl-1", model="m", created=0, chat=False, decode=lambda ids: "x")
    seen = []

    async def rest():
        yield _out((0, "b", "length"), so_far=1)

    async def until_the_final_chunk():
        events = completion_events(_out((0, "a", None)), rest(), fmt, n=1, include_usage=True,
                                   on_output=seen.append)
        try:
            async for event in events:
                if b'"finish_reason":"length"' in event:
                    return [out.finished for out in seen]
        finally:
            await events.aclose()

    assert asyncio.run(until_the_final_chunk()) == [False, True]
