"""Kernel calibrations kept from one process to the next on a host.

cpu_linear.py and quant_linear.py choose between a C++ kernel and oneDNN by
timing both when the model is built: a row limit per kernel, and whether
oneDNN's packed weights pay. Where the two paths run close, noise decides:
on a 2-core Zen 4 in bfloat16, six starts of `loragw serve` put the Q4_1
limit at 32, 32, 128, 64, 32 and 128 rows. The paths sum in different
orders, so a greedy request of a few dozen prompt tokens could decode
differently after a restart, or on two engine workers of one host.

So the first measurement on a host is kept, one small JSON file an entry
in `<cache root>/calibration/` (engine/cache_dir.py), and later processes
read it instead of timing again. An entry is keyed by what was measured
(the caller's facts: kernel, dtype, threads, shape, rows) and by what can
change the answer: the kernels' build keys (their sources, the shared
headers, the flags, the CPU, the toolchain), the Python that times and
decides, torch's version and the OpenMP wait policy. When any of them
changes, the next process measures again. Processes that measure at once
each publish by hard link, which only the first can make: the others take
its value, so the processes of a host agree.

An entry timed under a passing load stays until one of its inputs changes:
delete the folder to time again, or set LORAGW_CPU_CALIBRATION_CACHE=0 to
time in every process, as the test suite does. The cache never stops a
model from loading: a folder it cannot read or write is logged, and the
measured value used.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import os
import time
from collections.abc import Callable
from pathlib import Path
from typing import NamedTuple

import torch

import native
from engine.cache_dir import cache_root

log = logging.getLogger(__name__)

ENV_SWITCH = "LORAGW_CPU_CALIBRATION_CACHE"
# Bumped when an entry's meaning changes in a way that its inputs do not show.
FORMAT = 1
_MODEL = Path(__file__).parent
# The Python whose timing loops, constants and rules make a calibration.
DECIDING_CODE = (_MODEL / "cpu_linear.py", _MODEL / "quant_linear.py", Path(__file__))
# The kernels that calibrations time.
KERNEL_SOURCES = (_MODEL.parent / "csrc" / "cpu_linear.cpp", _MODEL.parent / "csrc" / "quant_linear.cpp")


class Calibration(NamedTuple):
    value: int | bool
    kept_in: Path | None  # the entry it was read from; None: measured by this process

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
    off, `measure()` alone: `facts` is not called."""
    if os.environ.get(ENV_SWITCH, "1") == "0":
        return Calibration(measure(), None)
    described = facts()
    try:
        key = digest(described)
    except OSError as exc:  # an install without the kernels' sources: nothing to key an entry by
        log.warning("kernel calibrations are not kept: %s", exc)
        return Calibration(measure(), None)
    path = folder() / f"{key[:32]}.json"
    kept = read(path, key, kind)
    if kept is not None:
        return Calibration(kept, path)
    value = measure()
    entry = {"format": FORMAT, "key": key, "facts": described, "value": value,
             "measured_at": time.strftime("%Y-%m-%dT%H:%M:%S%z")}
    return publish(path, key, kind, entry)


def folder() -> Path:
    return cache_root() / "calibration"


def digest(facts: dict) -> str:
    """The entry's key: `facts` and the inputs that can change a calibration."""
    inputs = {
        "format": FORMAT,
        "facts": facts,
        "kernels": [native.cache_key(source) for source in KERNEL_SOURCES],
        "code": hashlib.sha256(b"".join(path.read_bytes() for path in DECIDING_CODE)).hexdigest(),
        "torch": torch.__version__,
        "threads_sleep": native.threads_sleep(),
    }
    return hashlib.sha256(json.dumps(inputs, sort_keys=True).encode()).hexdigest()


def read(path: Path, key: str, kind: type) -> int | bool | None:
    """The entry's value, or None where there is none that can be trusted
    (absent, unreadable, another key, a value that is no `kind`)."""
    try:
        entry = json.loads(path.read_text())
    except FileNotFoundError:
        return None
    except (OSError, ValueError) as exc:
        log.warning("ignoring the calibration entry %s: %s", path, exc)
        return None
    value = entry.get("value") if isinstance(entry, dict) else None
    # bool is an int: an int entry must not be a bool, nor a bool entry an int.
    if not isinstance(entry, dict) or entry.get("key") != key or type(value) is not kind or value < 0:
        log.warning("ignoring the calibration entry %s: not one of ours for this measurement", path)
        return None
    return value


def publish(path: Path, key: str, kind: type, entry: dict) -> Calibration:
    """Keeps `entry` at `path` unless another process kept one first, whose
    value then wins; a file there that `read` rejects is replaced."""
    partial = path.with_name(f".{path.name}.{os.getpid()}")
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        partial.write_text(json.dumps(entry, sort_keys=True))
        try:
            os.link(partial, path)
        except FileExistsError:
            first = read(path, key, kind)
            if first is not None:
                return Calibration(first, path)
            os.replace(partial, path)
    except OSError as exc:
        log.warning("could not keep a calibration in %s (%s): later processes will measure again", path, exc)
    finally:
        with contextlib.suppress(OSError):
            partial.unlink(missing_ok=True)
    return Calibration(entry["value"], None)
