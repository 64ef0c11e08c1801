"""Segmented LoRA ops (SGMV shrink and expand) and the one place that
chooses a backend.

Factories import their backend lazily, so importing this registry never
requires triton.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from adapters.errors import AdapterError
from adapters.ops.base import LoraOps
from adapters.ops.meta import SGMVMeta, build_sgmv_meta

__all__ = ["LORA_OPS", "LoraOps", "SGMVMeta", "build_sgmv_meta", "get_lora_ops"]


def _torch_ops() -> LoraOps:
    from adapters.ops.torch_ops import TorchLoraOps

    return TorchLoraOps()


def _cpu_ops() -> LoraOps:
    from adapters.ops.cpu_ops import CpuLoraOps

    return CpuLoraOps()


def _triton_ops() -> LoraOps:
    from adapters.ops.triton_ops import TritonLoraOps

    return TritonLoraOps()


LORA_OPS: dict[str, Callable[[], LoraOps]] = {
    "torch": _torch_ops,
    "cpu": _cpu_ops,
    "triton": _triton_ops,
}


def get_lora_ops(name: str, device: torch.device | str) -> LoraOps:
    """ "auto" is "triton" on CUDA and "cpu" (the C++ kernel, or the torch
    twin where it cannot be built) everywhere else."""
    if name == "auto":
        name = "triton" if torch.device(device).type == "cuda" else "cpu"
    factory = LORA_OPS.get(name)
    if factory is None:
        choices = ", ".join(["auto", *LORA_OPS])
        raise AdapterError(f"unknown backend {name!r}; choose one of {choices}", param="lora_backend")
    return factory()
