"""The sampler stage of structured output: per-sequence grammar state, the
token bitmask applied to the rows that need it, and the sampled tokens fed
back.

State is keyed by sequence id and dropped only when the sequence finishes,
so a sequence preempted by recompute keeps its matcher: recompute rebuilds
the KV of tokens the matcher has already consumed, and the next sample
continues from the same grammar state.
"""

from __future__ import annotations

import logging

import torch

from engine.request import fork_request_id
from engine.step_io import SampledToken, ScheduledRequest

log = logging.getLogger(__name__)

_BITS = torch.arange(32, dtype=torch.int32)


class GrammarRuntime:
    """Not thread-safe: one per model runner, used from the step loop."""

    def __init__(self, vocab_size: int):
        # Imported here, not in the first constrained step: importing
        # llguidance.torch takes about a second.
        import llguidance
        import llguidance.torch

        self._fill_masks = llguidance.torch.fill_next_token_bitmask_par
        self.vocab_size = vocab_size
        self._words = (vocab_size + 31) // 32
        self._matchers: dict[str, object] = {}
        self._executor = llguidance.LLExecutor()

    def register(self, seq_id: str, matcher) -> None:
        self._matchers[seq_id] = matcher

    def __contains__(self, seq_id: str) -> bool:
        return seq_id in self._matchers

    def __len__(self) -> int:
        return len(self._matchers)

    def drop(self, seq_ids) -> None:
        for seq_id in seq_ids:
            self._matchers.pop(seq_id, None)

    def apply(self, logits: torch.Tensor, requests: list[ScheduledRequest]) -> None:
        """Set to -inf, in place, every logit the grammar of its row forbids.
        logits: [N, V] with row i for requests[i]; rows without a grammar are
        not touched."""
        rows = [(i, self._matchers[r.request_id]) for i, r in enumerate(requests)
                if r.request_id in self._matchers]
        if not rows:
            return
        bitmask = torch.empty(len(rows), self._words, dtype=torch.int32)
        # Masks of all rows in parallel, on llguidance's own threads.
        self._fill_masks(self._executor, [(m, k) for k, (_, m) in enumerate(rows)], bitmask)
        allowed = ((bitmask.unsqueeze(-1) >> _BITS) & 1).view(len(rows), -1).bool()
        index = torch.tensor([i for i, _ in rows], dtype=torch.int64, device=logits.device)
        width = min(logits.shape[1], allowed.shape[1])
        forbid = torch.ones(len(rows), logits.shape[1], dtype=torch.bool)
        forbid[:, :width] = ~allowed[:, :width]
        selected = logits.index_select(0, index)
        selected.masked_fill_(forbid.to(logits.device), float("-inf"))
        logits.index_copy_(0, index, selected)

    def advance(self, requests: list[ScheduledRequest], sampled: dict[str, list[SampledToken]]) -> None:
        """Feed each sequence's sampled token to its matcher. A request that
        forks into n sequences gives each child a copy of its state first."""
        for r in requests:
            matcher = self._matchers.get(r.request_id)
            if matcher is None:
                continue
            samples = sampled[r.request_id]
            for j, sample in enumerate(samples[1:], start=1):
                child = matcher.deep_copy()
                self._consume(child, sample.token_id, fork_request_id(r.request_id, j))
                self._matchers[fork_request_id(r.request_id, j)] = child
            self._consume(matcher, samples[0].token_id, r.request_id)

    @staticmethod
    def _consume(matcher, token_id: int, seq_id: str) -> None:
        if not matcher.consume_token(token_id) and not matcher.is_stopped():
            # The mask allowed the token, so this is llguidance running out of
            # fuel mid-sequence; from here its mask admits only EOS.
            log.warning("grammar of %s stopped: %s", seq_id, matcher.get_error()[:200])
