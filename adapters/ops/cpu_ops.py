"""The CPU backend of the LoRA ops: one small C++ kernel for a whole LoRA
projection (shrink, then the expand of every slice), over the torch twin.

Why a kernel: in a decode step each adapter has a token or a few, so the
work per adapter is a handful of matrix-vector products over its weights.
In torch that is a dozen small ops per packed projection (gathers, a `bmm`
per op, index adds), each with its own dispatch and a pass over memory, and
a 32-adapter decode step spent as long in them as in the base model's
matmuls. The kernel reads each segment's A and B once, keeps the shrink
result in registers and L1, and adds the deltas straight into the packed
output. What remains is the unavoidable part: streaming the active adapters'
weights from memory once per step.

Layout: the kernel wants the B stacks rank-major (each slot's B stored as
`[R, H_out]`, so a 16-wide column block is one vector load per rank row).
The ops contract still speaks of `[num_slots, H_out, R]`: such a B is that
shape's transposed view, `stride(1) == 1`. `rank_major_b` tells the slot
manager to allocate it so. With B in any other layout, float16 tensors, or
no kernel (no compiler, or LORAGW_CPU_LORA_KERNEL=0), `apply` is the torch
twin's: the same results to float32 rounding.

Work is split into items of up to 16 tokens of one segment, run on torch's
intra-op threads (adapters/ops/csrc/cpu_lora.cpp). Within an item:

  shrink  y[j, k] = x[j] . A_s[k], in float32, in register tiles of
          4 tokens x 4 rank rows (1 x 16 for single tokens: decodes),
          by `dot_rows` (native/csrc/vector_helpers.h, shared with the
          linear kernel);
  expand  out[j, off_i + c] += sum_r y[j, i*R + r] * B_i,s[r, c], 16
          columns at a time, the out rows read and written once.

The torch twin (`sgmv_shrink` / `sgmv_expand`) is the reference the tests
hold this kernel to, next to the naive per-token loop.
"""

from __future__ import annotations

from pathlib import Path

import torch

import native
from adapters.ops.meta import SGMVMeta
from adapters.ops.torch_ops import TorchLoraOps

ENV_SWITCH = "LORAGW_CPU_LORA_KERNEL"
# Batches below this many tokens run on one thread when idle threads sleep:
# on 2 cores under OMP_WAIT_POLICY=PASSIVE, 27 one-token segments took 77 us
# a projection on one thread and 134 us on two; a 1,024-token prefill chunk
# is worth the wake-up.
PARALLEL_TOKENS_WHEN_THREADS_SLEEP = 64
SOURCE = Path(__file__).parent / "csrc" / "cpu_lora.cpp"


_KERNEL = native.Kernel("loragw_cpu_lora", SOURCE, "CPU LoRA kernel", ENV_SWITCH)
load_kernel = _KERNEL.load


class CpuLoraOps(TorchLoraOps):
    """The torch twin, with `apply` done by the C++ kernel where it can be."""

    name = "cpu"
    rank_major_b = True

    def __init__(self, kernel=None):
        # Built here, not on the first step: the first build takes ~30 s.
        self.kernel = load_kernel() if kernel is None else kernel
        # A decode step's LoRA work is streaming a few adapters' weights, as
        # fast on one core as on two here; where idle threads sleep, waking
        # the second costs more than it brings (native/__init__.py).
        self.parallel_tokens = native.serial_below(PARALLEL_TOKENS_WHEN_THREADS_SLEEP)

    def apply(self, x, lora_a, lora_b_slices, meta: SGMVMeta, out, offsets) -> None:
        # One call per projection and step, so the checks live in the kernel
        # (microseconds there; in Python they cost as much as the math).
        if self.kernel is None or not self.kernel.lora_apply(
                x, lora_a, list(lora_b_slices), list(offsets), meta.seg_starts, meta.seg_lens, meta.seg_slots, out,
                self.parallel_tokens):
            super().apply(x, lora_a, lora_b_slices, meta, out, offsets)
