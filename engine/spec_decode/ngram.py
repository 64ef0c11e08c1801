"""N-gram prompt lookup: draft the tokens that followed the latest earlier
occurrence of the sequence's last n tokens (vLLM's `ngram` method, after
"prompt lookup decoding"). Pure Python, no model: drafts are free to make
and pay off when the output copies its context (editing, summarising with
quotes, code, repeated structure).

The longest n in [min_n, max_n] that matches anywhere earlier wins; among
its occurrences the most recent one. The tokens after it are the draft,
up to k of them; they may run into the matched suffix itself, so a
repeating pattern keeps drafting its continuation.
"""

from __future__ import annotations

from typing import Sequence


class NgramProposer:
    def __init__(self, min_n: int, max_n: int):
        assert 1 <= min_n <= max_n
        self.min_n = min_n
        self.max_n = max_n

    def propose(self, tokens: Sequence[int], k: int) -> list[int]:
        """Up to `k` draft tokens to follow `tokens` (prompt + output); [] when
        no n-gram of at least min_n tokens recurs or k < 1."""
        n_tokens = len(tokens)
        if k < 1 or n_tokens < self.min_n + 1:
            return []
        match_end = _latest_longest_match(tokens, self.min_n, self.max_n)
        if match_end is None:
            return []
        return list(tokens[match_end + 1:match_end + 1 + k])


def _latest_longest_match(tokens: Sequence[int], min_n: int, max_n: int) -> int | None:
    """Index i < len-1 where an earlier occurrence of the suffix ends, for
    the longest suffix of min_n..max_n tokens that has one; of those, the
    largest i. None if no suffix of min_n tokens recurs.

    One backward scan over the occurrences of the last token (found by
    list.index on the reversed list, which runs in C): the first occurrence
    seen whose match is longer than every later one is the latest of its
    length, so keeping the best so far gives both rules at once."""
    last = len(tokens) - 1
    reversed_tokens = list(reversed(tokens))
    best_len, best_end = 0, None
    pos = 1  # in reversed_tokens: skip the suffix's own last token
    while True:
        try:
            pos = reversed_tokens.index(reversed_tokens[0], pos)
        except ValueError:
            break
        end = last - pos
        length = 1
        limit = min(max_n, end + 1)
        while length < limit and tokens[end - length] == tokens[last - length]:
            length += 1
        if length > best_len:
            best_len, best_end = length, end
            if length == max_n:
                break
        pos += 1
    return best_end if best_len >= min_n else None
