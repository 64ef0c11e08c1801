"""LoRA in the forward pass: the per-step glue between the runner, the slot
manager and the SGMV ops.

At the start of a step the runner hands `begin_step` its scheduled requests.
The adapters they name are put into device slots, the requests are ordered
by slot (so each adapter's tokens form one segment) and the segment metadata
is built once. Every packed projection of the model then calls its hook,
which adds that step's deltas with one `apply`: a shrink over the stacked A
matrices and an expand per slice, fused where the backend can. A step
without adapter tokens costs one check per projection.
"""

from __future__ import annotations

from typing import Hashable, Sequence

import torch

from adapters.ops import LoraOps, SGMVMeta, build_sgmv_meta
from adapters.slots import LoraSlotManager, LoraStack


class LoraRuntime:
    def __init__(self, slots: LoraSlotManager, ops: LoraOps, device: torch.device):
        self.slots = slots
        self.ops = ops
        self.device = device
        self.meta: SGMVMeta | None = None  # this step's segments; None when no token has an adapter

    def attach(self, packed_linears: dict) -> None:
        """Give every packed projection of the model its hook."""
        for key, linear in packed_linears.items():
            linear.lora_hook = _LoraHook(self, self.slots.stacks[key])

    def begin_step(self, requests: Sequence) -> list:
        """Activate this step's adapters; returns the requests ordered by slot
        (base-model requests first, order otherwise kept)."""
        keys: list[Hashable] = [r.adapter_key for r in requests if r.adapter_key is not None]
        if not keys:
            self.meta = None
            return list(requests)
        slot_of = self.slots.activate(keys)
        ordered = sorted(requests, key=lambda r: -1 if r.adapter_key is None else slot_of[r.adapter_key])
        self.meta = build_sgmv_meta(
            [r.num_tokens for r in ordered],
            [None if r.adapter_key is None else slot_of[r.adapter_key] for r in ordered],
            self.device,
        )
        return ordered

    def end_step(self) -> None:
        self.meta = None


class _LoraHook:
    """Adds x @ A_s^T @ B_s^T into one packed projection's output."""

    def __init__(self, runtime: LoraRuntime, stack: LoraStack):
        self.runtime = runtime
        self.stack = stack

    def __call__(self, x: torch.Tensor, out: torch.Tensor) -> None:
        meta = self.runtime.meta
        if meta is None:
            return
        stack = self.stack
        self.runtime.ops.apply(x, stack.lora_a, stack.lora_b, meta, out, stack.offsets)
