"""What the host CPU does natively, and how the engine's threads share it:
the defaults that depend on the host. And how busy its CPUs are, from
/proc: a kernel calibration is kept only if it was timed while other
processes left the cores alone (engine/model/calibration_cache.py), and
the benchmarks report the load beside every figure (benchmarks/machine.py).

`--dtype auto` picks bfloat16 on a CPU only where bfloat16 arithmetic is in
the instruction set (AVX512-BF16 or AMX on x86, the BF16 extension on Arm),
as vLLM's CPU backend does. Elsewhere bfloat16 still halves the bytes read
per step, but every multiply first widens it in software, and the exactness
of float32 is worth more than that. Where the flags cannot be read (no
/proc/cpuinfo: macOS, Windows) auto stays float32. LORAGW_CPU_BFLOAT16=0 makes a host count
as one without it: the test suite sets it, so that its exactness tests run
in float32 on every host.
"""

from __future__ import annotations

import logging
import os
from pathlib import Path

log = logging.getLogger(__name__)

ENV_SWITCH = "LORAGW_CPU_BFLOAT16"
# Idle OpenMP threads spin between parallel regions rather than sleep. A
# step runs hundreds of small parallel regions, and waking sleeping threads
# for each cost more than the gateway's share of the cores: through HTTP on
# 2 cores (benchmarks/serve_peer.py), 2 spinning threads served 46.5 and
# 68.3 tok/s at concurrency 16 and 64, 2 sleeping threads 28.6 and 49.8, one
# thread 39.7 and 57.7 (docs/engine.md, "Defaults and the host"). On a host
# shared with other busy processes a spinning thread that loses its core
# stalls every region at the barrier: set OMP_WAIT_POLICY=PASSIVE there (the
# test suite does). libgomp reads it once, when torch loads.
OMP_WAIT_POLICY = "ACTIVE"
# Beside a GPU the engine's tensors live on the device, and what the host
# computes (token ids, block tables, a grammar's mask) is small enough for
# one thread. A pool of one per core would, once any op woke it, spin on
# every core for nothing: through HTTP on a 16-core H100 host, `loragw serve`
# kept 15.7 cores busy at concurrency 16 and 64 (docs/benchmarks.md, "On a
# GPU"). vLLM's GPU workers likewise default to one OpenMP thread.
GPU_HOST_THREADS = 1
# A local CPU worker runs this much nicer than the gateway that started it.
# Its spinning threads keep every core runnable, so on equal terms the
# gateway's event loop, which admits each request and streams each token,
# waited its turn behind them; the loop's work is the same either way, only
# done sooner. On 2 Zen 5 cores under benchmarks/tiers.py's 3x standard
# overload, premium first tokens came 5-8% sooner at the median and 4-11% at
# p90 (three series, two of them reniced from outside), and completed
# requests did not change (docs/benchmarks.md, "Zen 5, a worker nicer than
# its gateway"). Beside a GPU the worker keeps one host thread
# (GPU_HOST_THREADS), competes with no one, and is left as it is.
WORKER_NICENESS = 5
# /proc/cpuinfo's names: x86 "flags", Arm "Features".
NATIVE_BFLOAT16_FLAGS = frozenset({"avx512_bf16", "amx_bf16", "bf16"})


def cpu_fields(cpuinfo: Path = Path("/proc/cpuinfo")) -> dict[str, str]:
    """/proc/cpuinfo's fields by lower-case name, each as the first processor
    gives it ("vendor_id", "cpu family", "flags"); empty where the file is
    absent."""
    try:
        text = cpuinfo.read_text(encoding="ascii", errors="replace")
    except OSError:
        return {}
    fields: dict[str, str] = {}
    for line in text.splitlines():
        key, sep, value = line.partition(":")
        if sep:
            fields.setdefault(key.strip().lower(), value.strip())
        elif fields and not line.strip():  # the blank line that ends the first processor's block
            break
    return fields


def cpu_flags(cpuinfo: Path = Path("/proc/cpuinfo")) -> frozenset[str]:
    """The first processor's feature flags; empty where /proc/cpuinfo is absent."""
    fields = cpu_fields(cpuinfo)
    return frozenset(fields.get("flags", fields.get("features", "")).split())


def has_native_bfloat16(flags: frozenset[str] | None = None, environ=os.environ) -> bool:
    if environ.get(ENV_SWITCH, "1") == "0":
        return False
    if flags is None:
        flags = cpu_flags()
    return bool(flags & NATIVE_BFLOAT16_FLAGS)


def default_thread_wait_policy(environ=os.environ) -> None:
    """Set OMP_WAIT_POLICY unless the operator has: call it before torch is
    imported (the `loragw` and worker entry points do); child processes
    inherit it."""
    environ.setdefault("OMP_WAIT_POLICY", OMP_WAIT_POLICY)


def engine_threads(requested: int | None, device_type: str) -> int | None:
    """The engine's torch intra-op threads: `requested` where the operator
    gave it; else None (torch's default, one per core) on the CPU and
    GPU_HOST_THREADS beside a GPU."""
    if requested:
        return requested
    return None if device_type == "cpu" else GPU_HOST_THREADS


def lower_priority(niceness: int, tasks: Path = Path("/proc/self/task")) -> None:
    """Add `niceness` to every thread of this process. Linux keeps a
    niceness per thread and a new thread inherits its creator's, so the
    threads started later (torch's pool, the engine's) follow the caller's.
    Where /proc is absent, os.nice (the calling thread, or the process).
    A priority that cannot be changed is logged, never raised: the worker
    serves either way."""
    if niceness <= 0:
        return
    try:
        tids = [int(t.name) for t in tasks.iterdir()]
    except OSError:
        try:
            os.nice(niceness)
        except (AttributeError, OSError) as exc:  # no os.nice on Windows
            log.warning("could not lower the worker's priority: %s", exc)
        return
    for tid in tids:
        try:
            os.setpriority(os.PRIO_PROCESS, tid, min(19, os.getpriority(os.PRIO_PROCESS, tid) + niceness))
        except ProcessLookupError:  # a thread that ended meanwhile
            pass
        except OSError as exc:  # a sandbox that forbids it
            log.warning("could not lower the priority of the worker's thread %d: %s", tid, exc)


def busy_ticks(stat: Path = Path("/proc/stat")) -> int | None:
    """Every CPU's busy ticks since boot (of os.sysconf("SC_CLK_TCK") a
    second): user, nice, system, irq, softirq, and steal, which a
    hypervisor gave to other guests. None where /proc is absent."""
    try:
        with open(stat) as f:
            user, nice, system, _idle, _iowait, irq, softirq, steal = (int(v) for v in f.readline().split()[1:9])
    except (OSError, ValueError):
        return None
    return user + nice + system + irq + softirq + steal


def own_ticks(stat: Path = Path("/proc/self/stat")) -> int | None:
    """This process's user and system ticks, all its threads. None where
    /proc is absent."""
    try:
        with open(stat) as f:
            fields = f.read().rsplit(")", 1)[1].split()  # past the command name, which may hold spaces
        return int(fields[11]) + int(fields[12])  # utime and stime, the stat's 14th and 15th fields
    except (OSError, ValueError, IndexError):
        return None
