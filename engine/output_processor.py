"""Turns the scheduler's per-sequence updates into RequestOutputs.

Owns detokenization and stop strings (text-level stops need the tokenizer,
which the scheduler must not know about): a matched stop string is reported
back so the engine finishes that sequence in the scheduler.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from engine.detokenizer import IncrementalDetokenizer
from engine.outputs import CompletionOutput, RequestMetrics, RequestOutput, TokenLogprob
from engine.request import FinishReason, fork_request_id
from engine.sampling_params import SamplingParams
from engine.step_io import RequestUpdate


@dataclass
class _Group:
    """One caller-visible request: its n completions and their detokenizers."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    params: SamplingParams
    metrics: RequestMetrics
    completions: list[CompletionOutput]
    detokenizers: list[IncrementalDetokenizer]
    num_cached_tokens: int = 0
    changed: bool = False

    @property
    def finished(self) -> bool:
        return all(c.finished for c in self.completions)

    def output(self) -> RequestOutput:
        return RequestOutput(
            request_id=self.request_id,
            prompt=self.prompt,
            prompt_token_ids=self.prompt_token_ids,
            outputs=[_snapshot(c) for c in self.completions],
            finished=self.finished,
            num_cached_tokens=self.num_cached_tokens,
            metrics=self.metrics,
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
            completions=[CompletionOutput(index=i, logprobs=[] if params.logprobs is not None else None)
                         for i in range(params.n)],
            detokenizers=[IncrementalDetokenizer(self.tokenizer, params) for _ in range(params.n)],
        )

    def mark_scheduled(self, group_id: str, now: float, num_cached_tokens: int) -> None:
        group = self._groups.get(group_id)
        if group is not None and group.metrics.first_scheduled_time is None:
            group.metrics.first_scheduled_time = now
            group.num_cached_tokens = num_cached_tokens

    def process(self, updates: list[RequestUpdate], now: float, *, final_only: bool = False) -> ProcessedStep:
        """Apply one step's updates. Every request that changed gets an
        output, a snapshot of its completions so far; with `final_only`, only
        the requests that finished do. The offline API reads nothing else,
        and snapshotting every running request costs O(tokens so far) per
        request per step, O(length^2) over a generation."""
        step = ProcessedStep(outputs=[])
        for group in self._groups.values():
            for c in group.completions:
                c.delta_text, c.delta_token_ids = "", []
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
        for comp, detok in zip(group.completions, group.detokenizers):
            if not comp.finished:
                comp.delta_text, comp.delta_token_ids = detok.finish(), []
                comp.text += comp.delta_text
                comp.finish_reason = reason.value
        group.metrics.finished_time = now
        out = group.output()
        out.error = error
        return out

    def request_ids(self) -> list[str]:
        return list(self._groups)

    @staticmethod
    def _apply(group: _Group, upd: RequestUpdate) -> bool:
        """Add one update's tokens; True when a stop string ended the sequence."""
        comp = group.completions[upd.index]
        detok = group.detokenizers[upd.index]
        if comp.finished:
            return False
        ids = [t.token_id for t in upd.new_tokens]
        comp.token_ids.extend(ids)
        comp.delta_token_ids.extend(ids)
        if comp.logprobs is not None:
            comp.logprobs.extend(
                TokenLogprob(t.token_id, t.logprob, t.top_logprobs or ()) for t in upd.new_tokens)
        result = detok.append(ids)
        comp.delta_text += result.new_text
        stopped_by_string = result.stop_matched is not None
        if stopped_by_string:
            comp.finish_reason = FinishReason.STOP.value
            comp.stop_reason = result.stop_matched
        elif upd.finish_reason is not None:
            comp.finish_reason = upd.finish_reason.value
            last = ids[-1] if ids else None
            if upd.finish_reason is FinishReason.STOP and last in group.params.stop_token_ids:
                comp.stop_reason = last
        if comp.finished and not stopped_by_string:
            comp.delta_text += detok.finish()
        comp.text += comp.delta_text
        # A stop string ends the sequence here even if the scheduler has not.
        return stopped_by_string and upd.finish_reason is None


def _snapshot(c: CompletionOutput) -> CompletionOutput:
    return CompletionOutput(
        index=c.index,
        text=c.text,
        token_ids=list(c.token_ids),
        finish_reason=c.finish_reason,
        stop_reason=c.stop_reason,
        logprobs=list(c.logprobs) if c.logprobs is not None else None,
        delta_text=c.delta_text,
        delta_token_ids=list(c.delta_token_ids),
    )
