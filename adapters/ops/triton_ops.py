"""SGMV shrink and expand as Triton kernels, for the GPU.

Design. Both kernels are a segmented GEMM: program (m, s, n) owns rows
m * BLOCK_M ... of segment s and columns n * BLOCK_N ... of the result. It
reads the segment's start, length and slot from the metadata, exits at
once when its row tile starts past the segment's end (the grid is sized by
the longest segment), and multiplies the segment's rows by its slot's
weight tile with a float32 accumulator. The grid is

    (cdiv(max_seg_len, BLOCK_M), num_segments, cdiv(N, BLOCK_N))

shrink   N = R (small), the K loop walks H_in in BLOCK_K steps; the result
         is stored (rows no segment covers were zeroed by the wrapper).
expand   N = H_out, K = R (one or a few steps); the result is added to the
         out tile in float32 and stored back. Each (row, column) belongs to
         one program, so no atomics.

tl.dot needs every dimension >= 16: a rank-8 stack runs in a 16-wide tile
whose upper half is masked to zero on load. Weights are read transposed
from their row-major [N, K] slot ([BLOCK_K, BLOCK_N] tiles), so the stacks
need no second layout. The tiles are not autotuned: they follow the
segment length only.

On a machine without a GPU the kernels run only under the Triton
interpreter, which reads TRITON_INTERPRET=1 when this module is imported;
there, bf16 and fp16 dot operands are upcast (DOT_IN_FP32), because the
interpreter's tl.dot gets bf16 wrong.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from adapters.ops.base import LoraOps, check_expand, check_shrink
from adapters.ops.meta import SGMVMeta


@triton.jit
def _sgmv_shrink_kernel(
    out_ptr,  # [T, N], last dim contiguous
    x_ptr,  # [T, K], last dim contiguous
    lora_a_ptr,  # [num_slots, N, K], contiguous
    seg_starts_ptr,  # [S] int32
    seg_lens_ptr,  # [S] int32
    seg_slots_ptr,  # [S] int32
    N,  # R: the stack's rank (n * R for stacked slices)
    K,  # H_in
    stride_x_tok,
    stride_o_tok,
    stride_a_slot,
    stride_a_row,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    DOT_PRECISION: tl.constexpr,  # "ieee" for fp32 (no tf32), None otherwise
    DOT_IN_FP32: tl.constexpr,  # upcast dot operands: the interpreter's tl.dot cannot do bf16
):
    m_tile = tl.program_id(0)
    seg = tl.program_id(1)
    n_tile = tl.program_id(2)
    seg_len = tl.load(seg_lens_ptr + seg)
    if m_tile * BLOCK_M >= seg_len:
        return
    seg_start = tl.load(seg_starts_ptr + seg)
    slot = tl.load(seg_slots_ptr + seg)

    rows = m_tile * BLOCK_M + tl.arange(0, BLOCK_M)
    row_ok = rows < seg_len
    tok = (seg_start + rows).to(tl.int64)
    cols = n_tile * BLOCK_N + tl.arange(0, BLOCK_N)
    col_ok = cols < N
    ks = tl.arange(0, BLOCK_K)

    x_rows = x_ptr + tok[:, None] * stride_x_tok  # [BLOCK_M, 1]
    a_cols = lora_a_ptr + slot.to(tl.int64) * stride_a_slot + cols[None, :] * stride_a_row  # [1, BLOCK_N]
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for k_start in range(0, K, BLOCK_K):
        k = k_start + ks
        k_ok = k < K
        x = tl.load(x_rows + k[None, :], mask=row_ok[:, None] & k_ok[None, :], other=0.0)
        a_t = tl.load(a_cols + k[:, None], mask=k_ok[:, None] & col_ok[None, :], other=0.0)
        if DOT_IN_FP32:
            x = x.to(tl.float32)
            a_t = a_t.to(tl.float32)
        acc = tl.dot(x, a_t, acc, input_precision=DOT_PRECISION)

    out = out_ptr + tok[:, None] * stride_o_tok + cols[None, :]
    tl.store(out, acc.to(out_ptr.dtype.element_ty), mask=row_ok[:, None] & col_ok[None, :])


@triton.jit
def _sgmv_expand_kernel(
    out_ptr,  # [T, H_total], last dim contiguous
    y_ptr,  # [T, K], last dim contiguous (may be a column slice of a wider buffer)
    lora_b_ptr,  # [num_slots, N, K], contiguous
    seg_starts_ptr,  # [S] int32
    seg_lens_ptr,  # [S] int32
    seg_slots_ptr,  # [S] int32
    N,  # H_out
    K,  # R
    offset,  # first column of this projection in out
    stride_y_tok,
    stride_o_tok,
    stride_b_slot,
    stride_b_row,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    DOT_IN_FP32: tl.constexpr,
):
    m_tile = tl.program_id(0)
    seg = tl.program_id(1)
    n_tile = tl.program_id(2)
    seg_len = tl.load(seg_lens_ptr + seg)
    if m_tile * BLOCK_M >= seg_len:
        return
    seg_start = tl.load(seg_starts_ptr + seg)
    slot = tl.load(seg_slots_ptr + seg)

    rows = m_tile * BLOCK_M + tl.arange(0, BLOCK_M)
    row_ok = rows < seg_len
    tok = (seg_start + rows).to(tl.int64)
    cols = n_tile * BLOCK_N + tl.arange(0, BLOCK_N)
    col_ok = cols < N
    ks = tl.arange(0, BLOCK_K)

    y_rows = y_ptr + tok[:, None] * stride_y_tok
    b_cols = lora_b_ptr + slot.to(tl.int64) * stride_b_slot + cols[None, :] * stride_b_row
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for k_start in range(0, K, BLOCK_K):
        k = k_start + ks
        k_ok = k < K
        y = tl.load(y_rows + k[None, :], mask=row_ok[:, None] & k_ok[None, :], other=0.0)
        b_t = tl.load(b_cols + k[:, None], mask=k_ok[:, None] & col_ok[None, :], other=0.0)
        y = y.to(lora_b_ptr.dtype.element_ty)  # a float32 y meets B in B's dtype, as on tensor cores
        if DOT_IN_FP32:
            y = y.to(tl.float32)
            b_t = b_t.to(tl.float32)
        acc = tl.dot(y, b_t, acc, input_precision=DOT_PRECISION)

    out = out_ptr + tok[:, None] * stride_o_tok + offset + cols[None, :]
    mask = row_ok[:, None] & col_ok[None, :]
    acc += tl.load(out, mask=mask, other=0.0).to(tl.float32)
    tl.store(out, acc.to(out_ptr.dtype.element_ty), mask=mask)


def _block_m(max_seg_len: int) -> int:
    """Rows per program: 16 (the smallest tl.dot) for decode-sized segments,
    up to 64 for prefill chunks."""
    return min(max(16, triton.next_power_of_2(max_seg_len)), 64)


def _dot_tile(n: int, cap: int) -> int:
    """A power-of-two tile >= 16 covering n, at most cap."""
    return min(max(16, triton.next_power_of_2(n)), cap)


def _launch_flags(*tensors: torch.Tensor) -> dict:
    dtype = tensors[0].dtype
    interpreted = not isinstance(_sgmv_shrink_kernel, triton.runtime.JITFunction)
    if tensors[0].device.type == "cpu":
        assert interpreted, "CPU tensors need the Triton interpreter (TRITON_INTERPRET=1 before importing triton)"
    low_precision = any(t.dtype != torch.float32 for t in tensors)
    return {
        "DOT_PRECISION": "ieee" if dtype == torch.float32 else None,
        "DOT_IN_FP32": interpreted and low_precision,
    }


def _check_meta(meta: SGMVMeta) -> None:
    for t in (meta.seg_starts, meta.seg_lens, meta.seg_slots):
        assert t.dtype == torch.int32 and t.is_contiguous(), (t.dtype, t.stride())


def sgmv_shrink(
    x: torch.Tensor,  # [T, H_in], last dim contiguous
    lora_a: torch.Tensor,  # [num_slots, R, H_in], x's dtype, contiguous
    meta: SGMVMeta,  # segments of the step; tensors on x's device
    out: torch.Tensor,  # [T, R], x's dtype or float32, last dim contiguous; overwritten
) -> None:
    """out[seg] = x[seg] @ lora_a[slot]^T; zero for tokens without an adapter."""
    check_shrink(x, lora_a, meta, out)
    _check_meta(meta)
    assert x.stride(1) == 1 and out.stride(1) == 1, (x.stride(), out.stride())
    assert lora_a.is_contiguous(), lora_a.stride()
    assert x.device == lora_a.device == out.device == meta.seg_lens.device
    flags = _launch_flags(x, lora_a)
    if meta.num_lora_tokens < meta.num_tokens:
        out.zero_()
    if not meta.has_lora:
        return
    rank, h_in = lora_a.shape[1], lora_a.shape[2]
    block_m, block_n = _block_m(meta.max_seg_len), _dot_tile(rank, 64)
    grid = (triton.cdiv(meta.max_seg_len, block_m), meta.num_segments, triton.cdiv(rank, block_n))
    _sgmv_shrink_kernel[grid](
        out,
        x,
        lora_a,
        meta.seg_starts,
        meta.seg_lens,
        meta.seg_slots,
        rank,
        h_in,
        x.stride(0),
        out.stride(0),
        lora_a.stride(0),
        lora_a.stride(1),
        BLOCK_M=block_m,
        BLOCK_N=block_n,
        BLOCK_K=64,
        **flags,
    )


def sgmv_expand(
    y: torch.Tensor,  # [T, R], lora_b's dtype or float32, last dim contiguous (a column slice is fine)
    lora_b: torch.Tensor,  # [num_slots, H_out, R], contiguous
    meta: SGMVMeta,  # segments of the step; tensors on y's device
    out: torch.Tensor,  # [T, H_total], lora_b's dtype, last dim contiguous; added into in place
    offset: int,  # first column of this projection in out
) -> None:
    """out[seg, offset:offset + H_out] += y[seg] @ lora_b[slot]^T."""
    check_expand(y, lora_b, meta, out, offset)
    _check_meta(meta)
    assert y.stride(1) == 1 and out.stride(1) == 1, (y.stride(), out.stride())
    assert lora_b.is_contiguous(), lora_b.stride()
    assert y.device == lora_b.device == out.device == meta.seg_lens.device
    flags = _launch_flags(lora_b, y)
    if not meta.has_lora:
        return
    h_out, rank = lora_b.shape[1], lora_b.shape[2]
    block_m, block_n = _block_m(meta.max_seg_len), 64
    grid = (triton.cdiv(meta.max_seg_len, block_m), meta.num_segments, triton.cdiv(h_out, block_n))
    _sgmv_expand_kernel[grid](
        out,
        y,
        lora_b,
        meta.seg_starts,
        meta.seg_lens,
        meta.seg_slots,
        h_out,
        rank,
        offset,
        y.stride(0),
        out.stride(0),
        lora_b.stride(0),
        lora_b.stride(1),
        BLOCK_M=block_m,
        BLOCK_N=block_n,
        BLOCK_K=_dot_tile(rank, 64),
        **flags,
    )


class TritonLoraOps(LoraOps):
    """`_sgmv_shrink_kernel` and `_sgmv_expand_kernel`; `expand_slices` is
    one expand launch per slice."""

    name = "triton"

    def shrink(self, x, lora_a, meta, out) -> None:
        sgmv_shrink(x, lora_a, meta, out)

    def expand(self, y, lora_b, meta, out, offset) -> None:
        sgmv_expand(y, lora_b, meta, out, offset)
