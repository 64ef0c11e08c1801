"""Verification of one sequence's drafts against the target model's samples.

The runner samples the target model at every position of a speculating
slice ([last token] + drafts), each position as if the drafts before it
were already output: sampled[i] is what plain decoding would emit after
drafts[:i]. Drafts are accepted while they equal those samples; the run
emitted is the accepted drafts plus the first sample that disagrees (or,
all accepted, the sample after the last draft: the bonus token).

For a deterministic draft (one token, probability 1) this is exact in
distribution, and token for token the same as plain decoding wherever the
samples are (greedy, or a seeded generator replayed as plain decoding
would consume it): by induction, every accepted prefix is what plain
decoding would have output, so the next sample is drawn from the same
context.
"""

from __future__ import annotations

from typing import Sequence, TypeVar

T = TypeVar("T")


def accepted_run(drafts: Sequence[int], sampled: Sequence[T], token_of=lambda s: s.token_id) -> list[T]:
    """The samples to emit: sampled[:a + 1], a = the drafts accepted.
    `sampled` has one entry per position, len(drafts) + 1."""
    assert len(sampled) == len(drafts) + 1, (len(sampled), len(drafts))
    accepted = 0
    while accepted < len(drafts) and token_of(sampled[accepted]) == drafts[accepted]:
        accepted += 1
    return list(sampled[:accepted + 1])
