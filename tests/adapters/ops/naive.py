"""A slow, obvious reference for the SGMV ops, written for clarity only.

It shares nothing with the backends: it knows no segments and no padded
stacks. It expands the requests into one slot per token, then walks the
tokens one at a time and applies that token's own (unpadded) adapter
matrices with matrix-vector products in float64.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch


def per_token_slots(token_counts: Sequence[int], slots: Sequence[int | None]) -> list[int | None]:
    """The slot of every token of the batch, request after request."""
    out: list[int | None] = []
    for count, slot in zip(token_counts, slots):
        out.extend([slot] * count)
    return out


def naive_shrink(
    x: torch.Tensor,  # [T, H_in]
    lora_a: dict[int, torch.Tensor],  # slot -> [r_slot, H_in], that slot's true rank
    token_slots: list[int | None],  # [T]
    width: int,  # columns of the result: the stack's max rank
) -> torch.Tensor:  # [T, width] float64, zero past each token's rank and for base tokens
    result = torch.zeros(len(token_slots), width, dtype=torch.float64)
    for t, slot in enumerate(token_slots):
        if slot is None:
            continue
        a = lora_a[slot].double()
        result[t, : a.shape[0]] = torch.mv(a, x[t].double())
    return result


def naive_expand(
    y: torch.Tensor,  # [T, >= r_slot]: only each token's first r_slot columns count
    lora_b: dict[int, torch.Tensor],  # slot -> [H_out, r_slot]
    token_slots: list[int | None],  # [T]
    h_out: int,
) -> torch.Tensor:  # [T, H_out] float64: the delta to add, zero for base tokens
    result = torch.zeros(len(token_slots), h_out, dtype=torch.float64)
    for t, slot in enumerate(token_slots):
        if slot is None:
            continue
        b = lora_b[slot].double()
        result[t] = torch.mv(b, y[t, : b.shape[1]].double())
    return result
