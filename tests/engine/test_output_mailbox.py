"""The per-request mailbox between the engine thread and its reader: deltas
a reader has not taken are merged, never queued, and an error comes last."""

from __future__ import annotations

import asyncio

from engine.errors import EngineDeadError
from engine.output_mailbox import OutputMailbox
from engine.outputs import CompletionOutput, RequestOutput, TokenLogprob


def _delta(step: int, *, finished: bool = False) -> RequestOutput:
    """Step `step`'s delta for choices 0 and 1: one token each, its logprob."""
    outs = [CompletionOutput(index=i, text=f"<{i}.{step}>", token_ids=[100 * i + step],
                             logprobs=[TokenLogprob(100 * i + step, -float(step), ((100 * i + step, -1.0),))],
                             finish_reason="length" if finished else None)
            for i in (0, 1)]
    return RequestOutput("r", None, [1, 2], outs, finished=finished, num_output_tokens=2 * step)


def test_deltas_a_reader_has_not_taken_merge_into_one_in_order():
    async def main():
        box = OutputMailbox()
        box.put(_delta(1))
        first = await box.get()
        for step in range(2, 6):  # the reader is away for four steps
            box.put(_delta(step))
        box.put(_delta(6, finished=True))
        merged = await box.get()
        return first, merged, box.empty()

    first, merged, empty = asyncio.run(main())
    assert [c.token_ids for c in first.outputs] == [[1], [101]]
    assert empty and merged.finished and merged.num_output_tokens == 12
    for i, c in enumerate(merged.outputs):
        steps = range(2, 7)
        assert c.index == i and c.text == "".join(f"<{i}.{s}>" for s in steps)
        assert c.token_ids == [100 * i + s for s in steps]
        assert [lp.logprob for lp in c.logprobs] == [-float(s) for s in steps]
        assert c.finish_reason == "length"


def test_a_choice_first_seen_in_a_later_delta_is_added_and_choices_stay_in_index_order():
    async def main():
        box = OutputMailbox()
        only_1 = _delta(1)
        only_1.outputs = only_1.outputs[1:]
        box.put(only_1)
        box.put(_delta(2))
        return await box.get()

    merged = asyncio.run(main())
    assert [(c.index, c.token_ids) for c in merged.outputs] == [(0, [2]), (1, [101, 102])]


def test_an_error_comes_after_the_outputs_and_again_on_every_later_get():
    async def main():
        box = OutputMailbox()
        box.put(_delta(1))
        box.put(EngineDeadError("boom"))
        box.put(_delta(2))  # cannot happen after an error, but must not hide it
        return [await box.get() for _ in range(3)]

    out, error, again = asyncio.run(main())
    assert [c.token_ids for c in out.outputs] == [[1, 2], [101, 102]]
    assert isinstance(error, EngineDeadError) and again is error
