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
        rounding of d and m (`tests/engine/model/test_quantizers.py`).
  q8_0  GGUF's Q8_0, read only by quantization "auto" for an LM head
        stored that way: blocks of 32, each with a float16 scale d,
        w = d * q, q int8 in [-127, 127].

The C++ kernel (engine/csrc/quant_linear.cpp) is cpu_linear's skinny kernel
with a dequantizing weight load; it takes up to the rows that
engine/model/quant_limits.py measures against the twin when the model is
built, and keeps for the host, as the float kernel's. Q4_1 and Q8_0 with
bfloat16 activations on a CPU with AVX512-BF16 go another way: each thread
dequantizes a tile of weight rows once, to bfloat16, and multiplies every
token row by it with bfloat16 dot products, which carries it past the few
rows of a decode step (32 rows on a 2-core Intel Xeon, against 8). With
float32 activations on AVX2 (no AVX-512) they take a blocked path: a block's
32 weights widened at once, each row's sum scaled by the block's d once and
m taken out of the sum, which made a one-row call about 3x faster there
(docs/engine.md). Float32 Q4_1 on any AVX2 host, AVX-512 ones included, goes
further and reads a copy of its rows interleaved 8 at a time
(`Q41Weight.interleaved`, made on the first call), so that lanes run over
weight rows and each token row pays one multiply-add per 8 weights, or per
16 with AVX-512 (a layer's calls 1.2-1.6x faster at 1 to 16 rows on a 2-core
Zen 3, 1.1-2.1x on a 2-core Zen 5); calls of 17 rows or more on AVX2 and Zen
4, 9 or more on other AVX-512 hosts, dequantize it to a float32 panel per
thread instead, bit for bit the same sums (1.2-1.3x faster at 17 to 128 rows
on the Zen 3; on a 2-core Intel Xeon 0.96-1.12x at 9 to 16 rows, 1.16-1.29x
at 17 to 128). With float32 activations on AVX-512, other calls of more than
4 rows widen each tile of weight rows once per thread, into float32, and run
the widening loop's sums over it, bit for bit (26-41% faster at 32-64 rows
on a 2-core Intel Xeon). Larger calls (long prefill chunks), other devices
(a GPU) and LORAGW_CPU_LINEAR_KERNEL=0 take the torch twin: dequantize the
weight for the call, then F.linear. No float copy is kept, so memory holds
the quantized weights only; `benchmarks/quant_linear.py` measures what the
per-call dequantization costs a long chunk.

With activation quantization int8 (opt-in, float32, any AVX2 host), the
Q4_1 and Q8_0 kernel calls round each token row's block of 32 activations
to int8 first and sum the integer products exactly, as llama.cpp does
(`Q41Weight.int8_activations`; faster, and much less exact: docs/engine.md,
"Int8 activations").

Quantization "auto" (the default) is the other way round: it keeps the
float weights and adds the Q4_1 form only where that holds every weight
exactly (`quantize_exactly`: a checkpoint dequantized from a Q4_1 GGUF), so
small calls stream 4-bit blocks, larger ones take the float GEMM, and the
model's values never change. Its row limit is measured against that float
path, not the twin (quant_limits.py).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, field
from pathlib import Path

import torch
import torch.nn.functional as F

import native
from engine.model import cpu_linear

SOURCE = Path(__file__).parents[1] / "csrc" / "quant_linear.cpp"
Q4_BLOCK = 32  # weights per (d, m) pair, as GGUF's Q4_1
# Where idle threads sleep (native/__init__.py), a kernel call of fewer
# multiply-adds (token rows x weight rows x K) than this stays on the
# calling thread: waking the other costs ~45 us there, more than two
# threads save on such a call. By the kernel's path: the bfloat16
# dot-product tiles (Q4_1 and Q8_0 with bfloat16 activations on
# AVX512-BF16), or a path that widens each weight in software (float32
# activations, int8 weights, bfloat16 without AVX512-BF16), whose
# multiply-adds take about twice as long. On 2 Zen 5 cores under
# OMP_WAIT_POLICY=PASSIVE (benchmarks/quant_linear.py, weights streamed
# from memory), in microseconds, one thread against two: bfloat16 Q4_1 on
# the 576 x 576 weight at 1 token row 16 against 52, at 16 rows 53 against
# 74; on the 1,536 x 576 weight at 4 rows 54 against 74, at 16 rows 135
# against 119. Float32 Q4_1, one thread against two: the 576 x 576 weight
# at 8 rows 81 against 89, at 16 rows 122 against 108; the 1,536 x 576
# weight at 2 rows 81 against 79, at 4 rows 107 against 92.
# The bfloat16 tiles on AMX are a third path: each call dequantizes all its
# weights, whatever its rows, and a tile multiply-add takes 16 token rows,
# so their multiply-adds count the rows padded to whole tiles. On 2 Intel
# Xeon (Emerald Rapids) cores, the same setting, one thread against two:
# Q4_1 at 1 row on the 192 x 576 weight (1.8 M multiply-adds padded) 33
# against 46, at 16 rows 31 against 46; on the 576 x 576 weight (5.3 M) 74
# against 51; on the 1,536 x 576 weight 134 against 94, where oneDNN's
# packed bfloat16 product took 114, so with the Zen 5 limit the Q4_1
# kernel's calibrated row limit came out 0 and a decode step read bfloat16.
# Float32 Q4_1 on its interleaved copy in 16 lanes, on 512-bit units of
# full width (Zen 5; Intel's, timed in the engine only; not Zen 4), is a fourth: one weight
# widening serves every token row, and one thread runs about twice the
# widening path's pace. The limit sits among the timed ties. On 2 Zen 5
# cores, the same setting, a decode step's calls in order (30 layers,
# weights streamed from memory), one thread against two:
# the 960 x 576 qkv weight at 16 rows (8.8 M) 97 against 109, at 24 rows
# (13.3 M) 130 against 120; the 576 x 1,536 down weight at 8 rows (7.1 M)
# 86 against 98, at 12 rows (10.6 M) 125 against 120; the 3,072 x 576
# gate_up weight at 2 rows (3.5 M) 101 against 107, at 4 rows (7.1 M) 130
# against 121, the one layer call that this limit keeps on one thread and
# loses by it.
SERIAL_MACS_WHEN_THREADS_SLEEP = {"bfloat16 tiles": 6 << 20, "widening": 3 << 20, "AMX tiles": 3 << 20,
                                  "16 lanes": 9 << 20}

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
        return kernel.int8_linear(x, self.q, self.scale, bias, out, *serial_macs())


@dataclass
class Q41Weight:
    q: torch.Tensor  # [N, K / 2] uint8, two 4-bit values per byte
    dm: torch.Tensor  # [N, K / 32, 2] float16: (d, m) per block
    # The kernel rounds float32 activations to int8 per block of 32 before
    # multiplying (activation quantization int8, `use_int8_activations`).
    int8_activations: bool = False
    # The kernel's copy of q and dm with the rows interleaved 8 at a time,
    # for its float32 calls on a build that takes one (`interleaved`); []
    # where it takes none, None until the first such call.
    # Not an init field, so that `replace` (a changed q, say) starts without one.
    interleaved_copy: list[torch.Tensor] | None = field(default=None, init=False, repr=False, compare=False)

    @property
    def shape(self) -> torch.Size:
        return torch.Size((self.q.shape[0], self.q.shape[1] * 2))

    @property
    def nbytes(self) -> int:
        return self.q.nbytes + self.dm.nbytes + sum(t.nbytes for t in self.interleaved_copy or ())

    def interleaved(self, kernel, x: torch.Tensor) -> list[torch.Tensor]:
        """What `kernel.q4_1_linear` takes for `x` beside q and dm: the
        interleaved copy, made once, for float32 activations without int8
        rounding on a build whose float32 path reads it
        (`q4_1_interleaves`: AVX2, AVX-512 included), else []."""
        if x.dtype != torch.float32 or self.int8_activations:
            return []
        if self.interleaved_copy is None:
            takes = self.q.shape[0] % 8 == 0 and self.q.is_contiguous() and self.dm.is_contiguous()
            self.interleaved_copy = (kernel.q4_1_interleave(self.q, self.dm)
                                     if takes and kernel.q4_1_interleaves() else [])
        return self.interleaved_copy

    def dequantize(self, dtype: torch.dtype) -> torch.Tensor:
        n, k = self.shape
        blocks = self.q.view(n, k // Q4_BLOCK, Q4_BLOCK // 2)
        values = torch.cat((blocks & 0x0F, blocks >> 4), dim=-1).float()  # [N, K / 32, 32]
        dm = self.dm.float()
        return (values * dm[..., :1] + dm[..., 1:]).reshape(n, k).to(dtype)

    def run_kernel(self, kernel, x: torch.Tensor, bias: torch.Tensor | None, out: torch.Tensor) -> bool:
        return kernel.q4_1_linear(x, self.q, self.dm, bias, out, self.int8_activations, *serial_macs(),
                                  self.interleaved(kernel, x))


@dataclass
class Q80Weight:
    q: torch.Tensor  # [N, K] int8
    d: torch.Tensor  # [N, K / 32] float16: one scale per block
    int8_activations: bool = False  # as Q41Weight's

    @property
    def shape(self) -> torch.Size:
        return self.q.shape

    @property
    def nbytes(self) -> int:
        return self.q.nbytes + self.d.nbytes

    def dequantize(self, dtype: torch.dtype) -> torch.Tensor:
        n, k = self.shape
        blocks = self.q.view(n, k // Q4_BLOCK, Q4_BLOCK).float()
        return (blocks * self.d.float()[..., None]).reshape(n, k).to(dtype)

    def run_kernel(self, kernel, x: torch.Tensor, bias: torch.Tensor | None, out: torch.Tensor) -> bool:
        return kernel.q8_0_linear(x, self.q, self.d, bias, out, self.int8_activations, *serial_macs())


QuantizedWeight = Int8Weight | Q41Weight | Q80Weight


@functools.cache
def serial_macs() -> tuple[int, int, int, int]:
    """The kernels' one-thread limits, (bfloat16 tiles, widening, AMX
    tiles, 16 lanes). A call uses the limit of the path it takes, and only
    the build knows which that is (quant_linear.cpp, `SerialMacs`)."""
    limits = SERIAL_MACS_WHEN_THREADS_SLEEP
    tiles, widening, amx, lanes16 = (native.serial_below(limits[path])
                                     for path in ("bfloat16 tiles", "widening", "AMX tiles", "16 lanes"))
    return tiles, widening, amx, lanes16


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


def quantize_q8_0(weight: torch.Tensor) -> Q80Weight:
    """GGUF Q8_0 of a float [N, K] weight (K a multiple of 32): per block,
    d = max|w| / 127 (float16), q = round(w / d)."""
    n, k = weight.shape
    if k % Q4_BLOCK:
        raise ValueError(f"q8_0 needs in_features divisible by {Q4_BLOCK}, got {k}")
    w = weight.float().reshape(n, k // Q4_BLOCK, Q4_BLOCK)
    d = (w.abs().amax(dim=-1) / 127).half()
    d32 = d.float()
    safe_d = torch.where(d32 == 0, torch.ones_like(d32), d32)
    q = torch.round(w / safe_d[..., None]).clamp_(-127, 127).to(torch.int8)
    return Q80Weight(q.reshape(n, k).contiguous(), d.contiguous())


# EngineConfig.quantization's explicit methods -> their quantizer.
QUANTIZERS = {"int8": quantize_int8, "int4": quantize_q4_1}
# Every format by name: those, and the one "auto" reads a head in.
FORMATS = {**QUANTIZERS, "q8_0": quantize_q8_0}
# The LM head is int8 under both: in 4 bits its logits move too far. The
# bundled GGUF keeps it (the tied embedding table) in 8 bits as well (Q8_0);
# Q4_1 of it measured 9% relative weight error, int8 per channel 1.2%.
HEAD_QUANTIZATION = {"int8": "int8", "int4": "int8"}
# Quantization "auto" reads a checkpoint's linears as Q4_1 where they are
# exactly Q4_1 values: the bundled GGUF's format, and the one whose kernel
# streams the fewest bytes. Its LM head (the tied embedding table) is Q8_0
# there, as in most GGUFs: 1.06 bytes a weight against bfloat16's 2.
AS_STORED = "int4"
HEAD_AS_STORED = "q8_0"
BLOCKED = ("int4", "q8_0")  # formats made of blocks of 32 along K


def quantize(weight: torch.Tensor, method: str) -> QuantizedWeight:
    return FORMATS[method](weight)


def quantize_exactly(weight: torch.Tensor, method: str) -> QuantizedWeight | None:
    """`weight` in `method`'s format if that stores every value exactly (a
    checkpoint dequantized from it, such as a Q4_1 GGUF), else None."""
    if method in BLOCKED and weight.shape[-1] % Q4_BLOCK:
        return None  # not made of blocks
    quantized = quantize(weight, method)
    return quantized if torch.equal(quantized.dequantize(torch.float32), weight.float()) else None


def linear(kernel, x: torch.Tensor, weight: QuantizedWeight, bias: torch.Tensor | None = None,
           float_weight: torch.Tensor | None = None, float_kernel=None,
           float_packed: torch.Tensor | None = None, *, limit: int) -> torch.Tensor:
    """x [T, K] @ dequant(weight)^T (+ bias) -> [T, N] in x's dtype: by the
    kernel for up to `limit` rows (quant_limits.py: what this host measured)
    when it takes the tensors. Larger calls (`kernel` None: every call) go
    to `float_weight`, the same values kept in x's dtype (quantization
    "auto"), through cpu_linear with `float_kernel` and `float_packed`
    (`cpu_linear.pack` of it), or without it to the torch twin."""
    if kernel is not None and x.dim() == 2 and 0 < x.shape[0] <= limit:
        out = torch.empty(x.shape[0], weight.shape[0], dtype=x.dtype, device=x.device)
        if weight.run_kernel(kernel, x, bias, out):
            return out
    if float_weight is not None:
        return cpu_linear.linear(float_kernel, x, float_weight, bias, float_packed)
    return twin(x, weight, bias)


def int8_activations_available(kernel, dtype: torch.dtype) -> bool:
    """Whether the blocked kernels can round `dtype` activations to int8
    here: float32, on a build with the AVX2 path."""
    return kernel is not None and dtype == torch.float32 and kernel.int8_activations_built()


def use_int8_activations(weights: list[QuantizedWeight | None]) -> None:
    """Marks the blocked weights among `weights` (Q4_1, Q8_0) to have their
    kernel calls round the activations to int8. Int8 per-channel weights
    (an int4 model's head) keep float activations."""
    for weight in weights:
        if isinstance(weight, (Q41Weight, Q80Weight)):
            weight.int8_activations = True


def twin(x: torch.Tensor, weight: QuantizedWeight, bias: torch.Tensor | None = None) -> torch.Tensor:
    """The torch path: dequantize for this call, then F.linear."""
    return F.linear(x, weight.dequantize(x.dtype), bias)
