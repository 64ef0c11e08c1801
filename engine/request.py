"""The engine's view of one request: tokens, progress and status.

Plain Python, shared by the scheduler, the KV cache manager and the engine
loop. Nothing here touches torch or a clock.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from adapters.slot_load import AdapterKey
from engine.sampling_params import SamplingParams


class Tier(str, enum.Enum):
    PREMIUM = "premium"
    STANDARD = "standard"

    @property
    def rank(self) -> int:
        """Lower rank is served first and preempted last."""
        return 0 if self is Tier.PREMIUM else 1


class FinishReason(str, enum.Enum):
    STOP = "stop"
    LENGTH = "length"
    ABORT = "abort"
    ERROR = "error"


class RequestStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    PREEMPTED = "preempted"
    FINISHED = "finished"


@dataclass(eq=False)
class Request:
    """One sequence being generated.

    A request with `sampling_params.n > 1` runs its prompt once; when the
    prompt is done the scheduler forks it into `n` sequences that share the
    prompt's KV blocks (`parent_id` and `index` tie the children together).
    """

    request_id: str
    prompt_token_ids: list[int]
    sampling_params: SamplingParams
    arrival_seq: int
    tier: Tier = Tier.STANDARD
    adapter_key: AdapterKey | None = None
    cache_salt: str | None = None
    eos_token_ids: frozenset[int] = frozenset()
    max_model_len: int | None = None
    parent_id: str | None = None
    index: int = 0

    output_token_ids: list[int] = field(default_factory=list)
    num_computed_tokens: int = 0
    status: RequestStatus = RequestStatus.WAITING
    finish_reason: FinishReason | None = None
    # Prompt tokens found in the prefix cache when the request was first admitted.
    num_cached_prompt_tokens: int = 0
    num_preemptions: int = 0
    # Highest num_computed_tokens ever reached: tokens below it are recomputation.
    computed_high_water: int = 0
    # The prompt has been sampled n times and the children exist (n > 1 only).
    forked: bool = False
    # The first scheduled slice reports num_cached_prompt_tokens to billing once.
    cached_reported: bool = False

    @property
    def all_token_ids(self) -> list[int]:
        return self.prompt_token_ids + self.output_token_ids

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    @property
    def num_remaining_tokens(self) -> int:
        """Known tokens whose KV is not computed yet (1 while decoding)."""
        return self.num_tokens - self.num_computed_tokens

    @property
    def num_seqs(self) -> int:
        """Sequences this request will occupy: n until it has forked."""
        return 1 if self.forked else self.sampling_params.n

    @property
    def is_finished(self) -> bool:
        return self.status is RequestStatus.FINISHED

    @property
    def group_id(self) -> str:
        """The id the caller knows: the parent's id for forked children."""
        return self.parent_id if self.parent_id is not None else self.request_id

    @property
    def priority(self) -> tuple[int, int, int]:
        """Sort key: tier first, then arrival (FCFS), then fork index."""
        return (self.tier.rank, self.arrival_seq, self.index)

    def token_slice(self, start: int, end: int) -> list[int]:
        """all_token_ids[start:end] without concatenating the whole sequence
        (a decode step needs one token of a possibly long list)."""
        prompt, n = self.prompt_token_ids, self.num_prompt_tokens
        if start >= n:
            return self.output_token_ids[start - n:end - n]
        if end <= n:
            return prompt[start:end]
        return prompt[start:] + self.output_token_ids[:end - n]

    def stop_reason(self, token_id: int) -> FinishReason | None:
        """Why appending `token_id` (already in output_token_ids) ends the
        request, if it does."""
        params = self.sampling_params
        num_out = len(self.output_token_ids)
        if num_out >= params.min_tokens:
            if not params.ignore_eos and token_id in self.eos_token_ids:
                return FinishReason.STOP
            if token_id in params.stop_token_ids:
                return FinishReason.STOP
        if num_out >= params.max_tokens or self.num_tokens >= self.max_model_len:
            return FinishReason.LENGTH
        return None


def fork_request_id(parent_id: str, index: int) -> str:
    """Id of the index-th sequence of a request with n > 1; index 0 is the parent."""
    return parent_id if index == 0 else f"{parent_id}#{index}"
