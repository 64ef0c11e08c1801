"""The logit edits that come before sampling: penalties, then the
min_tokens mask (steps 1 and 2 of engine/sampler.py's order of operations).

They are kept as sparse overrides, flat `row * V + token` keys with their
new values, not written into a copy of the whole [rows, V] logits: a step
changes only the positions of the tokens its requests have seen (and their
stop ids), a small part of up to 256 x 49k, and the sampler writes them
into the rows it works on (Overrides.apply). The logits themselves are
never written, so logprobs stay those of the raw logits.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass

import torch

from engine.step_io import ScheduledRequest


@dataclass
class Overrides:
    """Logit positions changed by penalties or min_tokens, as flat
    `row * V + token` keys into the step's logits with their new values.
    Layers are written in order, so the min_tokens mask wins over a penalty."""

    keys: list[torch.Tensor]
    values: list[torch.Tensor]

    @staticmethod
    def none() -> Overrides:
        return Overrides(keys=[], values=[])

    def apply(self, x: torch.Tensor, rows: torch.Tensor | None, num_rows: int) -> None:
        """Write into x, whose row i is global row rows[i] (rows=None: all
        `num_rows` rows in order), the overrides of its rows."""
        vocab = x.shape[1]
        local = None
        if rows is not None and self.keys:
            local = torch.full((num_rows,), -1, dtype=torch.int64, device=x.device)
            local[rows] = torch.arange(rows.numel(), device=x.device)
        for keys, values in zip(self.keys, self.values):
            r, c = keys // vocab, keys % vocab
            if local is not None:
                r = local[r]
                mine = r >= 0
                r, c, values = r[mine], c[mine], values[mine]
            x[r, c] = values


def build_overrides(logits: torch.Tensor, requests: list[ScheduledRequest],
                     eos_token_ids: frozenset[int]) -> Overrides:
    """Penalised values of the seen tokens, then -inf masks for min_tokens."""
    out = Overrides.none()
    if any(r.sampling_params.has_penalties for r in requests):
        add_penalties(out, logits, requests)
    vocab = logits.shape[1]
    masked: set[int] = set()
    for i, r in enumerate(requests):
        p = r.sampling_params
        if len(r.output_token_ids) < p.min_tokens:
            ids = set(p.stop_token_ids) if p.ignore_eos else set(p.stop_token_ids) | eos_token_ids
            masked.update(i * vocab + t for t in ids if t < vocab)
    if masked:
        keys = torch.tensor(sorted(masked), dtype=torch.int64, device=logits.device)
        out.keys.append(keys)
        out.values.append(torch.full((keys.numel(),), float("-inf"), dtype=logits.dtype,
                                     device=logits.device))
    return out


def add_penalties(out: Overrides, logits: torch.Tensor, requests: list[ScheduledRequest]) -> None:
    """Two layers: repetition over prompt + output tokens; then, over output
    tokens, repetition again minus (frequency * count + presence)."""
    vocab = logits.shape[1]
    dev, dtype = logits.device, logits.dtype
    flat = logits.view(-1)
    params = [r.sampling_params for r in requests]
    repetition = torch.tensor([p.repetition_penalty for p in params], dtype=dtype, device=dev)

    def repeated(keys: torch.Tensor) -> torch.Tensor:
        values = flat[keys]
        rep = repetition[keys // vocab]
        return torch.where(values > 0, values / rep, values * rep)

    rep_rows = [i for i, p in enumerate(params) if p.repetition_penalty != 1.0]
    if rep_rows:
        seen = [list(set(requests[i].prompt_token_ids).union(requests[i].output_token_ids))
                for i in rep_rows]
        keys = flat_keys(seen, rep_rows, vocab, dev)
        out.keys.append(keys)
        out.values.append(repeated(keys))
    count_rows = [i for i, p in enumerate(params)
                  if (p.frequency_penalty != 0.0 or p.presence_penalty != 0.0)
                  and requests[i].output_token_ids]
    if count_rows:
        counters = [Counter(requests[i].output_token_ids) for i in count_rows]
        keys = flat_keys([list(c) for c in counters], count_rows, vocab, dev)
        counts = torch.tensor([n for c in counters for n in c.values()], dtype=dtype, device=dev)
        frequency = torch.tensor([p.frequency_penalty for p in params], dtype=dtype, device=dev)
        presence = torch.tensor([p.presence_penalty for p in params], dtype=dtype, device=dev)
        row = keys // vocab
        out.keys.append(keys)
        out.values.append(repeated(keys) - frequency[row] * counts - presence[row])


def flat_keys(token_lists: list[list[int]], rows: list[int], vocab: int, device) -> torch.Tensor:
    """`rows[i] * vocab + token` for every token of token_lists[i]."""
    tokens = torch.tensor([t for ids in token_lists for t in ids], dtype=torch.int64)
    assert tokens.numel() == 0 or int(tokens.max()) < vocab, "token id outside the logits"
    lengths = torch.tensor([len(ids) for ids in token_lists])
    offsets = torch.repeat_interleave(torch.tensor(rows, dtype=torch.int64) * vocab, lengths)
    return (tokens + offsets).to(device)
