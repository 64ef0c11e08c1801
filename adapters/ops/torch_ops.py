"""SGMV shrink and expand in plain torch: the CPU backend, and the twin the
Triton kernels are checked against.

One matmul per segment, written straight into (shrink) or added straight
into (expand) a view of the output: no per-token loop, no gathered weight
copies. The segment bounds come from the metadata's host lists, so nothing
waits on the device.

On a CPU, small LoRA matmuls cost more in per-call overhead than in FLOPs,
so the loop is kept lean: every segment's row views come from one `split`,
every slot's transposed weight from one `unbind` (half the cost of slicing
per segment), and callers should stack the A matrices of projections that
share an input (q/k/v, gate/up) into one `[num_slots, n * R, H_in]` stack,
so one shrink runs one matmul per segment instead of n. Measurements are in
benchmarks/sgmv_kernel.py.
"""

from __future__ import annotations

import torch

from adapters.ops.base import LoraOps, check_expand, check_shrink
from adapters.ops.meta import SGMVMeta


def sgmv_shrink(
    x: torch.Tensor,  # [T, H_in]
    lora_a: torch.Tensor,  # [num_slots, R, H_in], x's dtype
    meta: SGMVMeta,
    out: torch.Tensor,  # [T, R], x's dtype or float32; overwritten
) -> None:
    """out[seg] = x[seg] @ lora_a[slot]^T; zero for tokens without an adapter."""
    check_shrink(x, lora_a, meta, out)
    if meta.num_lora_tokens < meta.num_tokens:
        out.zero_()
    if not meta.has_lora:
        return
    if out.dtype != x.dtype:  # low-precision x into a float32 out: multiply in float32
        x, lora_a = x.float(), lora_a.float()
    sizes = meta.row_split_sizes
    a_t = lora_a.transpose(1, 2).unbind(0)  # per slot [H_in, R]
    for x_seg, out_seg, slot in zip(x.split(sizes)[1::2], out.split(sizes)[1::2], meta.seg_slots_host):
        torch.mm(x_seg, a_t[slot], out=out_seg)


def sgmv_expand(
    y: torch.Tensor,  # [T, R], lora_b's dtype or float32; may be a column slice of a wider buffer
    lora_b: torch.Tensor,  # [num_slots, H_out, R]
    meta: SGMVMeta,
    out: torch.Tensor,  # [T, H_total], lora_b's dtype; added into in place
    offset: int,  # first column of this projection in out
) -> None:
    """out[seg, offset:offset + H_out] += y[seg] @ lora_b[slot]^T."""
    check_expand(y, lora_b, meta, out, offset)
    if not meta.has_lora:
        return
    sizes = meta.row_split_sizes
    y_segs = y.to(out.dtype).split(sizes)[1::2]
    out_segs = out[:, offset : offset + lora_b.shape[1]].split(sizes)[1::2]
    b_t = lora_b.transpose(1, 2).unbind(0)  # per slot [R, H_out]
    for y_seg, out_seg, slot in zip(y_segs, out_segs, meta.seg_slots_host):
        out_seg.addmm_(y_seg, b_t[slot])


class TorchLoraOps(LoraOps):
    """Per-segment torch matmuls; runs anywhere torch does. `expand_slices`
    is one `sgmv_expand` per slice (fusing the slices' loops measured no
    faster: the matmul calls are the cost, and their number is the same)."""

    name = "torch"

    def shrink(self, x, lora_a, meta, out) -> None:
        sgmv_shrink(x, lora_a, meta, out)

    def expand(self, y, lora_b, meta, out, offset) -> None:
        sgmv_expand(y, lora_b, meta, out, offset)
