"""The LoRA ops contract, and the shape checks every backend shares.

A LoRA projection adds `x @ A_s^T @ B_s^T` to `x @ W^T`, where `s` is the
token's adapter slot. It runs in two ops over the step's segments
(`SGMVMeta`):

  shrink  y[seg] = x[seg] @ lora_a[slot]^T        [T, H_in] -> [T, R]
  expand  out[seg, offset:offset + H_out] += y[seg] @ lora_b[slot]^T

Weights live in per-module stacks with one entry per slot, zero-padded to the
stack's max rank R, so a smaller rank contributes exactly zero through the
padding. The LoRA scaling is already folded into B.

Projections that read the same input (q/k/v, gate/up) may stack their A
matrices along the rank dimension, `[num_slots, n * R, H_in]`, and run one
shrink; `expand_slices` then adds each slice's delta into its own columns of
the fused output.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Sequence

import torch

from adapters.ops.meta import SGMVMeta

DTYPES = (torch.float32, torch.bfloat16, torch.float16)


class LoraOps(ABC):
    """Segmented LoRA matmuls. Contract for every method:

    - only rows inside a segment are read from x / y; rows outside every
      segment (tokens without an adapter) get zero from `shrink` and are left
      untouched by `expand`;
    - `shrink` overwrites all of `out`; `expand` adds into its column slice
      of `out` in place and touches no other column;
    - products accumulate in float32 whatever the storage dtype;
    - nothing is allocated that outlives the call, and no device sync is
      needed (shapes come from the metadata's host lists).
    """

    name: str = "abstract"
    # Whether this backend wants each B stack stored rank-major ([num_slots,
    # R, H_out] memory, passed as its [num_slots, H_out, R] transposed view).
    rank_major_b: bool = False

    @abstractmethod
    def shrink(
        self,
        x: torch.Tensor,  # [T, H_in]
        lora_a: torch.Tensor,  # [num_slots, R, H_in]
        meta: SGMVMeta,
        out: torch.Tensor,  # [T, R], x's dtype or float32
    ) -> None: ...

    @abstractmethod
    def expand(
        self,
        y: torch.Tensor,  # [T, R], lora_b's dtype or float32
        lora_b: torch.Tensor,  # [num_slots, H_out, R]
        meta: SGMVMeta,
        out: torch.Tensor,  # [T, H_total], lora_b's dtype
        offset: int,  # first column of this projection in out
    ) -> None: ...

    def expand_slices(
        self,
        y: torch.Tensor,  # [T, n * R]: slice i's shrink output in columns i*R:(i+1)*R
        lora_b_slices: Sequence[torch.Tensor],  # n of [num_slots, H_out_i, R]
        meta: SGMVMeta,
        out: torch.Tensor,  # [T, H_total]
        offsets: Sequence[int],  # n first columns in out
    ) -> None:
        """One `expand` per slice; a backend may fuse them."""
        rank = check_slices(y, lora_b_slices, offsets)
        for i, (lora_b, offset) in enumerate(zip(lora_b_slices, offsets)):
            self.expand(y[:, i * rank : (i + 1) * rank], lora_b, meta, out, offset)

    def apply(
        self,
        x: torch.Tensor,  # [T, H_in]
        lora_a: torch.Tensor,  # [num_slots, n * R, H_in]
        lora_b_slices: Sequence[torch.Tensor],  # n of [num_slots, H_out_i, R]
        meta: SGMVMeta,
        out: torch.Tensor,  # [T, H_total], x's dtype; added into in place
        offsets: Sequence[int],  # n first columns in out
    ) -> None:
        """A whole LoRA projection: `shrink`, then `expand_slices`. A backend
        may fuse them (the intermediate never needs to leave the kernel)."""
        y = torch.empty(x.shape[0], lora_a.shape[1], dtype=x.dtype, device=x.device)
        self.shrink(x, lora_a, meta, y)
        self.expand_slices(y, lora_b_slices, meta, out, offsets)


def check_shrink(x: torch.Tensor, lora_a: torch.Tensor, meta: SGMVMeta, out: torch.Tensor) -> None:
    assert x.dim() == 2 and lora_a.dim() == 3 and out.dim() == 2, (x.shape, lora_a.shape, out.shape)
    assert x.dtype in DTYPES and lora_a.dtype == x.dtype, (x.dtype, lora_a.dtype)
    assert out.dtype in (x.dtype, torch.float32), (out.dtype, x.dtype)
    assert x.shape[0] == out.shape[0] == meta.num_tokens, (x.shape, out.shape, meta.num_tokens)
    assert lora_a.shape[2] == x.shape[1], f"lora_a {tuple(lora_a.shape)} does not read x {tuple(x.shape)}"
    assert lora_a.shape[1] == out.shape[1], f"lora_a {tuple(lora_a.shape)} does not fill out {tuple(out.shape)}"
    assert max(meta.seg_slots_host, default=-1) < lora_a.shape[0], "a segment's slot is past the stack"


def check_expand(
    y: torch.Tensor, lora_b: torch.Tensor, meta: SGMVMeta, out: torch.Tensor, offset: int
) -> None:
    assert y.dim() == 2 and lora_b.dim() == 3 and out.dim() == 2, (y.shape, lora_b.shape, out.shape)
    assert out.dtype in DTYPES and lora_b.dtype == out.dtype, (lora_b.dtype, out.dtype)
    assert y.dtype in (out.dtype, torch.float32), (y.dtype, out.dtype)
    assert y.shape[0] == out.shape[0] == meta.num_tokens, (y.shape, out.shape, meta.num_tokens)
    assert lora_b.shape[2] == y.shape[1], f"lora_b {tuple(lora_b.shape)} does not read y {tuple(y.shape)}"
    assert 0 <= offset and offset + lora_b.shape[1] <= out.shape[1], (offset, lora_b.shape, out.shape)
    assert max(meta.seg_slots_host, default=-1) < lora_b.shape[0], "a segment's slot is past the stack"


def check_slices(y: torch.Tensor, lora_b_slices: Sequence[torch.Tensor], offsets: Sequence[int]) -> int:
    """The per-slice rank R; y must hold exactly len(slices) * R columns."""
    assert len(lora_b_slices) == len(offsets) > 0, (len(lora_b_slices), len(offsets))
    rank = lora_b_slices[0].shape[2]
    assert all(b.shape[2] == rank for b in lora_b_slices), [tuple(b.shape) for b in lora_b_slices]
    assert y.shape[1] == rank * len(lora_b_slices), (y.shape, rank, len(lora_b_slices))
    return rank
