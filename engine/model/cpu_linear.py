"""Linear layers for a few rows on the CPU: a small C++ kernel.

A decode step multiplies a handful of token rows by every weight of the
model. That is memory-bound: the cost is streaming the weights once. torch's
CPU GEMM is built for the opposite case and, measured on our 2-core box,
moves the weights at 6 to 11 GB/s for 1 to 16 rows (it packs the weight
matrix on every call, and wakes its threads for each), where a plain read
runs at 25 to 50 GB/s. Decode steps of few sequences spent 87% of their time
in those matmuls.

This kernel (engine/csrc/cpu_linear.cpp) reads each weight row once per
call and computes every token row's dot product with it from L1, in
register tiles (4 token rows x 4 weight rows, or 1 x 16 for a single row),
float32 accumulation for float32 and bfloat16 alike, threads splitting the
weight rows. torch's F.linear is the twin that
the tests hold it to. It is switched off by LORAGW_CPU_LINEAR_KERNEL=0 and
built like the other kernels (native/__init__.py).

Where the GEMM wins depends on the host. On a 2-core AMD EPYC with AVX-512,
torch's MKL GEMM was slower than the kernel at every row count up to 1,024,
prefill chunks included (1.3x there; `benchmarks/linear_kernel.py`). On a
2-core AMD EPYC (Zen 3) with AVX2 only, MKL won from one row: the kernel's
16-lane vectors are two registers each there, and its tiles spill (a
standalone build with 8-lane vectors matched MKL, no more). MKL picks its
code path by CPU vendor and model, so no fixed limit holds: the limit is
measured once per process, dtype and thread count (`row_limit`, from one
row to 1,024, when the model is built), 0 where torch wins from the start,
or set outright by LORAGW_CPU_LINEAR_MAX_ROWS. The quantized kernels
(quant_linear.py) calibrate theirs the same way.

Numerics: the sum runs in a different order than torch's GEMM, so results
match it to float32 rounding, not bit for bit.
"""

from __future__ import annotations

import functools
import logging
import os
import time
from pathlib import Path

import torch
import torch.nn.functional as F

import native

log = logging.getLogger(__name__)

ENV_SWITCH = "LORAGW_CPU_LINEAR_KERNEL"
ROWS_ENV = "LORAGW_CPU_LINEAR_MAX_ROWS"
# Row counts the calibration tries, on a gate_proj-sized weight (1536 x 576:
# bigger than a core's L2, as every weight of the model). It starts at one
# row: on a host whose vectors the kernel's tiles do not fit, torch may win
# at every count. 8 covers a decode step's few sequences, or one sequence
# verifying its speculative drafts (1 + K rows).
CALIBRATION_ROWS = (1, 4, 8, 16, 32, 64, 128, 256, 512, 1024)
CALIBRATION_SHAPE = (1536, 576)
CALIBRATION_REPEATS = 5
# Distinct weights a timed call of a few rows streams (113 MB of float32,
# 57 MB of bfloat16): more than a host's last-level cache, as a decode step's
# weights are. Timed on one weight, read from cache, the bandwidth-bound
# paths looked faster than they run: a Q4_1 kernel that reads 3.5x fewer
# bytes than bfloat16 lost to it at one row in a cached calibration, and won
# in decode.
CALIBRATION_COPIES = 32
SOURCE = Path(__file__).parents[1] / "csrc" / "cpu_linear.cpp"


_KERNEL = native.Kernel("loragw_cpu_linear", SOURCE, "CPU linear kernel", ENV_SWITCH)
load_kernel = _KERNEL.load


def linear(kernel, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """F.linear, by the kernel when `x` has at most `row_limit` rows and the
    kernel takes the tensors; `kernel` None is plain F.linear."""
    if kernel is not None and x.dim() == 2 and 0 < x.shape[0] <= row_limit(x.dtype, torch.get_num_threads()):
        out = torch.empty(x.shape[0], weight.shape[0], dtype=x.dtype, device=x.device)
        if kernel.skinny_linear(x, weight, bias, out):
            return out
    return F.linear(x, weight, bias)


@functools.cache
def row_limit(dtype: torch.dtype, threads: int) -> int:
    """The most token rows the kernel takes in `dtype` with `threads` torch
    threads (the current count, which the measurement runs at) on this host:
    LORAGW_CPU_LINEAR_MAX_ROWS when set, else measured against F.linear."""
    kernel = load_kernel()
    if kernel is None or dtype not in (torch.float32, torch.bfloat16):
        return env_row_limit() or 0
    weights = calibration_weights(dtype)
    return calibrated_limit("CPU linear kernel", dtype, threads,
                            lambda x, out, i: kernel.skinny_linear(x, weights[i], None, out),
                            lambda x, i: F.linear(x, weights[i]))


def env_row_limit() -> int | None:
    env = os.environ.get(ROWS_ENV)
    if not env:
        return None
    try:
        limit = int(env)
    except ValueError:
        raise ValueError(f"{ROWS_ENV}={env!r} is not a number of rows") from None
    if limit < 0:
        raise ValueError(f"{ROWS_ENV}={env!r} must be >= 0")
    return limit


def calibration_weights(dtype: torch.dtype) -> list[torch.Tensor]:
    """CALIBRATION_COPIES random weights of CALIBRATION_SHAPE."""
    n, k = CALIBRATION_SHAPE
    gen = torch.Generator().manual_seed(0)
    return [(torch.randn(n, k, generator=gen) * k**-0.5).to(dtype) for _ in range(CALIBRATION_COPIES)]


def copies_for(rows: int) -> int:
    """How many of the copies a timed call of `rows` rows goes through: all
    of them up to 32 rows, where reading the weight is still much of a
    call's cost (a decode step of a few dozen sequences); one above, where
    the arithmetic per weight byte decides (and streaming every copy would
    make the calibration seconds long). Timed on one cached copy at 16 rows,
    oneDNN's bfloat16 GEMM looked faster than it runs in a decode step."""
    return CALIBRATION_COPIES if rows <= 32 else 1


def calibrated_limit(what: str, dtype: torch.dtype, threads: int, run_kernel, run_torch) -> int:
    """LORAGW_CPU_LINEAR_MAX_ROWS when set, else the crossover of
    `run_kernel(x, out)` against `run_torch(x)`, logged."""
    env = env_row_limit()
    if env is not None:
        return env
    t0 = time.perf_counter()
    limit = crossover(measure(run_kernel, run_torch, dtype))
    log.info("%s: up to %d rows in %s on %d threads (calibrated in %.0f ms)", what, limit,
             str(dtype).removeprefix("torch."), threads, (time.perf_counter() - t0) * 1e3)
    return limit


def measure(run_kernel, run_torch, dtype: torch.dtype) -> dict[int, tuple[float, float]]:
    """rows -> (kernel, torch) seconds, each the best of CALIBRATION_REPEATS
    interleaved runs (the best is the least disturbed by other processes),
    up to the first row count where torch wins: past it the kernel takes
    nothing, and on a host where it is slow its large calls are slow too.
    `run_kernel(x, out, i)` and `run_torch(x, i)` multiply by copy i; a run
    goes through `copies_for(rows)` of them."""
    gen = torch.Generator().manual_seed(1)
    n, k = CALIBRATION_SHAPE
    timings = {}
    for rows in CALIBRATION_ROWS:
        x = torch.randn(rows, k, generator=gen).to(dtype)
        out = torch.empty(rows, n, dtype=dtype)
        copies = range(copies_for(rows))
        best = [float("inf"), float("inf")]
        for _ in range(CALIBRATION_REPEATS):
            for path, run in enumerate((lambda i: run_kernel(x, out, i), lambda i: run_torch(x, i))):
                t0 = time.perf_counter()
                for i in copies:
                    run(i)
                best[path] = min(best[path], time.perf_counter() - t0)
        timings[rows] = (best[0], best[1])
        if best[0] >= best[1]:
            break
    return timings


def crossover(timings: dict[int, tuple[float, float]]) -> int:
    """The largest row count up to which the kernel was faster at every
    measured point (0 when it lost at the first)."""
    limit = 0
    for rows in sorted(timings):
        kernel_s, torch_s = timings[rows]
        if kernel_s >= torch_s:
            break
        limit = rows
    return limit
