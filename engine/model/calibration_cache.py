"""Kernel calibrations kept from one process to the next on a host.

cpu_linear.py and quant_limits.py choose between a C++ kernel and oneDNN by
timing both when the model is built: a row limit per kernel, and whether
oneDNN's packed weights pay. Where the two paths run close, noise decides:
on a 2-core Zen 4 in bfloat16, six starts of `loragw serve` put the Q4_1
limit at 32, 32, 128, 64, 32 and 128 rows. The paths sum in different
orders, so a greedy request of a few dozen prompt tokens could decode
differently after a restart, or on two engine workers of one host.

So the first measurement on a host is kept, one small JSON file an entry
in `<cache root>/calibration/` (engine/cache_dir.py), and later processes
read it instead of timing again. An entry is keyed by what was measured
(the caller's facts: the kernel and its options, dtype, threads, shape,
rows, what the torch side runs) and by what can change the answer: the
compiled kernels themselves, the Python that times and decides, torch's
version and the instructions it may use, the CPU model and the cores this
process may use, and the OpenMP wait policy. When any of them changes, the
next process measures again.

A process measures an entry while holding a lock of that entry's own (an
flock, released if the process dies): workers that start together would
otherwise time against each other on the same cores and keep a figure
taken under that load. The others wait, then read what it kept, so the
processes of a host agree (for a minute at most: LOCK_WAIT_S). The rest of
a worker's loading is not under the lock and may still overlap a sibling's
timing; a calibration's own weights are made only when it is measured. And
a measurement during which other processes kept the CPU busy is used but
not kept (QUIET_OTHERS_CORES): the next process times it again.

An entry timed while the host was busy stays until one of its inputs
changes: delete the folder to time again, or set
LORAGW_CPU_CALIBRATION_CACHE=0 to time in every process, as the test suite
does. The cache never stops a model from loading: a folder it cannot read
or write is logged, and the measured value used.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import json
import logging
import os
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import NamedTuple

import torch

import native
from engine import host_cpu
from engine.cache_dir import cache_root

log = logging.getLogger(__name__)

ENV_SWITCH = "LORAGW_CPU_CALIBRATION_CACHE"
# Bumped when an entry's meaning changes in a way that its inputs do not show.
FORMAT = 1
_MODEL = Path(__file__).parent
# A change to the timing loops, their constants or the rules that read the
# timings can move an answer as much as a new kernel can; so can native's,
# which decide when a kernel call stays on the calling thread.
DECIDING_CODE = (_MODEL / "cpu_linear.py", _MODEL / "quant_linear.py", _MODEL / "quant_limits.py",
                 Path(__file__), Path(native.__file__))
# Other users of a shared cache folder may read an entry (mkstemp makes it 0600).
ENTRY_MODE = 0o644
# A measurement takes a second or less; a holder that keeps the lock far
# longer is stuck (stopped, or on a filesystem whose locks never free), and
# a model load must not wait on it.
LOCK_WAIT_S = 60.0


# A measurement is kept only if the rest of the host stayed this quiet while
# it ran (the CPU other processes used, in cores on average): beside the
# test suite on 2 cores, packing came out off and the head's limit at 4 to
# 256 rows, where idle starts had packing on and 8, and a kept figure
# outlives the neighbour that skewed it.
QUIET_OTHERS_CORES = 0.5
# /proc/stat counts in ticks of 10 ms: over a window this long, what others
# used reads to within about a tenth of a core on 2 cores.
MIN_WINDOW_S = 0.25


class Sample(NamedTuple):
    seconds: float  # time.monotonic()
    host_busy_ticks: int | None  # every CPU's busy time, /proc/stat
    own_ticks: int | None  # this process's CPU time, /proc/self/stat


class Calibration(NamedTuple):
    value: int | bool
    kept_in: Path | None  # the entry read, kept by an earlier process; None: measured here

    def origin(self, started: float) -> str:
        """How it was had, for a log line; `started` is the perf_counter
        reading taken before asking for it."""
        if self.kept_in is not None:
            return f"as measured on this host before, kept in {self.kept_in}"
        return f"calibrated in {(time.perf_counter() - started) * 1e3:.0f} ms"


def remembered(facts: Callable[[], dict], kind: type, measure: Callable[[], int | bool]) -> Calibration:
    """This host's kept calibration for `facts()` (JSON-able: what is
    measured, and how), of type `kind` (int, a row count, or bool), else
    `measure()`'s value, kept for later processes. With the cache switched
    off, `measure()` alone: `facts` is not called. Only `measure()` may
    raise: a fault of the cache's own is logged, and measuring goes on."""
    if os.environ.get(ENV_SWITCH, "1") == "0":
        return Calibration(measure(), None)
    try:
        described = facts()
        key = digest(described)
        path = folder() / f"{key[:32]}.json"
    except Exception as exc:  # noqa: BLE001 - e.g. a kernel build gone from under us: nothing to key by
        log.warning("kernel calibrations are not kept: %s", exc)
        return Calibration(measure(), None)
    with locked(path, LOCK_WAIT_S) as usable:
        kept = read(path, key, kind) if usable else None
        if kept is not None:
            return Calibration(kept, path)
        value, others = timed_quietly(measure) if usable else (measure(), None)
        if usable and others is not None and others >= QUIET_OTHERS_CORES:
            log.info("not keeping the calibration for %s: other processes used %.1f cores while it was timed, "
                     "so the next process measures again", path, others)
        elif usable:
            keep(path, {"format": FORMAT, "key": key, "facts": described, "value": value, "others_cores": others,
                        "measured_at": time.strftime("%Y-%m-%dT%H:%M:%S%z")})
    return Calibration(value, None)


def timed_quietly(measure: Callable[[], int | bool]) -> tuple[int | bool, float | None]:
    """`measure()`'s value, and the cores that other processes used on
    average while it ran, over MIN_WINDOW_S at least (None where the host
    does not say: no /proc)."""
    start = sample()
    value = measure()
    time.sleep(max(0.0, MIN_WINDOW_S - (time.monotonic() - start.seconds)))
    return value, others_cores(start, sample(), os.sysconf("SC_CLK_TCK"))


def sample() -> Sample:
    return Sample(time.monotonic(), host_cpu.busy_ticks(), host_cpu.own_ticks())


def others_cores(start: Sample, end: Sample, ticks_per_s: int) -> float | None:
    """The CPU other processes used between two samples, in cores on average."""
    if None in (start.host_busy_ticks, start.own_ticks, end.host_busy_ticks, end.own_ticks):
        return None
    others = (end.host_busy_ticks - start.host_busy_ticks) - (end.own_ticks - start.own_ticks)
    return max(0.0, others / ticks_per_s / max(end.seconds - start.seconds, 1e-9))


def folder() -> Path:
    return cache_root() / "calibration"


def kernel_files() -> list[str | None]:
    """The compiled kernels that calibrations time (None: not built here).
    Their bytes stand for everything a build depends on: the sources, the
    shared headers, the flags, the compiler, the instructions of the CPU it
    was built for."""
    from engine.model import cpu_linear, quant_linear  # both import this module

    return [getattr(kernel, "__file__", None) for kernel in (cpu_linear.load_kernel(), quant_linear.load_kernel())]


def digest(facts: dict) -> str:
    """The entry's key: `facts` and the inputs that can change a calibration.
    The CPU's model and the cores this process may run on are in it too:
    two CPUs of one generation build the same kernel bytes, and a cache
    folder can be shared between machines (a home on NFS, a volume)."""
    inputs = {
        "format": FORMAT,
        "facts": facts,
        "kernels": [file_digest(Path(path)) if path else None for path in kernel_files()],
        "code": [file_digest(path) for path in DECIDING_CODE],
        "torch": torch.__version__,
        "cpu_capability": torch.backends.cpu.get_cpu_capability(),
        "cpu": native.cpu_fingerprint(),
        "cores": len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count(),  # macOS
        "omp_wait_policy": os.environ.get("OMP_WAIT_POLICY", "").strip().upper(),
    }
    return hashlib.sha256(json.dumps(inputs, sort_keys=True).encode()).hexdigest()


def file_digest(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


@contextlib.contextmanager
def locked(path: Path, wait_s: float) -> Iterator[bool]:
    """Holds `path`'s own lock against other processes for up to `wait_s`
    of waiting, and yields whether the folder can be used at all. One lock
    per entry, and no caller holds one while it asks for another: the float
    kernel's limit, which a quantized limit is timed against, is had before
    that limit's lock is taken (quant_limits.float_paths), so no two
    processes can each hold what the other waits for. A lock not had in
    time is logged, and the caller measures without it."""
    handle, usable = None, True
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        handle = open(path.with_suffix(".lock"), "a")  # noqa: SIM115 - held across the yield
    except OSError as exc:
        log.warning("calibrations cannot be kept in %s (%s): measuring here", path.parent, exc)
        usable = False
    if handle is not None:
        deadline = time.monotonic() + wait_s
        while True:
            try:
                fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                if time.monotonic() >= deadline:
                    log.warning("the calibration entry %s has been locked for %.0f s: measuring without the lock",
                                path, wait_s)
                    break
                time.sleep(0.05)
            except OSError as exc:  # a filesystem without locks
                log.warning("could not lock the calibration entry %s (%s): measuring without it", path, exc)
                break
    try:
        yield usable
    finally:
        if handle is not None:
            handle.close()  # and with it the lock


def read(path: Path, key: str, kind: type) -> int | bool | None:
    """The entry's value, or None where there is none that can be trusted
    (absent, unreadable, another key, a value that is no `kind`)."""
    try:
        entry = json.loads(path.read_text())
    except FileNotFoundError:
        return None
    except Exception as exc:  # noqa: BLE001 - whatever is there, it is not an entry to trust
        log.warning("ignoring the calibration entry %s: %s", path, exc)
        return None
    value = entry.get("value") if isinstance(entry, dict) else None
    # bool is an int: an int entry must not be a bool, nor a bool entry an int.
    if not isinstance(entry, dict) or entry.get("key") != key or type(value) is not kind or value < 0:
        log.warning("ignoring the calibration entry %s: not one of ours for this measurement", path)
        return None
    return value


def keep(path: Path, entry: dict) -> None:
    """Writes `entry` at `path` whole (a partial file renamed over it), or
    logs why it could not."""
    partial = None
    try:
        fd, partial = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.")
        with os.fdopen(fd, "w") as handle:
            json.dump(entry, handle, sort_keys=True)
        os.chmod(partial, ENTRY_MODE)
        os.replace(partial, path)
        partial = None
    except Exception as exc:  # noqa: BLE001 - the value is measured; only keeping it failed
        log.warning("could not keep a calibration in %s (%s): later processes will measure again", path, exc)
    finally:
        if partial is not None:
            with contextlib.suppress(OSError):
                os.unlink(partial)
