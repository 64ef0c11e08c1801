"""RMSNorm with the residual add before it, the rotary embedding and the
MLP's SiLU-and-product on a GPU: one Triton launch each.

The CPU runs these as C++ calls (engine/model/cpu_elementwise.py) because
dispatching their small torch ops cost more than computing them. A GPU has
the same problem one level down: on an H200 a decode step of 64 sequences
kept the GPU busy 2.5 ms while the host issued ~830 launches for it, most
of them the norms' (8 ops each, 61 a step), the rotary's (7) and the
SiLU's (2); a step of the throughput run took ~25 ms on an H100
(docs/benchmarks.md, "On a GPU").

Numerics follow the twins op for op, in float32 registers, rounding to the
activations' dtype where they do: the residual sum; the normalized value,
then its product with the weight; each product of the rotary, then their
sum; the SiLU, then its product with `up`. The rotary and the residual add
are bit-identical to the twins. The norm's sum of squares and rsqrt, and
the SiLU's exp, are the GPU's own and may differ from torch's by a rounding.

Everything here is imported lazily: `engine.model` must import without
triton (the CPU install does not need it). LORAGW_GPU_ELEMENTWISE_KERNEL=0
switches the kernels off, leaving the twins.
"""

from __future__ import annotations

import functools
import os

import torch

ENV_SWITCH = "LORAGW_GPU_ELEMENTWISE_KERNEL"
_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


@functools.cache
def available() -> bool:
    if os.environ.get(ENV_SWITCH, "1") == "0":
        return False
    try:
        import triton  # noqa: F401
    except ImportError:
        return False
    return True


def serves(device: torch.device | str) -> bool:
    """Whether a model on `device` runs these kernels: a GPU, with triton."""
    return torch.device(device).type == "cuda" and available()


def _takes(*tensors: torch.Tensor) -> bool:
    """One device (a GPU, or any under the interpreter), one float dtype,
    unit stride along the last dimension."""
    first = tensors[0]
    on_gpu = first.is_cuda or os.environ.get("TRITON_INTERPRET") == "1"
    return (on_gpu and first.dtype in _DTYPES and all(t.dtype == first.dtype for t in tensors)
            and all(t.device == first.device and t.stride(-1) == 1 for t in tensors))


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float,
             residual: torch.Tensor | None = None) -> torch.Tensor | None:
    """RMSNorm(x), or with `residual` RMSNorm(residual + x) after writing
    that sum into x: cpu_elementwise.rms_norm's contract. x [T, H]."""
    tensors = (x, weight) if residual is None else (x, weight, residual)
    if x.dim() != 2 or weight.shape != x.shape[-1:] or not _takes(*tensors):
        return None
    if residual is not None and residual.shape != x.shape:
        return None
    from engine.model import triton_kernels as k

    out = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    rows, width = x.shape
    if rows:
        k.rms_norm_kernel[(rows,)](
            x, x.stride(0), residual if residual is not None else x,
            residual.stride(0) if residual is not None else 0, weight, out, out.stride(0), width, eps,
            HAS_RESIDUAL=residual is not None, BLOCK=k.next_power_of_2(width))
    return out


def rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor | None:
    """x [T, heads, head_dim] (rows may be strided, as q and k are inside the
    fused qkv output) rotated by cos/sin [T, 1, head_dim] into a new
    contiguous tensor: cpu_elementwise.rotary's contract."""
    if x.dim() != 3 or x.shape[-1] % 2 or not _takes(x, cos, sin) or x.stride(1) != x.shape[-1]:
        return None
    if cos.shape != (x.shape[0], 1, x.shape[-1]) or sin.shape != cos.shape:
        return None
    from engine.model import triton_kernels as k

    tokens, heads, head_dim = x.shape
    out = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    if tokens:
        k.rotary_kernel[(tokens, heads)](
            x, x.stride(0), cos, sin, cos.stride(0), sin.stride(0), out, head_dim,
            BLOCK=k.next_power_of_2(head_dim), enable_fp_fusion=False)
    return out


def silu_mul(x: torch.Tensor) -> torch.Tensor | None:
    """silu(gate) * up for x [T, 2n] = gate and up side by side, into a new
    [T, n]: cpu_elementwise.silu_mul's contract."""
    if x.dim() != 2 or x.shape[-1] % 2 or not _takes(x):
        return None
    from engine.model import triton_kernels as k

    rows, width = x.shape[0], x.shape[-1] // 2
    out = torch.empty((rows, width), dtype=x.dtype, device=x.device)
    if rows:
        block = min(k.next_power_of_2(width), 1024)
        k.silu_mul_kernel[(rows, -(-width // block))](x, x.stride(0), out, width, BLOCK=block)
    return out
