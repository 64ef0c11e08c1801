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

Many short segments (decodes of many adapters: a token or a few each) would
still mean one tiny matmul per segment, and on 2 cores the calls dominated
a 32-adapter step. Segments of at most SHORT_SEGMENT tokens are therefore
gathered into one padded batch and done with one `bmm` per op; long segments
(prefill chunks) keep their own matmul. The gather plan is built once per
step and cached on the metadata.
"""

from __future__ import annotations

import torch

from dataclasses import dataclass

from adapters.ops.base import LoraOps, check_expand, check_shrink
from adapters.ops.meta import SGMVMeta

SHORT_SEGMENT = 8
_MIN_SHORT_SEGMENTS = 4  # fewer than this: the per-segment loop is as cheap


@dataclass
class _Plan:
    """How this step's segments are computed, built once per step."""

    long_segments: list[int]  # indices of segments done one matmul each
    rows: torch.Tensor | None  # [S_short, L] token rows of the short segments, padded with row 0
    slots: torch.Tensor | None  # [S_short] their slots
    valid: torch.Tensor | None  # [S_short * L] bool: a real row, not padding
    valid_rows: torch.Tensor | None  # [n_valid] the real rows, in the same order


def _plan(meta: SGMVMeta) -> _Plan:
    cached = getattr(meta, "_torch_plan", None)
    if cached is not None:
        return cached
    short = [i for i, n in enumerate(meta.seg_lens_host) if n <= SHORT_SEGMENT]
    if len(short) < _MIN_SHORT_SEGMENTS:
        plan = _Plan(list(range(meta.num_segments)), None, None, None, None)
    else:
        width = max(meta.seg_lens_host[i] for i in short)
        table, mask = [], []
        for i in short:
            start, n = meta.seg_starts_host[i], meta.seg_lens_host[i]
            table.append(list(range(start, start + n)) + [0] * (width - n))
            mask.extend([True] * n + [False] * (width - n))
        device = meta.seg_lens.device
        rows = torch.tensor(table, dtype=torch.int64, device=device)
        valid = torch.tensor(mask, dtype=torch.bool, device=device)
        plan = _Plan(
            long_segments=[i for i, n in enumerate(meta.seg_lens_host) if n > SHORT_SEGMENT],
            rows=rows,
            slots=torch.tensor([meta.seg_slots_host[i] for i in short], dtype=torch.int64, device=device),
            valid=valid,
            valid_rows=rows.reshape(-1)[valid],
        )
    meta._torch_plan = plan
    return plan


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
    plan = _plan(meta)
    if plan.rows is not None:
        # [S, L, H_in] @ [S, H_in, R] -> [S, L, R], real rows written back.
        ys = torch.bmm(x[plan.rows], lora_a[plan.slots].transpose(1, 2))
        out.index_copy_(0, plan.valid_rows, ys.reshape(-1, ys.shape[-1])[plan.valid])
    a_t = lora_a.transpose(1, 2).unbind(0)  # per slot [H_in, R]
    for i in plan.long_segments:
        start, n = meta.seg_starts_host[i], meta.seg_lens_host[i]
        torch.mm(x[start:start + n], a_t[meta.seg_slots_host[i]], out=out[start:start + n])


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
    y = y.to(out.dtype)
    cols = out[:, offset : offset + lora_b.shape[1]]
    plan = _plan(meta)
    if plan.rows is not None:
        # [S, L, R] @ [S, R, H_out] -> [S, L, H_out], real rows added in.
        deltas = torch.bmm(y[plan.rows], lora_b[plan.slots].transpose(1, 2))
        cols.index_add_(0, plan.valid_rows, deltas.reshape(-1, deltas.shape[-1])[plan.valid])
    b_t = lora_b.transpose(1, 2).unbind(0)  # per slot [R, H_out]
    for i in plan.long_segments:
        start, n = meta.seg_starts_host[i], meta.seg_lens_host[i]
        cols[start:start + n].addmm_(y[start:start + n], b_t[meta.seg_slots_host[i]])


class TorchLoraOps(LoraOps):
    """Per-segment torch matmuls; runs anywhere torch does. `expand_slices`
    is one `sgmv_expand` per slice (fusing the slices' loops measured no
    faster: the matmul calls are the cost, and their number is the same)."""

    name = "torch"

    def shrink(self, x, lora_a, meta, out) -> None:
        sgmv_shrink(x, lora_a, meta, out)

    def expand(self, y, lora_b, meta, out, offset) -> None:
        sgmv_expand(y, lora_b, meta, out, offset)
