"""The quantized formats decoded element by element from their stored
bytes, written apart from the quantizer's and the twin's vectorized code:
the reference the kernel tests (test_quant_linear.py,
test_quant_linear_int8_activations.py), the quantizers' tests and the
engine's quantization tests hold their results to, over SmolLM2-135M's
shapes."""

from __future__ import annotations

import torch

from engine.model import quant_linear

HIDDEN, INTERMEDIATE, KV = 576, 1536, 192  # SmolLM2-135M
SHAPES = {"q/o": (HIDDEN, HIDDEN), "k/v": (KV, HIDDEN), "qkv": (HIDDEN + 2 * KV, HIDDEN),
          "gate_up": (2 * INTERMEDIATE, HIDDEN), "down": (HIDDEN, INTERMEDIATE), "head_rows": (4099, HIDDEN)}
FORMATS = ["int8", "int4", "q8_0"]


def naive_weight(qw) -> torch.Tensor:
    """The float64 [N, K] weight a quantized one stands for, decoded one
    column at a time from the documented layout."""
    if isinstance(qw, quant_linear.Int8Weight):
        return qw.q.double() * qw.scale.double()[:, None]
    if isinstance(qw, quant_linear.Q80Weight):
        return qw.q.double() * qw.d.double().repeat_interleave(32, dim=1)
    n, k = qw.shape
    w = torch.empty(n, k, dtype=torch.float64)
    for col in range(k):
        block, within = divmod(col, 32)
        byte = qw.q[:, block * 16 + within % 16].long()
        value = byte % 16 if within < 16 else byte // 16
        d, m = qw.dm[:, block, 0].double(), qw.dm[:, block, 1].double()
        w[:, col] = d * value + m
    return w


def quantized_weights(shape, seed, *, twin_blocks=False):
    """Every format's quantization of one random weight. `twin_blocks`:
    columns 32-63 repeat columns 0-31, so each format stores the two blocks
    alike (see test_quant_linear.py's `_cancelling_rows`)."""
    gen = torch.Generator().manual_seed(seed)
    n, k = shape
    w = torch.randn(n, k, generator=gen) * k**-0.5
    if twin_blocks:
        w[:, 32:64] = w[:, :32]
    return {fmt: quant_linear.quantize(w, fmt) for fmt in FORMATS}, gen
