"""The per-step batch layout that every SGMV op reads.

The runner orders a step's T tokens so that the tokens of one adapter slot
are contiguous. A *segment* is a maximal run of tokens with the same slot.
`build_sgmv_meta` turns the requests of a step, in batch order, into
segments once per step; the same `SGMVMeta` then serves every LoRA
projection of every layer.

Tokens without an adapter form no segment: the metadata lists only segments
that have a slot, so `seg_slots` never holds a sentinel. Shrink writes zero
for the rows no segment covers, and expand leaves them alone.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from functools import cached_property

import torch


@dataclass
class SGMVMeta:
    """Segments of one step's batch. Device tensors for the kernels, the same
    facts as host lists for loops and shapes (no device sync to read them)."""

    seg_starts: torch.Tensor  # [S] int32: first token row of each segment
    seg_lens: torch.Tensor  # [S] int32: tokens in each segment, all > 0
    seg_slots: torch.Tensor  # [S] int32: adapter slot of each segment, all >= 0
    seg_starts_host: list[int]
    seg_lens_host: list[int]
    seg_slots_host: list[int]
    max_seg_len: int  # 0 when there are no segments
    num_tokens: int  # T: every token of the batch, with or without an adapter

    @property
    def num_segments(self) -> int:
        return len(self.seg_lens_host)

    @property
    def num_lora_tokens(self) -> int:
        """Tokens covered by a segment; the rest have no adapter."""
        return sum(self.seg_lens_host)

    @property
    def has_lora(self) -> bool:
        return bool(self.seg_lens_host)

    @cached_property
    def row_split_sizes(self) -> list[int]:
        """The batch's rows cut into [gap, segment, gap, segment, ..., tail]
        (gaps of base tokens, possibly empty): `t.split(sizes)[1::2]` gives
        every segment's rows in one call, which a CPU loop over segments
        pays far less for than slicing each one."""
        sizes, row = [], 0
        for start, length in zip(self.seg_starts_host, self.seg_lens_host):
            sizes += [start - row, length]
            row = start + length
        sizes.append(self.num_tokens - row)
        return sizes


def build_sgmv_meta(
    token_counts: Sequence[int],  # new tokens of each request this step, in batch order
    slots: Sequence[int | None],  # adapter slot of each request, None for the base model
    device: torch.device | str,
) -> SGMVMeta:
    """Segments for a batch laid out request after request. Adjacent requests
    with the same slot merge into one segment (a request with no new tokens
    neither starts nor breaks a run). One host-to-device copy."""
    if len(token_counts) != len(slots):
        raise ValueError(f"{len(token_counts)} token counts for {len(slots)} slots")
    starts: list[int] = []
    lens: list[int] = []
    seg_slots: list[int] = []
    row = 0
    prev_slot: int | None = None  # slot of the run that ends at `row`
    for count, slot in zip(token_counts, slots):
        if count < 0:
            raise ValueError(f"negative token count {count}")
        if slot is not None and slot < 0:
            raise ValueError(f"negative slot {slot}; use None for a request without an adapter")
        if count == 0:
            continue
        if slot is not None:
            if slot == prev_slot:
                lens[-1] += count
            else:
                starts.append(row)
                lens.append(count)
                seg_slots.append(slot)
        prev_slot = slot
        row += count

    table = torch.tensor([starts, lens, seg_slots], dtype=torch.int32).view(3, len(lens))
    table = table.to(device)
    return SGMVMeta(
        seg_starts=table[0],
        seg_lens=table[1],
        seg_slots=table[2],
        seg_starts_host=starts,
        seg_lens_host=lens,
        seg_slots_host=seg_slots,
        max_seg_len=max(lens, default=0),
        num_tokens=row,
    )
