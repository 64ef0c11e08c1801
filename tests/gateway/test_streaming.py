"""The SSE body of a streamed completion, from hand-built engine deltas:
the chunk rules, deltas merged while the client was behind, the whole
output of a non-streamed request, an engine failure after the stream
began, and the stream's deadline."""

from __future__ import annotations

import asyncio
import json

import anyio

from engine.errors import EngineDeadError
from engine.outputs import CompletionOutput, RequestOutput, TokenLogprob
from gateway.openai_format import ResponseFormat
from gateway.streaming import SSEResponse, collect_output, completion_events


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


def test_a_delta_that_carries_nothing_sends_no_chunk():
    """Text held while a stop string may still match it comes as empty
    deltas: no chunk for those, for chat and completions alike."""
    outputs = [_out((0, "a", None)), _out((0, "", None), so_far=1), _out((0, "", None), so_far=2),
               _out((0, "b", "stop"), so_far=3)]
    for chat in (True, False):
        events = _events(outputs, chat=chat)[:-1]
        deltas = events[1:] if chat else events  # chat opens with the role
        texts = [e["choices"][0]["delta"]["content"] if chat else e["choices"][0]["text"] for e in deltas]
        assert texts == ["a", "b"], texts
    # A finish with no text still goes out: it carries the finish reason.
    events = _events([_out((0, "a", None)), _out((0, "", "stop"), so_far=1)], chat=False)[:-1]
    assert [e["choices"][0]["finish_reason"] for e in events] == [None, "stop"]


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


def _logprob_deltas() -> list[RequestOutput]:
    """Five steps of two choices, one token each, with top logprobs; choice
    1 ends at step 3, choice 0 at step 5."""
    deltas = []
    for step in range(1, 6):
        outs = [CompletionOutput(index=i, text=f"{i}{step} ", token_ids=[10 * i + step],
                                 logprobs=[TokenLogprob(10 * i + step, -0.5 * step, ((10 * i + step, -0.5 * step),
                                                                                     (99, -9.0)))],
                                 finish_reason="length" if (i, step) in {(1, 3), (0, 5)} else None)
                for i in ((0, 1) if step <= 3 else (0,))]
        deltas.append(RequestOutput("r", None, [1, 2, 3], outs, finished=step == 5,
                                    num_output_tokens=2 * min(step, 3) + max(0, step - 3)))
    return deltas


def _per_choice(events: list) -> dict:
    """Each choice's concatenated content, its logprob tokens and finish reason."""
    seen: dict = {}
    for e in events:
        if not isinstance(e, dict) or not e.get("choices") or e["choices"][0]["delta"].get("role"):
            continue
        (choice,) = e["choices"]
        text, tokens, finish = seen.get(choice["index"], ("", [], None))
        seen[choice["index"]] = (text + choice["delta"]["content"],
                                 tokens + [(t["token"], t["logprob"], [x["token"] for x in t["top_logprobs"]])
                                           for t in choice["logprobs"]["content"]],
                                 choice["finish_reason"] or finish)
    return seen


def test_steps_merged_while_the_client_was_behind_stream_the_same_text_and_logprobs():
    """A reader that falls behind gets the steps it missed as one merged
    delta (the mailbox's `RequestOutput.add`): fewer chunks, the same text,
    the same logprobs in the same order, and the same usage."""
    one_by_one = _events(_logprob_deltas(), chat=True, n=2, include_usage=True)
    first, *missed = _logprob_deltas()
    behind = missed[0]
    for d in missed[1:]:
        behind.add(d)
    merged = _events([first, behind], chat=True, n=2, include_usage=True)
    assert len(merged) < len(one_by_one)
    assert _per_choice(merged) == _per_choice(one_by_one) == {
        0: ("01 02 03 04 05 ", [(f"<{s}>", -0.5 * s, [f"<{s}>", "<99>"]) for s in range(1, 6)], "length"),
        1: ("11 12 13 ", [(f"<{10 + s}>", -0.5 * s, [f"<{10 + s}>", "<99>"]) for s in range(1, 4)], "length")}
    assert merged[-2]["usage"] == one_by_one[-2]["usage"] and merged[-2]["usage"]["completion_tokens"] == 8


def test_collect_output_folds_every_delta_into_the_whole_output():
    first, *rest_deltas = _logprob_deltas()
    seen = []

    async def rest():
        for d in rest_deltas:
            yield d

    whole = asyncio.run(collect_output(first, rest(), on_output=seen.append))
    assert seen == rest_deltas and [len(c.token_ids) for c in first.outputs] == [1, 1]  # first untouched
    assert whole.finished and whole.num_output_tokens == 8
    assert [(c.text, c.token_ids, c.finish_reason) for c in whole.outputs] == [
        ("01 02 03 04 05 ", [1, 2, 3, 4, 5], "length"), ("11 12 13 ", [11, 12, 13], "length")]
    assert [lp.token_id for lp in whole.outputs[0].logprobs] == [1, 2, 3, 4, 5]


def _run_sse(events, *, max_seconds: float, send_blocks: bool = False, usage=lambda: None) -> tuple[bytes, list]:
    """Serve `events` through SSEResponse to a client that never hangs up;
    with `send_blocks`, one that stops reading after the headers."""
    sent, closed = [], []

    async def send(message):
        if send_blocks and message["type"] == "http.response.body":
            await anyio.sleep_forever()
        sent.append(message)

    async def receive():
        await anyio.sleep_forever()

    response = SSEResponse(events, on_close=lambda: closed.append("on_close"), max_seconds=max_seconds, usage=usage)
    asyncio.run(response({"type": "http"}, receive, send))
    assert sent[0]["type"] == "http.response.start" and closed[-1] == "on_close"
    return b"".join(m.get("body", b"") for m in sent[1:]), closed


def test_a_stream_past_its_deadline_is_aborted_and_ends_with_an_error_event_then_done():
    aborted = []

    async def engine_stalls():
        try:
            yield b"data: {}\n\n"
            await anyio.sleep_forever()  # no more output, ever
        finally:
            aborted.append(True)  # leaving the engine's iterator aborts the request

    body, closed = _run_sse(engine_stalls(), max_seconds=0.2)
    first, error, done = body.split(b"\n\n")[:3]
    assert first == b"data: {}" and done == b"data: [DONE]" and body.endswith(b"data: [DONE]\n\n")
    assert json.loads(error[6:])["error"]["code"] == "stream_deadline_exceeded"
    assert aborted == [True]


def test_past_the_deadline_a_client_that_asked_for_usage_gets_it_before_the_error_event():
    async def engine_stalls():
        yield b"data: {}\n\n"
        await anyio.sleep_forever()

    chunk = {"choices": [], "usage": {"prompt_tokens": 3, "completion_tokens": 1, "total_tokens": 4}}
    body, _ = _run_sse(engine_stalls(), max_seconds=0.2, usage=lambda: chunk)
    first, usage, error, done = body.split(b"\n\n")[:4]
    assert first == b"data: {}" and json.loads(usage[6:]) == chunk and done == b"data: [DONE]"
    assert json.loads(error[6:])["error"]["code"] == "stream_deadline_exceeded"


def test_a_reader_that_stalls_is_cut_off_at_the_deadline():
    aborted = []

    async def endless():
        try:
            while True:
                yield b"data: {}\n\n"
                await anyio.sleep(0)
        finally:
            aborted.append(True)

    body, closed = _run_sse(endless(), max_seconds=0.2, send_blocks=True)
    assert body == b"" and aborted == [True]  # it read nothing; the request is gone anyway


def test_an_engine_failure_mid_stream_is_recorded_as_an_error_not_a_disconnect():
    """The failed output reaches the lifecycle before it turns into the error
    event, so the ledger says `error`, not `client_disconnect`."""
    from tests.gateway.test_lifecycle import Gw, Recorder, Ticket, lifecycle

    recorder = Recorder()
    life = lifecycle(Gw([recorder]), Ticket())
    fmt = ResponseFormat(id="cmpl-1", model="m", created=0, chat=False, decode=lambda ids: "")
    failed = _out((0, "", "error"), error="step raised", so_far=2)

    async def rest():
        yield failed

    async def stream():
        return [e async for e in completion_events(_out((0, "ab", None)), rest(), fmt, n=1, include_usage=False,
                                                   on_output=life.saw)]

    events = asyncio.run(stream())
    life.close()
    assert b"engine_error" in events[-2] and events[-1] == b"data: [DONE]\n\n"
    assert [r.finish_reason for r in recorder.records] == ["error"]

