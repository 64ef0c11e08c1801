"""RMSNorm, the residual add before it, the rotary embedding and the MLP's
SiLU-and-product on the CPU: one C++ call each
(engine/csrc/cpu_elementwise.cpp).

A decode step of one sequence spent more time dispatching small torch ops
than computing them: the norm is 8 ops (to, pow, mean as sum and div, add,
rsqrt, mul, to, mul), the rotary 7 (two muls, two slices, neg, cat, add),
for a few hundred values each, 61 norms and 30 rotaries a token on SmolLM2.
torch's profiler put those ops at ~5 ms of a ~23 ms token, and the Python
around them at more.

Numerics follow the twins op for op, rounding to the activations' dtype
where they do (each product and the sum of the rotary; the normalized value,
then its product with the weight, of the norm; the SiLU, then its product
with `up`). The rotary, the residual add and the SiLU-and-product are
bit-identical to theirs in float32 and bfloat16. In float32 the SiLU's exp
is the SLEEF function that torch's own vectorized kernel calls (libtorch
exports it), and a row's values past torch's last whole pair of vectors
take std::exp, as torch's scalar loop does. In bfloat16 the SiLU is looked
up in a table of F.silu's own results for all 65,536 bit patterns: ~1.7x
the formula's speed, whose exp and division were most of the kernel's time.
The norm's sum of squares runs in another order than torch's mean, so its
results match the twin to a rounding of the variance, not bit for bit. Each
row is computed on its own, whatever rows share the call, as speculation's
greedy equality needs.

The twins, `RMSNorm.twin` (engine/model/layers.py), `apply_rotary`
(engine/model/rope.py) and `F.silu(gate) * up` (`LlamaMLP`), serve where the
kernel cannot be built, is switched off (LORAGW_CPU_ELEMENTWISE_KERNEL=0),
or does not take the tensors (a GPU, another dtype, a head_dim that is not
a multiple of 32). How it is built and cached: native/__init__.py.
"""

from __future__ import annotations

import functools
from pathlib import Path

import torch
import torch.nn.functional as F

import native

ENV_SWITCH = "LORAGW_CPU_ELEMENTWISE_KERNEL"
SOURCE = Path(__file__).parents[1] / "csrc" / "cpu_elementwise.cpp"
# Where idle threads sleep (native/__init__.py), a call of fewer values than
# this stays on the calling thread: waking the other costs ~35 us there. On
# 2 Zen 4 cores under OMP_WAIT_POLICY=PASSIVE, one thread against two, in
# microseconds: the bfloat16 norm with its residual add at 128 x 576 values
# 43 against 79, at 256 x 576 100 against 91; the bfloat16 SiLU-and-product
# at 128 x 1536 96 against 103, at 256 x 1536 238 against 198; float32's
# norm and rotary stayed faster on one thread up to 1,024 rows.
SERIAL_VALUES_WHEN_THREADS_SLEEP = 1 << 17

_KERNEL = native.Kernel("loragw_cpu_elementwise", SOURCE, "CPU norm, rotary and SiLU kernel", ENV_SWITCH)
load_kernel = _KERNEL.load


def rms_norm(kernel, x: torch.Tensor, weight: torch.Tensor, eps: float,
             residual: torch.Tensor | None = None) -> torch.Tensor | None:
    """RMSNorm(x), or with `residual` RMSNorm(residual + x) after writing
    that sum into x. None where the kernel does not take the tensors (x
    untouched then)."""
    out = torch.empty_like(x)
    return out if kernel.rms_norm(x, residual, weight, eps, out, _serial_values()) else None


def rotary(kernel, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor | None:
    """x [T, heads, head_dim] rotated by cos/sin [T, 1, head_dim] into a new
    contiguous tensor; None where the kernel does not take the tensors."""
    out = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    return out if kernel.rotary(x, cos, sin, out, _serial_values()) else None


def silu_mul(kernel, x: torch.Tensor) -> torch.Tensor | None:
    """silu(gate) * up for x [T, 2n] = gate and up side by side (the fused
    gate/up projection's output), into a new [T, n]; None where the kernel
    does not take the tensors."""
    out = torch.empty((x.shape[0], x.shape[-1] // 2), dtype=x.dtype, device=x.device)
    table = bfloat16_silu_table() if x.dtype == torch.bfloat16 else None
    return out if kernel.silu_mul(x, out, table, _serial_values()) else None


@functools.cache
def bfloat16_silu_table() -> torch.Tensor:
    """F.silu of every bfloat16 bit pattern, as int16 bits, plus one entry
    of padding (the kernel reads 4 bytes per lookup): the kernel's bfloat16
    SiLU is a lookup in it, torch's own results, so exact by construction."""
    patterns = torch.arange(1 << 16, dtype=torch.int32).to(torch.int16).view(torch.bfloat16)
    return torch.cat([F.silu(patterns).view(torch.int16), torch.zeros(1, dtype=torch.int16)])


@functools.cache
def _serial_values() -> int:
    return native.serial_below(SERIAL_VALUES_WHEN_THREADS_SLEEP)
