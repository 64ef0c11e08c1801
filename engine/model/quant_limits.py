"""How many token rows the quantized kernels (quant_linear.py) take on this host.

A call of few rows (a decode step's) is bound by reading the weights, and
the kernel that streams 4- or 8-bit blocks wins; past some row count the
float path does: the torch twin that dequantizes for the call, or, under
quantization "auto", the float weights kept beside the blocks and
cpu_linear's GEMM. Where that crossover falls depends on the CPU, the
dtype, the thread count and the shape, so it is timed on the calibration
weights when a model loads (`cpu_linear.calibrated_limit`; the LM head on
itself), and kept per host (calibration_cache.py). LORAGW_CPU_LINEAR_MAX_ROWS
overrides every limit.
"""

from __future__ import annotations

import functools
from dataclasses import replace

import torch

from engine.model import cpu_linear, quant_linear
from engine.model.quant_linear import Int8Weight, Q41Weight, Q80Weight, QuantizedWeight, quantize, quantize_int8, twin


def weight_row_limit(kernel, weight: QuantizedWeight, dtype: torch.dtype, *, beside_float: bool) -> int:
    """`row_limit` for `weight`'s calls through `kernel` (`beside_float`: it
    has float weights beside it, quantization "auto"); 0 where there is no
    kernel (a GPU, LORAGW_CPU_LINEAR_KERNEL=0): every call takes the float
    path, and nothing is measured or built. The one place that builds the
    `row_limit` call: functools.cache keys on its keywords as given, so the
    model measures a limit at load through here and its steps find it
    cached."""
    if kernel is None:
        return 0
    threads = torch.get_num_threads()
    if not beside_float:
        return row_limit(dtype, threads)
    return row_limit(dtype, threads, beside_float=weight_format(weight),
                     int8_activations=getattr(weight, "int8_activations", False))


def weight_format(weight: QuantizedWeight) -> str:
    return {Int8Weight: "int8", Q41Weight: "int4", Q80Weight: "q8_0"}[type(weight)]


# Row counts tried for a layer's quantized kernel beside float weights, in
# every format, dtype and host: up to 128. Past that a call is prompt work,
# for which the float GEMM is made. On a 2-core Zen 3 in float32 the Q4_1
# kernel and oneDNN's packed product were level on the calibration shape
# from 128 rows up, so the crossover fell at 128, 256 or 512 rows between
# processes (64, 512 or 1024 before the panel of quant_linear.cpp), while
# over a layer's shapes the kernel took 1.07-1.10x the packed product's
# time at 256 rows (benchmarks/quant_linear.py): a tie on one shape sent
# prompt steps to the slower path in some processes and not in others.
# Ties past 64 rows moved other hosts' limits too (a 2-core Zen 4 in
# bfloat16: Q4_1 from 64 to 256 rows between processes, the Q8_0 kernel on
# this shape 32 in one and 512 in the next; docs/engine.md), where the
# two paths were close.
LAYER_CALIBRATION_ROWS = tuple(r for r in cpu_linear.CALIBRATION_ROWS if r <= 128)


@functools.cache
def row_limit(dtype: torch.dtype, threads: int, *, beside_float: str | None = None,
              int8_activations: bool = False) -> int:
    """The most token rows the quantized kernel takes on this host, measured
    as cpu_linear.row_limit: int8 against the twin it replaces, or, with
    `beside_float` a format (quantization "auto"), that format's kernel
    (with `int8_activations`, rounding them) against the float path the
    larger calls take."""
    kernel = quant_linear.load_kernel()
    if kernel is None or dtype not in (torch.float32, torch.bfloat16):
        return cpu_linear.env_row_limit() or 0
    if beside_float is None:
        int8 = functools.cache(lambda: [quantize_int8(w) for w in cpu_linear.calibration_weights(torch.float32)])
        return cpu_linear.calibrated_limit("CPU quantized linear kernel", dtype, threads,
                                           lambda x, out, i: int8()[i].run_kernel(kernel, x, None, out),
                                           lambda x, i: twin(x, int8()[i]))

    @functools.cache
    def inputs():  # made when measured: a kept limit spares building them
        weights = cpu_linear.calibration_weights(torch.float32)
        quantized = [replace(quantize(w, beside_float), int8_activations=True) if int8_activations
                     else quantize(w, beside_float) for w in weights]
        float_weights = [w.to(dtype) for w in weights]
        return quantized, float_weights, [cpu_linear.pack(w) for w in float_weights]

    float_kernel = cpu_linear.load_kernel()
    label = f"CPU {beside_float} kernel{' on int8 activations' if int8_activations else ''} beside float weights"
    return cpu_linear.calibrated_limit(label, dtype, threads,
                                       lambda x, out, i: inputs()[0][i].run_kernel(kernel, x, None, out),
                                       lambda x, i: cpu_linear.linear(float_kernel, x, inputs()[1][i],
                                                                      None, inputs()[2][i]),
                                       rows=LAYER_CALIBRATION_ROWS,
                                       paths=float_paths(float_kernel, cpu_linear.packing_pays(dtype, threads),
                                                         dtype, threads))


def float_paths(float_kernel, packed: bool, dtype: torch.dtype, threads: int) -> dict:
    """What the float side of a limit beside float weights runs, for
    `calibrated_limit`'s `paths`: its calls of up to the float kernel's
    limit go to that kernel, the others to a packed copy (`packed`) or
    F.linear. Resolved before the limit's own entry is locked."""
    return {"packed": packed,
            "float_limit": cpu_linear.row_limit(dtype, threads) if float_kernel is not None else None}


# Row counts tried on an LM head. A step's head call has a row per sampling
# sequence, so a few hundred at most, and timing a 1,024-row product of the
# head would add seconds to a model's load.
HEAD_CALIBRATION_ROWS = tuple(r for r in cpu_linear.CALIBRATION_ROWS if r <= 256)
_head_limits: dict[tuple, int] = {}  # measured or kept; LORAGW_CPU_LINEAR_MAX_ROWS is read each time


def head_row_limit(kernel, head: QuantizedWeight, float_head: torch.Tensor, float_kernel=None,
                   float_packed: torch.Tensor | None = None) -> int:
    """The most rows for which the kernel multiplies by an LM head kept beside
    its float weights (quantization "auto", a Q8_0 head), measured on that
    head against the float path (quant_linear.linear's arguments), once a host
    for its format, shape, dtype and thread count (`calibrated_limit`). The
    layers' calibration shape does not stand for it: on 2 Zen 4 cores the Q8_0
    kernel beat oneDNN's packed bfloat16 product on the 1536 x 576 shape at 32
    rows, and lost to it by 14-17% on the 49152 x 576 head from 16 rows
    (benchmarks/quant_linear.py). One copy is timed: the head alone is more
    than a host's last-level cache, so it streams from memory as in a step."""
    if kernel is None:
        return 0
    env = cpu_linear.env_row_limit()
    if env is not None:
        return env
    threads = torch.get_num_threads()
    key = (weight_format(head), tuple(head.shape), float_head.dtype, threads, float_packed is not None,
           getattr(head, "int8_activations", False))
    if key not in _head_limits:
        _head_limits[key] = cpu_linear.calibrated_limit(
            f"CPU {key[0]} kernel on the LM head", float_head.dtype, threads,
            lambda x, out, i: head.run_kernel(kernel, x, None, out),
            lambda x, i: cpu_linear.linear(float_kernel, x, float_head, None, float_packed),
            shape=key[1], copies=lambda rows: 1, rows=HEAD_CALIBRATION_ROWS,
            paths={**float_paths(float_kernel, float_packed is not None, float_head.dtype, threads),
                   "int8_activations": key[5]})
    return _head_limits[key]
