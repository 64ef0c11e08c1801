"""Rotary position embeddings for the Llama family, numerically matching HF.

The inverse frequencies come from transformers' own `ROPE_INIT_FUNCTIONS`, so
every scaling type it implements (linear, llama3, yarn, ...) matches HF bit for
bit. Types whose frequencies change with the current sequence length (dynamic
NTK, longrope) are rejected: a paged engine computes RoPE per position, once,
and cannot re-rotate cached keys when the sequence grows.
"""

from __future__ import annotations

import torch
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

from engine.errors import ModelLoadError

SEQ_LEN_DEPENDENT_ROPE_TYPES = frozenset({"dynamic", "longrope"})


def rope_parameters(config) -> dict:
    """The config's RoPE parameters in the transformers 5 layout
    (`rope_type`, `rope_theta`, plus the scaling type's own keys)."""
    params = getattr(config, "rope_parameters", None)
    if not params:
        legacy = getattr(config, "rope_scaling", None) or {}
        params = dict(legacy)
        params.setdefault("rope_theta", getattr(config, "rope_theta", 10000.0))
    params = dict(params)
    params.setdefault("rope_type", params.get("type", "default"))
    return params


def head_dim_of(config) -> int:
    return getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads


def compute_inv_freq(config) -> tuple[torch.Tensor, float]:
    """Returns (inv_freq [head_dim // 2] float32, attention_scaling)."""
    params = rope_parameters(config)
    rope_type = params["rope_type"]
    if rope_type in SEQ_LEN_DEPENDENT_ROPE_TYPES:
        raise ModelLoadError(
            f"rope_type {rope_type!r} depends on the sequence length and is not supported; "
            "supported: default, " + ", ".join(sorted(supported_rope_types() - {"default"}))
        )
    if params.get("partial_rotary_factor", 1.0) != 1.0:
        raise ModelLoadError("partial_rotary_factor != 1 is not supported by the Llama family")
    if rope_type == "default":
        # The same expression as HF's LlamaRotaryEmbedding.compute_default_rope_parameters.
        base = params["rope_theta"]
        dim = head_dim_of(config)
        inv_freq = 1.0 / (base ** (torch.arange(0, dim, 2, dtype=torch.float) / dim))
        return inv_freq, 1.0
    init_fn = ROPE_INIT_FUNCTIONS.get(rope_type)
    if init_fn is None:
        raise ModelLoadError(
            f"unknown rope_type {rope_type!r}; supported: {', '.join(sorted(supported_rope_types()))}"
        )
    try:
        inv_freq, attention_scaling = init_fn(config)
    except (KeyError, TypeError, ValueError) as exc:
        raise ModelLoadError(f"invalid rope_parameters for rope_type {rope_type!r}: {exc}") from exc
    return inv_freq.to(torch.float32), float(attention_scaling)


def supported_rope_types() -> set[str]:
    return {"default"} | (set(ROPE_INIT_FUNCTIONS) - SEQ_LEN_DEPENDENT_ROPE_TYPES)


class RotaryEmbedding(torch.nn.Module):
    """cos/sin tables for a flat batch of positions, shared by every layer."""

    def __init__(self, config, device: torch.device):
        super().__init__()
        inv_freq, self.attention_scaling = compute_inv_freq(config)
        self.register_buffer("inv_freq", inv_freq.to(device), persistent=False)

    def forward(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """positions [T] int64 -> (cos, sin), each [T, 1, head_dim] in `dtype`.

        Computed in float32 in HF's op order, then cast, so float32 runs
        reproduce HF's rotation exactly."""
        freqs = positions[:, None].float() * self.inv_freq[None, :]
        emb = torch.cat((freqs, freqs), dim=-1)
        cos = emb.cos() * self.attention_scaling
        sin = emb.sin() * self.attention_scaling
        return cos.to(dtype).unsqueeze(1), sin.to(dtype).unsqueeze(1)


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [T, heads, head_dim]; cos/sin [T, 1, head_dim]. HF's rotate_half convention."""
    return (x * cos) + (rotate_half(x) * sin)
