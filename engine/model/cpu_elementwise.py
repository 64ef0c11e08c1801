"""RMSNorm, the residual add before it, and the rotary embedding on the CPU:
one C++ call each (engine/csrc/cpu_elementwise.cpp).

A decode step of one sequence spent more time dispatching small torch ops
than computing them: the norm is 8 ops (to, pow, mean as sum and div, add,
rsqrt, mul, to, mul), the rotary 7 (two muls, two slices, neg, cat, add),
for a few hundred values each, 61 norms and 30 rotaries a token on SmolLM2.
torch's profiler put those ops at ~5 ms of a ~23 ms token, and the Python
around them at more.

Numerics follow the twins op for op, rounding to the activations' dtype
where they do (each product and the sum of the rotary; the normalized value,
then its product with the weight, of the norm). The rotary and the residual
add are bit-identical to theirs in float32 and bfloat16. The norm's sum of
squares runs in another order than torch's mean, so its results match the
twin to a rounding of the variance, not bit for bit; each row is computed on
its own, whatever rows share the call, as speculation's greedy equality
needs.

The twins, `RMSNorm.forward` (engine/model/llama.py) and `apply_rotary`
(engine/model/rope.py), serve where the kernel cannot be built, is switched
off (LORAGW_CPU_ELEMENTWISE_KERNEL=0), or does not take the tensors (a GPU,
another dtype, a head_dim that is not a multiple of 32). How it is built and
cached: native/__init__.py.
"""

from __future__ import annotations

from pathlib import Path

import torch

import native

ENV_SWITCH = "LORAGW_CPU_ELEMENTWISE_KERNEL"
SOURCE = Path(__file__).parents[1] / "csrc" / "cpu_elementwise.cpp"

_KERNEL = native.Kernel("loragw_cpu_elementwise", SOURCE, "CPU norm and rotary kernel", ENV_SWITCH)
load_kernel = _KERNEL.load


def rms_norm(kernel, x: torch.Tensor, weight: torch.Tensor, eps: float,
             residual: torch.Tensor | None = None) -> torch.Tensor | None:
    """RMSNorm(x), or with `residual` RMSNorm(residual + x) after writing
    that sum into x. None where the kernel does not take the tensors (x
    untouched then)."""
    out = torch.empty_like(x)
    return out if kernel.rms_norm(x, residual, weight, eps, out) else None


def rotary(kernel, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor | None:
    """x [T, heads, head_dim] rotated by cos/sin [T, 1, head_dim] into a new
    contiguous tensor; None where the kernel does not take the tensors."""
    out = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    return out if kernel.rotary(x, cos, sin, out) else None
