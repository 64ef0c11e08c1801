"""What callers of the engine get back, in vLLM's shape.

An output is a delta, as with vLLM's `RequestOutputKind.DELTA`: its text,
token ids and logprobs are what the request produced since its previous
output. A request that gives only its final output (`LLMEngine.step(
final_only=True)`, as `LLM.generate` runs) therefore gets everything in it.
`RequestOutput.add` folds a later delta into an earlier one, so a reader
that falls behind takes one merged delta instead of a queue of them.
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(frozen=True)
class TokenLogprob:
    token_id: int
    logprob: float
    # (token_id, logprob), best first; empty unless top logprobs were asked for.
    top_logprobs: tuple[tuple[int, float], ...] = ()


@dataclass
class CompletionOutput:
    """One of the request's n completions: what it produced since the
    request's previous output. A completion appears in a delta only when it
    changed, and its `finish_reason` in exactly one delta."""

    index: int
    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    finish_reason: str | None = None  # "stop", "length", "abort", "error" or None while running
    # The stop string or stop token id that ended it, if any.
    stop_reason: str | int | None = None
    logprobs: list[TokenLogprob] | None = None

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    def add(self, later: CompletionOutput) -> None:
        """Append `later`, this completion's next delta."""
        self.text += later.text
        self.token_ids.extend(later.token_ids)
        if later.logprobs is not None:
            if self.logprobs is None:
                self.logprobs = []
            self.logprobs.extend(later.logprobs)
        if later.finish_reason is not None:
            self.finish_reason, self.stop_reason = later.finish_reason, later.stop_reason

    @property
    def cumulative_logprob(self) -> float | None:
        if self.logprobs is None:
            return None
        return sum(lp.logprob for lp in self.logprobs)


@dataclass
class RequestMetrics:
    """Seconds on the engine's clock (injected; time.monotonic by default)."""

    arrival_time: float
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    finished_time: float | None = None

    @property
    def queue_time(self) -> float | None:
        if self.first_scheduled_time is None:
            return None
        return self.first_scheduled_time - self.arrival_time

    @property
    def ttft(self) -> float | None:
        if self.first_token_time is None:
            return None
        return self.first_token_time - self.arrival_time


@dataclass
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool = False
    num_cached_tokens: int = 0
    metrics: RequestMetrics | None = None
    # Set when the engine failed this request (the step loop raised).
    error: str | None = None
    # Tokens generated so far by all n completions. Unlike the content this
    # is cumulative, so usage and billing need only the latest output.
    num_output_tokens: int = 0

    def add(self, later: RequestOutput) -> None:
        """Fold `later`, the request's next delta, into this one: texts,
        token ids and logprobs append per completion, in order; the state
        (finished, error, counts, metrics) becomes the later one's."""
        mine = {c.index: c for c in self.outputs}
        for c in later.outputs:
            if c.index not in mine:  # a copy: `later` stays the caller's
                mine[c.index] = CompletionOutput(index=c.index)
                self.outputs.append(mine[c.index])
            mine[c.index].add(c)
        self.outputs.sort(key=lambda c: c.index)
        self.finished = later.finished
        self.num_cached_tokens = later.num_cached_tokens
        self.num_output_tokens = later.num_output_tokens
        self.metrics = later.metrics
        if later.error is not None:
            self.error = later.error
