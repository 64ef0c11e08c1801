"""Weight-only quantized linears: int8 and int4 (Q4_1) weights, float activations.

A decode step is bound by reading the weights (SmolLM2-135M's linears are
~540 MB in float32), so storing them in 8 or 4 bits cuts the bytes a step
streams by 4x or ~6x. Activations stay float32 or bfloat16; weights are
widened to float32 in registers and every sum runs in float32.

Formats (both quantized from the float32 checkpoint when the model loads):
  int8  per output channel, symmetric: w[n, k] = scale[n] * q[n, k],
        scale = max|w[n]| / 127 (float32), q int8 in [-127, 127].
  q4_1  GGUF's Q4_1: blocks of 32 weights along K, each with a float16
        scale d and minimum m, w = d * q + m, q in [0, 15], two per byte
        (byte i of a block: element i low, element i + 16 high). The bundled
        SmolLM2 ships as Q4_1, so its linears come back to within float16
        rounding of d and m (`tests/engine/model/test_quant_linear.py`).

The C++ kernel (engine/csrc/quant_linear.cpp) is cpu_linear's skinny kernel
with a dequantizing weight load; it takes up to `row_limit` rows, measured
against the twin when the model is built, as the float kernel's. Larger calls (long prefill chunks), other devices
(a GPU) and LORAGW_CPU_LINEAR_KERNEL=0 take the torch twin: dequantize the
weight for the call, then F.linear. No float copy is kept, so memory holds
the quantized weights only; `benchmarks/quant_linear.py` measures what the
per-call dequantization costs a long chunk.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F

import native
from engine.model import cpu_linear

SOURCE = Path(__file__).parents[1] / "csrc" / "quant_linear.cpp"
Q4_BLOCK = 32  # weights per (d, m) pair, as GGUF's Q4_1

_KERNEL = native.Kernel("loragw_quant_linear", SOURCE, "CPU quantized linear kernel", cpu_linear.ENV_SWITCH)
load_kernel = _KERNEL.load


@dataclass
class Int8Weight:
    q: torch.Tensor  # [N, K] int8
    scale: torch.Tensor  # [N] float32

    @property
    def shape(self) -> torch.Size:
        return self.q.shape

    @property
    def nbytes(self) -> int:
        return self.q.nbytes + self.scale.nbytes

    def dequantize(self, dtype: torch.dtype) -> torch.Tensor:
        return (self.q.float() * self.scale[:, None]).to(dtype)

    def run_kernel(self, kernel, x: torch.Tensor, bias: torch.Tensor | None, out: torch.Tensor) -> bool:
        return kernel.int8_linear(x, self.q, self.scale, bias, out)


@dataclass
class Q41Weight:
    q: torch.Tensor  # [N, K / 2] uint8, two 4-bit values per byte
    dm: torch.Tensor  # [N, K / 32, 2] float16: (d, m) per block

    @property
    def shape(self) -> torch.Size:
        return torch.Size((self.q.shape[0], self.q.shape[1] * 2))

    @property
    def nbytes(self) -> int:
        return self.q.nbytes + self.dm.nbytes

    def dequantize(self, dtype: torch.dtype) -> torch.Tensor:
        n, k = self.shape
        blocks = self.q.view(n, k // Q4_BLOCK, Q4_BLOCK // 2)
        values = torch.cat((blocks & 0x0F, blocks >> 4), dim=-1).float()  # [N, K / 32, 32]
        dm = self.dm.float()
        return (values * dm[..., :1] + dm[..., 1:]).reshape(n, k).to(dtype)

    def run_kernel(self, kernel, x: torch.Tensor, bias: torch.Tensor | None, out: torch.Tensor) -> bool:
        return kernel.q4_1_linear(x, self.q, self.dm, bias, out)


QuantizedWeight = Int8Weight | Q41Weight


def quantize_int8(weight: torch.Tensor) -> Int8Weight:
    """Per-output-channel symmetric int8 of a float [N, K] weight."""
    w = weight.float()
    scale = w.abs().amax(dim=1) / 127
    scale = torch.where(scale == 0, torch.ones_like(scale), scale)  # an all-zero row stays zero
    q = torch.round(w / scale[:, None]).clamp_(-127, 127).to(torch.int8)
    return Int8Weight(q.contiguous(), scale.contiguous())


def quantize_q4_1(weight: torch.Tensor) -> Q41Weight:
    """GGUF Q4_1 of a float [N, K] weight (K a multiple of 32): per block,
    m = min, d = (max - min) / 15, q = round((w - m) / d)."""
    n, k = weight.shape
    if k % Q4_BLOCK:
        raise ValueError(f"int4 needs in_features divisible by {Q4_BLOCK}, got {k}")
    w = weight.float().reshape(n, k // Q4_BLOCK, Q4_BLOCK)
    lo, hi = w.amin(dim=-1, keepdim=True), w.amax(dim=-1, keepdim=True)
    d = ((hi - lo) / 15).half()
    m = lo.half()
    # Rounded against the float16 d and m that are stored, so q matches them.
    d32, m32 = d.float(), m.float()
    safe_d = torch.where(d32 == 0, torch.ones_like(d32), d32)
    q = torch.round((w - m32) / safe_d).clamp_(0, 15).to(torch.uint8)
    packed = q[..., : Q4_BLOCK // 2] | (q[..., Q4_BLOCK // 2 :] << 4)
    return Q41Weight(packed.reshape(n, k // 2).contiguous(), torch.cat((d, m), dim=-1).contiguous())


# EngineConfig.quantization's values other than "none" -> their quantizer.
QUANTIZERS = {"int8": quantize_int8, "int4": quantize_q4_1}
# The LM head is int8 under both: in 4 bits its logits move too far. The
# bundled GGUF keeps it (the tied embedding table) in 8 bits as well (Q8_0);
# Q4_1 of it measured 9% relative weight error, int8 per channel 1.2%.
HEAD_QUANTIZATION = {"int8": "int8", "int4": "int8"}


def quantize(weight: torch.Tensor, method: str) -> QuantizedWeight:
    return QUANTIZERS[method](weight)


def linear(kernel, x: torch.Tensor, weight: QuantizedWeight, bias: torch.Tensor | None = None) -> torch.Tensor:
    """x [T, K] @ dequant(weight)^T (+ bias) -> [T, N] in x's dtype: by the
    kernel for up to `row_limit` rows when it takes the tensors, else the
    torch twin (`kernel` None: always the twin)."""
    if kernel is not None and x.dim() == 2 and 0 < x.shape[0] <= row_limit(x.dtype, torch.get_num_threads()):
        out = torch.empty(x.shape[0], weight.shape[0], dtype=x.dtype, device=x.device)
        if weight.run_kernel(kernel, x, bias, out):
            return out
    return twin(x, weight, bias)


@functools.cache
def row_limit(dtype: torch.dtype, threads: int) -> int:
    """The most token rows the quantized kernel takes on this host, measured
    (int8, as cpu_linear.row_limit) against the twin it replaces."""
    kernel = load_kernel()
    if kernel is None or dtype not in (torch.float32, torch.bfloat16):
        return cpu_linear.env_row_limit() or 0
    weight = quantize_int8(cpu_linear.calibration_weight(torch.float32))
    return cpu_linear.calibrated_limit("CPU quantized linear kernel", dtype, threads,
                                       lambda x, out: weight.run_kernel(kernel, x, None, out),
                                       lambda x: twin(x, weight))


def twin(x: torch.Tensor, weight: QuantizedWeight, bias: torch.Tensor | None = None) -> torch.Tensor:
    """The torch path: dequantize for this call, then F.linear."""
    return F.linear(x, weight.dequantize(x.dtype), bias)
