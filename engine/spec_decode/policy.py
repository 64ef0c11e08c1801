"""Which sequences speculate, how many drafts each may carry, and the
counters vLLM publishes about it. Pure Python: the scheduler asks.

A sequence speculates only when verifying its drafts is exact, i.e. when
sampling at draft position i needs nothing but the tokens before it:
- no grammar (its matcher would have to advance through drafts and roll back);
- no presence / frequency / repetition penalties (kept plain, as in vLLM's
  n-gram path, so the sampler's penalty pass stays one row per sequence);
- one sequence (n > 1 speculates after its prompt has forked, not before).
min_tokens, logprobs and seeded sampling are exact: the runner samples each
position as if the earlier drafts were already output (engine/runner.py).
"""

from __future__ import annotations

from dataclasses import dataclass

from engine.config import SpeculativeConfig
from engine.request import Request
from engine.spec_decode.ngram import NgramProposer


@dataclass
class SpecDecodeStats:
    """Cumulative, in vLLM's terms: a draft is one sequence's drafts in one
    step; accepted tokens are drafts the target model agreed with."""

    num_drafts: int = 0
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0

    def observe(self, num_draft_tokens: int, num_accepted: int) -> None:
        self.num_drafts += 1
        self.num_draft_tokens += num_draft_tokens
        self.num_accepted_tokens += num_accepted


class SpeculationPolicy:
    def __init__(self, config: SpeculativeConfig):
        self.config = config
        self.proposer = NgramProposer(config.prompt_lookup_min, config.prompt_lookup_max)
        self.stats = SpecDecodeStats()

    def speculates_this_step(self, num_decodes: int) -> bool:
        """Off for the whole step above the batch-size threshold: there the
        drafts' extra tokens cost more than the steps they save."""
        return num_decodes <= self.config.speculative_disable_batch_size

    def drafts(self, req: Request, budget: int) -> list[int]:
        """Draft tokens for a decoding `req` whose slice may hold `budget`
        tokens (the last known token included); [] when it stays plain."""
        if not _exact_to_verify(req):
            return []
        k = min(self.config.num_speculative_tokens, budget - 1, _room(req))
        if k < 1:
            return []
        return self.proposer.propose(req.all_token_ids, k)


def _exact_to_verify(req: Request) -> bool:
    params = req.sampling_params
    return params.structured is None and not params.has_penalties and req.num_seqs == 1


def _room(req: Request) -> int:
    """Drafts that can all be accepted without passing max_tokens or the
    length limit: a fully accepted run emits one more token than it drafts."""
    by_max_tokens = req.sampling_params.max_tokens - len(req.output_token_ids) - 1
    by_length = (req.max_model_len or 0) - req.num_tokens - 1
    return min(by_max_tokens, by_length)
