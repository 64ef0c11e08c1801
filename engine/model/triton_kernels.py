"""The Triton kernels behind engine/model/triton_elementwise.py, which says
what each computes and how it rounds. Importing this module imports triton."""

from __future__ import annotations

import triton
import triton.language as tl

next_power_of_2 = triton.next_power_of_2


@triton.jit
def rms_norm_kernel(x_ptr, x_stride, res_ptr, res_stride, w_ptr, out_ptr, out_stride, width, eps,
                    HAS_RESIDUAL: tl.constexpr, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    mask = cols < width
    x = tl.load(x_ptr + row * x_stride + cols, mask=mask, other=0.0)
    if HAS_RESIDUAL:
        r = tl.load(res_ptr + row * res_stride + cols, mask=mask, other=0.0)
        # Rounded to the activations' dtype, as `residual + x` is.
        x = (r.to(tl.float32) + x.to(tl.float32)).to(x.dtype)
        tl.store(x_ptr + row * x_stride + cols, x, mask=mask)
    x32 = x.to(tl.float32)
    variance = tl.sum(x32 * x32, axis=0) / width
    normed = (x32 * tl.math.rsqrt(variance + eps)).to(x.dtype)
    w = tl.load(w_ptr + cols, mask=mask, other=0.0)
    out = (w.to(tl.float32) * normed.to(tl.float32)).to(x.dtype)
    tl.store(out_ptr + row * out_stride + cols, out, mask=mask)


@triton.jit
def rotary_kernel(x_ptr, x_stride, cos_ptr, sin_ptr, cos_stride, sin_stride, out_ptr, head_dim,
                  BLOCK: tl.constexpr):
    token = tl.program_id(0).to(tl.int64)
    head = tl.program_id(1)
    heads = tl.num_programs(1)
    cols = tl.arange(0, BLOCK)
    mask = cols < head_dim
    half = head_dim // 2
    # rotate_half: the first half takes minus the second, the second the first.
    partner = tl.where(cols < half, cols + half, cols - half)
    row = x_ptr + token * x_stride + head * head_dim
    x = tl.load(row + cols, mask=mask, other=0.0)
    rotated = tl.load(row + partner, mask=mask, other=0.0).to(tl.float32)
    rotated = tl.where(cols < half, -rotated, rotated)
    cos = tl.load(cos_ptr + token * cos_stride + cols, mask=mask, other=0.0).to(tl.float32)
    sin = tl.load(sin_ptr + token * sin_stride + cols, mask=mask, other=0.0).to(tl.float32)
    # Each product rounded to the dtype, then the sum: the twin's op order.
    a = (x.to(tl.float32) * cos).to(x.dtype).to(tl.float32)
    b = (rotated * sin).to(x.dtype).to(tl.float32)
    tl.store(out_ptr + (token * heads + head) * head_dim + cols, (a + b).to(x.dtype), mask=mask)


@triton.jit
def silu_mul_kernel(x_ptr, x_stride, out_ptr, width, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < width
    gate = tl.load(x_ptr + row * x_stride + cols, mask=mask, other=0.0)
    up = tl.load(x_ptr + row * x_stride + width + cols, mask=mask, other=0.0)
    g = gate.to(tl.float32)
    silu = (g / (1.0 + tl.exp(-g))).to(gate.dtype)
    out = (silu.to(tl.float32) * up.to(tl.float32)).to(gate.dtype)
    tl.store(out_ptr + row * width + cols, out, mask=mask)
