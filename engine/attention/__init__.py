"""Attention backends and the one place that chooses among them.

Factories import their backend lazily, so importing this registry never
requires triton.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from engine.attention.base import AttentionBackend, AttentionMetadata
from engine.errors import ValidationError

__all__ = ["ATTENTION_BACKENDS", "AttentionBackend", "AttentionMetadata", "get_attention_backend"]


def _torch_backend(device: torch.device) -> AttentionBackend:
    from engine.attention.torch_backend import TorchAttentionBackend

    backend = TorchAttentionBackend()
    if device.type == "cpu":
        # Build (or load the cached builds) before serving, not mid-step.
        backend.load_decode_kernel()
        backend.load_prefill_kernel()
    return backend


def _triton_backend(device: torch.device) -> AttentionBackend:
    from engine.attention.triton_backend import TritonAttentionBackend

    return TritonAttentionBackend()


ATTENTION_BACKENDS: dict[str, Callable[[torch.device], AttentionBackend]] = {
    "torch": _torch_backend,
    "triton": _triton_backend,
}


def get_attention_backend(name: str, device: torch.device) -> AttentionBackend:
    """ "auto" is "triton" on CUDA and "torch" everywhere else."""
    if name == "auto":
        name = "triton" if torch.device(device).type == "cuda" else "torch"
    factory = ATTENTION_BACKENDS.get(name)
    if factory is None:
        choices = ", ".join(["auto", *ATTENTION_BACKENDS])
        raise ValidationError("attention_backend", f"unknown backend {name!r}; choose one of {choices}")
    return factory(torch.device(device))
