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
measured per dtype and thread count (`row_limit`, from one row to 1,024,
when the model is built), 0 where torch wins from the start, or set
outright by LORAGW_CPU_LINEAR_MAX_ROWS. The first process on a host to
measure it keeps it for the later ones (calibration_cache.py), so that a
near-tie does not fall one way in one process and the other way in the
next. The quantized kernels' limits (quant_limits.py) are measured the same way.

Numerics: the sum runs in a different order than torch's GEMM, so results
match it to float32 rounding, not bit for bit.

The calls past the kernel's limit go to torch. In bfloat16 that is oneDNN,
and F.linear hands oneDNN the plain row-major weight, which it reorders into
its blocked layout on every call: on a 2-core Intel Xeon with AMX a
gate_proj call took 192 to 271 us at 1 to 64 rows. `pack` keeps that
reordered copy beside the weight, made once at load, and `linear` hands it
to oneDNN's own linear op: 135 to 169 us there, with values that equalled
F.linear's in our checks (`benchmarks/quant_linear.py`, docs/benchmarks.md).
In float32, F.linear is MKL's GEMM, and oneDNN's packed product is another
GEMM: on a 2-core AMD EPYC (Zen 3, AVX2) it ran the 3072 x 576 gate_up
weight 1.3 to 1.6x faster than MKL from 16 to 128 rows, where MKL reached
51 to 94 GFLOP/s. Its sums run in another order than MKL's, so it matches
F.linear to float32 rounding, as the skinny kernels do, not bit for bit.
Whether packing pays is measured per dtype, and kept, as the limits
are (`packing_pays`). The copy costs as much memory as the float weights it
packs; LORAGW_CPU_PACKED_WEIGHTS=0 turns it off.
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
from engine.model import calibration_cache

log = logging.getLogger(__name__)

ENV_SWITCH = "LORAGW_CPU_LINEAR_KERNEL"
ROWS_ENV = "LORAGW_CPU_LINEAR_MAX_ROWS"
PACK_ENV = "LORAGW_CPU_PACKED_WEIGHTS"
# The row count oneDNN lays its packed weight out for; the copy serves every
# count. Packed for 1 row, its 32- and 64-row calls on the AMX host were
# slower than the unpacked weight's; packed for 128, every count from 1 to
# 256 was 1.35-1.6x faster, and 1,024 level.
PACK_ROWS_HINT = 128
# Packing pays where the packed product is no slower than F.linear, within
# PACK_SLACK, at a decode batch (16 rows) and at a prefill-sized call (128),
# and faster over the two (the product of its time ratios below 1). Either
# can time level on a host where the other gains: both paths read the same
# bytes at 16 rows, and a loaded host timed them 247 against 247 us there
# (an idle one 133 against 193); on an AVX2 Zen 3 the two GEMMs ran 128 rows
# level in one process (1829 against 1821 us) and 16% apart in the next,
# while the packed one took 22-45% less time at 16 rows in each. A tie at one
# size is no reason to lose the other's gain.
PACK_CALIBRATION_ROWS = (16, 128)
# The dtypes whose packing is measured; float16 on a CPU keeps F.linear.
PACKED_DTYPES = (torch.bfloat16, torch.float32)
PACK_SLACK = 1.05
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


def linear(kernel, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
           packed: torch.Tensor | None = None) -> torch.Tensor:
    """F.linear, by the kernel when `x` has at most `row_limit` rows and the
    kernel takes the tensors; `kernel` None is the torch path alone. That
    path multiplies by `packed`, `pack(weight)`, where it is given."""
    if kernel is not None and x.dim() == 2 and 0 < x.shape[0] <= row_limit(x.dtype, torch.get_num_threads()):
        out = torch.empty(x.shape[0], weight.shape[0], dtype=x.dtype, device=x.device)
        if kernel.skinny_linear(x, weight, bias, out):
            return out
    if packed is not None:
        return torch.ops.mkldnn._linear_pointwise(x, packed, bias, "none", [], "")
    return F.linear(x, weight, bias)


def pack(weight: torch.Tensor) -> torch.Tensor | None:
    """oneDNN's packed copy of `weight` [N, K] for `linear`, where packing
    pays on this host (`packing_pays`), else None. The caller must not
    change `weight` afterwards: the copy would not follow."""
    if weight.device.type != "cpu" or weight.dim() != 2 or not packing_pays(weight.dtype, torch.get_num_threads()):
        return None
    return packed_copy(weight.detach())


def packed_copy(weight: torch.Tensor) -> torch.Tensor:
    """oneDNN's packed copy of a bfloat16 or float32 `weight` [N, K], whether or not it pays."""
    return torch.ops.mkldnn._reorder_linear_weight(weight, PACK_ROWS_HINT)


@functools.cache
def packing_pays(dtype: torch.dtype, threads: int) -> bool:
    """Whether weights of `dtype` are worth packing with `threads` torch
    threads: LORAGW_CPU_PACKED_WEIGHTS when set ("0" or "1"), else as kept
    on this host (calibration_cache.py) or measured on the calibration
    weights, the packed product against F.linear at PACK_CALIBRATION_ROWS.
    Never for a dtype but PACKED_DTYPES, nor where this torch or CPU cannot
    pack it (`can_pack`)."""
    if not can_pack(dtype):
        return False
    env = os.environ.get(PACK_ENV)
    if env:
        if env not in ("0", "1"):
            raise ValueError(f"{PACK_ENV}={env!r} must be 0 or 1")
        return env == "1"
    t0 = time.perf_counter()
    facts = {"packing": str(dtype), "threads": threads}
    found = calibration_cache.remembered(lambda: facts, bool, lambda: packing_measured_to_pay(dtype, threads))
    if found.kept_in is not None:
        log.info("packed %s weights on %d threads: %s (%s)", str(dtype).removeprefix("torch."), threads,
                 "on" if found.value else "off", found.origin(t0))
    return found.value


def packing_measured_to_pay(dtype: torch.dtype, threads: int) -> bool:
    """`packing_pays`, timed now."""
    t0 = time.perf_counter()
    weights = calibration_weights(dtype)
    packed = [packed_copy(w) for w in weights]
    timings = {}
    for rows in PACK_CALIBRATION_ROWS:
        x = torch.randn(rows, CALIBRATION_SHAPE[1], generator=torch.Generator().manual_seed(2)).to(dtype)
        timings[rows] = best_of(
            lambda i: linear(None, x, weights[i], None, packed[i]),
            lambda i: F.linear(x, weights[i]), copies_for(rows))
    (decode_packed, decode_plain), (prefill_packed, prefill_plain) = (timings[r] for r in PACK_CALIBRATION_ROWS)
    ratios = (decode_packed / decode_plain, prefill_packed / prefill_plain)
    pays = max(ratios) <= PACK_SLACK and ratios[0] * ratios[1] < 1
    per_call = {rows: (a / copies_for(rows), b / copies_for(rows)) for rows, (a, b) in timings.items()}
    log.info("packed %s weights on %d threads: %s (us a call packed/plain: %s; calibrated in %.0f ms)",
             str(dtype).removeprefix("torch."), threads, "on" if pays else "off",
             ", ".join(f"{rows} rows {a * 1e6:.0f}/{b * 1e6:.0f}" for rows, (a, b) in per_call.items()),
             (time.perf_counter() - t0) * 1e3)
    return pays


@functools.cache
def row_limit(dtype: torch.dtype, threads: int) -> int:
    """The most token rows the kernel takes in `dtype` with `threads` torch
    threads (the current count, which the measurement runs at) on this host:
    LORAGW_CPU_LINEAR_MAX_ROWS when set, else measured against F.linear."""
    kernel = load_kernel()
    if kernel is None or dtype not in (torch.float32, torch.bfloat16):
        return env_row_limit() or 0

    @functools.cache
    def inputs():  # made when measured: a kept limit spares building them
        weights = calibration_weights(dtype)
        return weights, [pack(w) for w in weights]  # packed: the torch path the larger calls take

    return calibrated_limit("CPU linear kernel", dtype, threads,
                            lambda x, out, i: kernel.skinny_linear(x, inputs()[0][i], None, out),
                            lambda x, i: linear(None, x, inputs()[0][i], None, inputs()[1][i]),
                            paths={"packed": packing_pays(dtype, threads)})


def can_pack(dtype: torch.dtype) -> bool:
    """Whether weights of `dtype` can be packed here: one of PACKED_DTYPES,
    a torch with oneDNN and its two private ops (a torch other than the one
    we pin may lack them), and a CPU whose instructions oneDNN's reorder
    takes for that dtype (for bfloat16 it refuses an AVX2-only x86 CPU: it
    wants AVX-512 or AVX-NE-CONVERT)."""
    if dtype not in PACKED_DTYPES or not packing_ops_available():
        return False
    try:
        packed_copy(torch.zeros(16, 16, dtype=dtype))
    except RuntimeError as exc:
        log.info("%s weights are not packed: %s", str(dtype).removeprefix("torch."), exc)
        return False
    return True


def packing_ops_available() -> bool:
    if not torch.backends.mkldnn.is_available():
        return False
    found = all(hasattr(torch.ops.mkldnn, op) for op in ("_reorder_linear_weight", "_linear_pointwise"))
    if not found:
        log.warning("this torch lacks oneDNN's packed linear ops: weights are not packed")
    return found


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


def calibrated_limit(what: str, dtype: torch.dtype, threads: int, run_kernel, run_torch, *,
                     shape: tuple[int, int] = CALIBRATION_SHAPE, copies=copies_for,
                     rows: tuple[int, ...] = CALIBRATION_ROWS, paths: dict | None = None) -> int:
    """LORAGW_CPU_LINEAR_MAX_ROWS when set, else the crossover of
    `run_kernel(x, out)` against `run_torch(x)` on weights of `shape`, as
    this host kept it (calibration_cache.py) or measured now, and logged;
    `measure` says what `copies` and `rows` are. `paths` tells the cache
    what else decides the two paths' times besides `what` (the kernel and
    the options in its label): whether the torch side multiplies by packed
    copies, the float kernel's own limit where that side calls it."""
    env = env_row_limit()
    if env is not None:
        return env
    t0 = time.perf_counter()

    def facts() -> dict:
        return {"limit": what, "dtype": str(dtype), "threads": threads, "shape": list(shape), "rows": list(rows),
                "copies": [copies(r) for r in rows], "paths": paths or {}}

    found = calibration_cache.remembered(
        facts, int, lambda: crossover(measure(run_kernel, run_torch, dtype, shape, copies, rows)))
    log.info("%s: up to %d rows in %s on %d threads (%s)", what, found.value,
             str(dtype).removeprefix("torch."), threads, found.origin(t0))
    return found.value


def measure(run_kernel, run_torch, dtype: torch.dtype, shape: tuple[int, int] = CALIBRATION_SHAPE,
            copies=copies_for, rows: tuple[int, ...] = CALIBRATION_ROWS) -> dict[int, tuple[float, float]]:
    """rows -> (kernel, torch) seconds, each the best of CALIBRATION_REPEATS
    interleaved runs (the best is the least disturbed by other processes),
    up to the first row count where torch wins: past it the kernel takes
    nothing, and on a host where it is slow its large calls are slow too.
    `run_kernel(x, out, i)` and `run_torch(x, i)` multiply by copy i of a
    weight of `shape` (N, K), at each of `rows`; a run goes through
    `copies(rows)` of them."""
    gen = torch.Generator().manual_seed(1)
    n, k = shape
    timings = {}
    for count in rows:
        x = torch.randn(count, k, generator=gen).to(dtype)
        out = torch.empty(count, n, dtype=dtype)
        timings[count] = best_of(lambda i: run_kernel(x, out, i), lambda i: run_torch(x, i), copies(count))
        if timings[count][0] >= timings[count][1]:
            break
    return timings


def best_of(run_a, run_b, copies: int) -> tuple[float, float]:
    """The best seconds of `run_a(i)` and of `run_b(i)` over copies 0 ..
    `copies` - 1, CALIBRATION_REPEATS interleaved rounds."""
    best = [float("inf"), float("inf")]
    for _ in range(CALIBRATION_REPEATS):
        for path, run in enumerate((run_a, run_b)):
            t0 = time.perf_counter()
            for i in range(copies):
                run(i)
            best[path] = min(best[path], time.perf_counter() - t0)
    return best[0], best[1]


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
