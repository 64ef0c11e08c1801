"""The seam between scheduler and runner, and the usage record of each step.

`Scheduler.schedule()` returns a `SchedulerOutput`; the runner turns it into
a `RunnerOutput`; `Scheduler.update()` closes the loop and yields a
`StepUsage`. All plain dataclasses, so scheduler tests build the runner's
side by hand and never need torch. The slot loads they carry are the
adapters package's `AdapterLoad` (adapters/slot_load.py), which makes them.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from adapters.slot_load import AdapterLoad
from engine.request import AdapterKey, FinishReason, Tier
from engine.sampling_params import SamplingParams


@dataclass(frozen=True)
class CopyOp:
    """Copy one KV block before the forward pass (copy-on-write after a fork)."""

    src: int
    dst: int


@dataclass(frozen=True)
class Preemption:
    victim_id: str
    victim_tier: Tier
    # The request whose allocation forced it; None when the victim preempted itself.
    caused_by: str | None


@dataclass
class ScheduledRequest:
    """One request's slice of the step: compute `token_ids` at `start_pos`."""

    request_id: str
    group_id: str  # the caller's id (the parent's, for forked children)
    token_ids: list[int]  # the new tokens whose KV this step computes
    start_pos: int  # == num_computed_tokens before the step
    block_table: list[int]
    # Sample after this slice: its last token is the last known token.
    sample: bool
    # Samples drawn from the last position: n for a request finishing its
    # prompt that will fork into n sequences, else 1.
    num_samples: int
    sampling_params: SamplingParams
    # Tokens the penalties look at (prompt + output so far), only when sampling.
    prompt_token_ids: list[int]
    output_token_ids: list[int]
    adapter_key: AdapterKey | None = None
    # Facts for the step's usage record.
    tier: Tier = Tier.STANDARD
    prompt_len: int = 0
    computed_high_water: int = 0  # positions below it were computed before a preemption
    cached_prompt_tokens: int = 0  # prefix-cache hit, reported on the first slice only
    # Speculative decoding: the slice is [last known token] + these drafts,
    # and the runner samples at every position of it (engine/spec_decode/).
    draft_token_ids: list[int] = field(default_factory=list)

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)


@dataclass
class SchedulerOutput:
    step_id: int
    requests: list[ScheduledRequest]
    copies: list[CopyOp] = field(default_factory=list)
    preemptions: list[Preemption] = field(default_factory=list)
    # Requests that ended since the last step; the runner drops their state.
    finished_ids: list[str] = field(default_factory=list)
    # The share of the model's layers within which the runner may drop this
    # step for a premium arrival; 0: it may not (Scheduler.interrupted puts
    # the requests back as they were).
    droppable_share: float = 0.0

    @property
    def num_batched_tokens(self) -> int:
        return sum(r.num_tokens for r in self.requests)

    @property
    def is_empty(self) -> bool:
        return not self.requests


@dataclass(frozen=True)
class SampledToken:
    token_id: int
    logprob: float | None = None
    # (token_id, logprob) best first, when the request asked for top logprobs.
    top_logprobs: tuple[tuple[int, float], ...] | None = None


@dataclass
class RunnerOutput:
    # request_id -> samples for requests with sample=True: one per
    # num_samples; for a slice with drafts, the run to emit (the accepted
    # drafts' samples and one more, engine/spec_decode/verify.py).
    sampled: dict[str, list[SampledToken]]
    # Measured busy time of the step on the device, integer microseconds.
    busy_time_us: int
    # Slot loads inside this step; their time is part of busy_time_us.
    adapter_loads: tuple[AdapterLoad, ...] = ()
    # The step was dropped part way (sampled is empty): its tokens are
    # computed again in a later step.
    interrupted: bool = False
    share_done: float = 0.0  # of the model's layers, when it was dropped


@dataclass(frozen=True)
class RequestStepUsage:
    """What one request consumed in one step, in tokens."""

    request_id: str
    tier: Tier
    adapter_key: AdapterKey | None
    prompt_tokens_computed: int
    prompt_tokens_cached: int
    recomputed_tokens: int
    decode_tokens: int
    group_id: str = ""  # the caller's id (the parent's, for forked children)

    @property
    def computed_tokens(self) -> int:
        return self.prompt_tokens_computed + self.recomputed_tokens + self.decode_tokens

    @classmethod
    def from_slice(cls, item: ScheduledRequest) -> RequestStepUsage:
        """Split a slice's tokens into fresh prompt, recomputed and decode tokens.

        Positions below the request's previous high-water mark were computed
        before a preemption: computing them again is recomputation."""
        start, end = item.start_pos, item.start_pos + item.num_tokens
        recomputed = max(0, min(end, item.computed_high_water) - start)
        fresh_start = max(start, item.computed_high_water)
        return cls(
            request_id=item.request_id,
            tier=item.tier,
            adapter_key=item.adapter_key,
            prompt_tokens_computed=max(0, min(end, item.prompt_len) - fresh_start),
            prompt_tokens_cached=item.cached_prompt_tokens,
            recomputed_tokens=recomputed,
            decode_tokens=max(0, end - max(fresh_start, item.prompt_len)),
            group_id=item.group_id,
        )


@dataclass(frozen=True)
class StepUsage:
    """One record per step; the billing meter splits busy time by computed tokens."""

    step_id: int
    busy_time_us: int
    requests: tuple[RequestStepUsage, ...]
    preemptions: tuple[Preemption, ...] = ()
    adapter_loads: tuple[AdapterLoad, ...] = ()  # their time is part of busy_time_us


@dataclass
class RequestUpdate:
    """What one step changed for one sequence, as the engine loop sees it."""

    request_id: str
    group_id: str  # the id the caller used (the parent's, for forked children)
    index: int  # which of the n completions
    new_tokens: list[SampledToken]
    finish_reason: FinishReason | None = None


@dataclass
class StepResult:
    updates: list[RequestUpdate]
    usage: StepUsage


def split_exact(total: int, weights: list[int]) -> list[int]:
    """`total` split in proportion to `weights`, in integers summing to
    `total` exactly: floors first, then one more unit to the largest
    remainders (earlier index wins a tie). All-zero weights split nothing.
    The rule by which busy time is shared (billing's meter, and a worker
    splitting a step between gateways)."""
    weight_sum = sum(weights)
    if weight_sum <= 0:
        return [0] * len(weights)
    shares = [total * w // weight_sum for w in weights]
    left = total - sum(shares)
    by_remainder = sorted(range(len(weights)), key=lambda i: (-(total * weights[i] % weight_sum), i))
    for i in by_remainder[:left]:
        shares[i] += 1
    return shares
