"""A speculative run (several tokens in one update) reaches the output as
plain decoding's tokens would: cut at the token that completes a stop
string, with the text before the stop string."""

from __future__ import annotations

from engine.output_processor import OutputProcessor
from engine.sampling_params import SamplingParams
from engine.step_io import RequestUpdate, SampledToken

PIECES = ["He", "llo", " wor", "ld", "!", " Bye"]


class PieceTokenizer:
    """Token i decodes to PIECES[i]."""

    def decode(self, ids, skip_special_tokens=True, clean_up_tokenization_spaces=False):
        return "".join(PIECES[i] for i in ids)


def run(stop: list[str], tokens: list[int]):
    processor = OutputProcessor(PieceTokenizer())
    processor.add_request("r", None, [0], SamplingParams(max_tokens=10, stop=stop, logprobs=0), 0.0)
    step = processor.process([RequestUpdate("r", "r", 0, [SampledToken(t, -0.5) for t in tokens])], 1.0)
    return step, step.outputs[0].outputs[0]


def test_a_run_is_cut_at_the_token_that_completes_a_stop_string():
    step, out = run(["orld"], [0, 1, 2, 3, 4, 5])
    assert out.token_ids == [0, 1, 2, 3] and len(out.logprobs) == 4
    assert out.text == "Hello w" and out.finish_reason == "stop" and out.stop_reason == "orld"
    assert step.stopped == ["r"]


def test_a_run_without_a_stop_string_match_is_kept_whole():
    step, out = run(["Ciao"], [0, 1, 2, 3, 4, 5])
    assert out.token_ids == [0, 1, 2, 3, 4, 5] and out.finish_reason is None
    assert out.text == "Hello world! Bye" and not step.stopped
