"""Turns the scheduler's per-sequence updates into RequestOutputs, each
the delta since the request's previous output (engine/outputs.py).

Owns detokenization and stop strings (text-level stops need the tokenizer,
which the scheduler must not know about): a matched stop string is reported
back so the engine finishes that sequence in the scheduler.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from engine.detokenizer import DetokenizerResult, IncrementalDetokenizer
from engine.outputs import CompletionOutput, RequestMetrics, RequestOutput, TokenLogprob
from engine.request import FinishReason, fork_request_id
from engine.sampling_params import SamplingParams
from engine.step_io import RequestUpdate, SampledToken


@dataclass
class _Sequence:
    """One of a request's n completions: its detokenizer, whether it ended,
    and what it produced since the request's last output. Nothing else is
    kept, so an output costs O(what is new), not O(tokens so far)."""

    index: int
    detokenizer: IncrementalDetokenizer
    with_logprobs: bool
    finish_reason: str | None = None
    pending: CompletionOutput | None = None

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    def new_output(self) -> CompletionOutput:
        """The undelivered delta, to add to."""
        if self.pending is None:
            self.pending = CompletionOutput(index=self.index, logprobs=[] if self.with_logprobs else None)
        return self.pending

    def finish(self, reason: str, stop_reason: str | int | None = None) -> CompletionOutput:
        self.finish_reason = reason
        out = self.new_output()
        out.finish_reason, out.stop_reason = reason, stop_reason
        return out

    def take(self) -> CompletionOutput | None:
        out, self.pending = self.pending, None
        return out


@dataclass
class _Group:
    """One caller-visible request: its n completions."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    params: SamplingParams
    metrics: RequestMetrics
    sequences: list[_Sequence]
    num_cached_tokens: int = 0
    num_output_tokens: int = 0
    changed: bool = False

    @property
    def finished(self) -> bool:
        return all(s.finished for s in self.sequences)

    def output(self) -> RequestOutput:
        """The delta since the previous output: the completions that changed."""
        return RequestOutput(
            request_id=self.request_id,
            prompt=self.prompt,
            prompt_token_ids=self.prompt_token_ids,
            outputs=[c for c in (s.take() for s in self.sequences) if c is not None],
            finished=self.finished,
            num_cached_tokens=self.num_cached_tokens,
            metrics=self.metrics,
            num_output_tokens=self.num_output_tokens,
        )


@dataclass
class ProcessedStep:
    outputs: list[RequestOutput]
    # Sequence ids whose stop string matched: finish them in the scheduler.
    stopped: list[str] = field(default_factory=list)


class OutputProcessor:
    def __init__(self, tokenizer):
        self.tokenizer = tokenizer
        self._groups: dict[str, _Group] = {}

    def __contains__(self, request_id: str) -> bool:
        return request_id in self._groups

    def add_request(self, request_id: str, prompt: str | None, prompt_token_ids: list[int],
                    params: SamplingParams, arrival_time: float) -> None:
        self._groups[request_id] = _Group(
            request_id=request_id,
            prompt=prompt,
            prompt_token_ids=prompt_token_ids,
            params=params,
            metrics=RequestMetrics(arrival_time=arrival_time),
            sequences=[_Sequence(i, IncrementalDetokenizer(self.tokenizer, params), params.logprobs is not None)
                       for i in range(params.n)],
        )

    def mark_scheduled(self, group_id: str, now: float, num_cached_tokens: int) -> None:
        group = self._groups.get(group_id)
        if group is not None and group.metrics.first_scheduled_time is None:
            group.metrics.first_scheduled_time = now
            group.num_cached_tokens = num_cached_tokens

    def process(self, updates: list[RequestUpdate], now: float, *, final_only: bool = False) -> ProcessedStep:
        """Apply one step's updates. Every request that changed gets an
        output, the delta since its previous one; with `final_only`, only the
        requests that finished do, so their one output holds everything (the
        offline API reads nothing else)."""
        step = ProcessedStep(outputs=[])
        for upd in updates:
            group = self._groups.get(upd.group_id)
            if group is None:
                continue
            if self._apply(group, upd):
                step.stopped.append(fork_request_id(group.request_id, upd.index))
            if group.metrics.first_token_time is None:
                group.metrics.first_token_time = now
            group.changed = True
        for group in list(self._groups.values()):
            if group.changed:
                group.changed = False
                if group.finished:
                    group.metrics.finished_time = now
                    del self._groups[group.request_id]
                elif final_only:
                    continue
                step.outputs.append(group.output())
        return step

    def finish(self, request_id: str, reason: FinishReason, now: float,
               error: str | None = None) -> RequestOutput | None:
        """End every unfinished completion of a request (abort, engine failure)."""
        group = self._groups.pop(request_id, None)
        if group is None:
            return None
        for seq in group.sequences:
            if not seq.finished:
                out = seq.finish(reason.value)
                out.text += seq.detokenizer.finish()
        group.metrics.finished_time = now
        out = group.output()
        out.error = error
        return out

    def request_ids(self) -> list[str]:
        return list(self._groups)

    @staticmethod
    def _apply(group: _Group, upd: RequestUpdate) -> bool:
        """Add one update's tokens; True when a stop string ended the sequence."""
        seq = group.sequences[upd.index]
        if seq.finished:
            return False
        tokens, result = _detokenize(seq.detokenizer, upd.new_tokens)
        ids = [t.token_id for t in tokens]
        group.num_output_tokens += len(ids)
        out = seq.new_output()
        out.token_ids.extend(ids)
        if out.logprobs is not None:
            out.logprobs.extend(TokenLogprob(t.token_id, t.logprob, t.top_logprobs or ()) for t in tokens)
        out.text += result.new_text
        stopped_by_string = result.stop_matched is not None
        if stopped_by_string:
            seq.finish(FinishReason.STOP.value, result.stop_matched)
        elif upd.finish_reason is not None:
            last = ids[-1] if ids else None
            stop_token = upd.finish_reason is FinishReason.STOP and last in group.params.stop_token_ids
            seq.finish(upd.finish_reason.value, last if stop_token else None)
            out.text += seq.detokenizer.finish()
        # A stop string ends the sequence here even if the scheduler has not.
        return stopped_by_string and upd.finish_reason is None


def _detokenize(detokenizer: IncrementalDetokenizer,
                tokens: list[SampledToken]) -> tuple[list[SampledToken], DetokenizerResult]:
    """Feed one update's tokens; the tokens kept and the text. Several tokens
    (a speculative run) go in one at a time while stop strings are set, so
    the output ends at the token that completed a stop string, as it would
    have without speculation."""
    if len(tokens) < 2 or not detokenizer.has_stop_strings:
        return tokens, detokenizer.append([t.token_id for t in tokens])
    text = []
    for i, token in enumerate(tokens):
        result = detokenizer.append([token.token_id])
        text.append(result.new_text)
        if result.stop_matched is not None:
            return tokens[:i + 1], DetokenizerResult("".join(text), result.stop_matched)
    return tokens, DetokenizerResult("".join(text), None)
