"""The engine's outputs per step: streaming snapshots, or final outputs only."""

from __future__ import annotations

from engine import LLM, SamplingParams

GREEDY_2 = SamplingParams(temperature=0.0, max_tokens=2, min_tokens=2)
GREEDY_6 = SamplingParams(temperature=0.0, max_tokens=6, min_tokens=6)


def _drain(engine, final_only: bool) -> list:
    outs = []
    while engine.has_unfinished():
        outs += engine.step(final_only=final_only)
    return outs


def test_final_only_steps_return_each_request_once_when_it_finishes(tiny_llama_dir):
    engine = LLM(str(tiny_llama_dir)).engine
    streamed_ids = [engine.add_request("Hello", GREEDY_2), engine.add_request("Hello there", GREEDY_6)]
    streamed = _drain(engine, final_only=False)
    assert len(streamed) > 2 and not all(o.finished for o in streamed)

    final_ids = [engine.add_request("Hello", GREEDY_2), engine.add_request("Hello there", GREEDY_6)]
    final = _drain(engine, final_only=True)
    assert [o.request_id for o in final] == final_ids
    assert all(o.finished for o in final)

    last_streamed = {o.request_id: o for o in streamed if o.finished}
    for sid, out in zip(streamed_ids, final, strict=True):
        expected = last_streamed[sid].outputs[0]
        assert out.outputs[0].token_ids == expected.token_ids
        assert out.outputs[0].text == expected.text
        assert out.metrics.ttft is not None and out.metrics.finished_time is not None
