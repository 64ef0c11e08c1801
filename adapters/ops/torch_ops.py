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

The batch is laid out by slot where it can: when the short segments' slots
fill at least half of the range from the lowest to the highest, group g is
slot lo + g (a slot with no short segment gets a group of padding rows), so
the `bmm` reads the stacks through a slice, in place. Gathering the stacks
instead (`stack[slots]`) copied every active adapter's A and B on every
projection: with 32 rank-8 adapters on all seven projections that is ~300 MB
of fp32 per step, as much memory traffic as the base model's own weights.
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
    rows: torch.Tensor | None  # [G, L] token rows of each group (a short segment), padded with row 0
    # The stack rows of the G groups: a slice (read in place) or an index tensor (gathered).
    slots: slice | torch.Tensor | None
    # [T]: each token's row in the flattened [G * L] batch, or G * L (a zero
    # row appended to it) for a token outside every short segment.
    token_pos: torch.Tensor | None


def _plan(meta: SGMVMeta) -> _Plan:
    cached = getattr(meta, "_torch_plan", None)
    if cached is not None:
        return cached
    short = [i for i, n in enumerate(meta.seg_lens_host) if n <= SHORT_SEGMENT]
    if len(short) < _MIN_SHORT_SEGMENTS:
        plan = _Plan(list(range(meta.num_segments)), None, None, None)
    else:
        device = meta.seg_lens.device
        groups: list[int | None]  # the short segment of each group; None: padding only
        slot_of = {meta.seg_slots_host[i]: i for i in short}
        lo, hi = min(slot_of), max(slot_of) + 1
        if len(slot_of) == len(short) and 2 * len(short) >= hi - lo:
            groups = [slot_of.get(slot) for slot in range(lo, hi)]
            slots: slice | torch.Tensor = slice(lo, hi)
        else:
            groups = list(short)
            slots = torch.tensor([meta.seg_slots_host[i] for i in short], dtype=torch.int64, device=device)
        width = max(meta.seg_lens_host[i] for i in short)
        table = []
        token_pos = [len(groups) * width] * meta.num_tokens
        for g, i in enumerate(groups):
            start, n = (0, 0) if i is None else (meta.seg_starts_host[i], meta.seg_lens_host[i])
            table.append(list(range(start, start + n)) + [0] * (width - n))
            token_pos[start:start + n] = range(g * width, g * width + n)
        plan = _Plan(
            long_segments=[i for i, n in enumerate(meta.seg_lens_host) if n > SHORT_SEGMENT],
            rows=torch.tensor(table, dtype=torch.int64, device=device),
            slots=slots,
            token_pos=torch.tensor(token_pos, dtype=torch.int64, device=device),
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
    plan = _plan(meta) if meta.has_lora else None
    if plan is None or plan.rows is None:
        if meta.num_lora_tokens < meta.num_tokens:
            out.zero_()
        if plan is None:
            return
    if out.dtype != x.dtype:  # low-precision x into a float32 out: multiply in float32
        x, lora_a = x.float(), lora_a.float()
    if plan.rows is not None:
        # [G, L, H_in] @ [G, H_in, R] -> [G, L, R]; every row of out is written:
        # its token's row of the batch, or the zero row.
        ys = _padded_bmm(x, lora_a[plan.slots].transpose(1, 2), plan.rows)
        torch.index_select(ys, 0, plan.token_pos, out=out)
    a_t = lora_a.transpose(1, 2).unbind(0) if plan.long_segments else ()  # per slot [H_in, R]
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
        # [G, L, R] @ [G, R, H_out] -> [G, L, H_out]; each token adds its
        # row of the batch, or the zero row (one dense add, no scatter).
        deltas = _padded_bmm(y, lora_b[plan.slots].transpose(1, 2), plan.rows)
        cols.add_(deltas.index_select(0, plan.token_pos))
    b_t = lora_b.transpose(1, 2).unbind(0) if plan.long_segments else ()  # per slot [R, H_out]
    for i in plan.long_segments:
        start, n = meta.seg_starts_host[i], meta.seg_lens_host[i]
        cols[start:start + n].addmm_(y[start:start + n], b_t[meta.seg_slots_host[i]])


def _padded_bmm(x: torch.Tensor, weights: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
    """x [T, K], weights [G, K, N], rows [G, L] -> [G * L + 1, N]: group g's
    rows of x times weights[g], flattened, then one zero row."""
    num_groups, width = rows.shape
    out = torch.empty(num_groups * width + 1, weights.shape[2], dtype=x.dtype, device=x.device)
    out[-1].zero_()
    batch = x.index_select(0, rows.view(-1)).view(num_groups, width, x.shape[1])
    torch.bmm(batch, weights, out=out[:-1].view(num_groups, width, weights.shape[2]))
    return out


class TorchLoraOps(LoraOps):
    """Per-segment torch matmuls; runs anywhere torch does. `expand_slices`
    is one `sgmv_expand` per slice (fusing the slices' loops measured no
    faster: the matmul calls are the cost, and their number is the same)."""

    name = "torch"

    def shrink(self, x, lora_a, meta, out) -> None:
        sgmv_shrink(x, lora_a, meta, out)

    def expand(self, y, lora_b, meta, out, offset) -> None:
        sgmv_expand(y, lora_b, meta, out, offset)
