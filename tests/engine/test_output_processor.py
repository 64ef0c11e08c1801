"""The engine's outputs per step: streamed deltas, or final outputs only."""

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

    for sid, out in zip(streamed_ids, final, strict=True):
        deltas = [c for o in streamed if o.request_id == sid for c in o.outputs]
        assert out.outputs[0].token_ids == sum((c.token_ids for c in deltas), [])
        assert out.outputs[0].text == "".join(c.text for c in deltas)
        assert out.num_output_tokens == len(out.outputs[0].token_ids)
        assert out.metrics.ttft is not None and out.metrics.finished_time is not None


def test_streamed_outputs_are_deltas_that_merge_into_the_final_output(tiny_llama_dir):
    """Each step's output carries only that step's tokens (no copy of what
    came before), each choice's finish reason exactly once, and
    `RequestOutput.add` folds them into what a final-only caller gets."""
    engine = LLM(str(tiny_llama_dir)).engine
    params = SamplingParams(temperature=0.0, max_tokens=6, min_tokens=6, n=3, logprobs=2)
    engine.add_request("Hello there", params, request_id="streamed")
    deltas = _drain(engine, final_only=False)
    engine.add_request("Hello there", params, request_id="final")
    (final,) = _drain(engine, final_only=True)

    assert all(len(c.token_ids) <= 1 and len(c.logprobs) == len(c.token_ids) for d in deltas for c in d.outputs)
    assert [d.num_output_tokens for d in deltas] == [3 * k for k in range(1, 7)]
    finishes = [(c.index, c.finish_reason) for d in deltas for c in d.outputs if c.finished]
    assert sorted(finishes) == [(0, "length"), (1, "length"), (2, "length")]
    merged = deltas[0]
    for d in deltas[1:]:
        merged.add(d)
    assert merged.finished and merged.num_output_tokens == final.num_output_tokens == 18
    assert merged.outputs == final.outputs
