"""Facts about the machine a benchmark ran on, and how busy it was.

The benchmark hosts are small and shared, so every figure goes out with the
load it was taken under. `CpuMeter` splits the machine's busy CPU time over
an interval into this process's share and everyone else's: "others 0.9
cores" next to a figure says it was taken with one core mostly taken.
"""

from __future__ import annotations

import os
import platform
import time
from dataclasses import dataclass

import torch

from engine import host_cpu


def machine_facts() -> dict:
    return {
        "cpu": _cpu_model(),
        "cpu_count": os.cpu_count(),
        "torch": torch.__version__,
        "torch_threads": torch.get_num_threads(),
        "omp_wait_policy": os.environ.get("OMP_WAIT_POLICY"),
        "python": platform.python_version(),
        "platform": platform.platform(),
    }


def load_average() -> list[float]:
    return [round(x, 2) for x in os.getloadavg()]


def _cpu_model() -> str:
    return host_cpu.cpu_fields().get("model name") or platform.processor() or "unknown"


def _busy_cpu_seconds() -> float | None:
    """Non-idle CPU seconds of the whole machine since boot (Linux only)."""
    ticks = host_cpu.busy_ticks()
    return None if ticks is None else ticks / os.sysconf("SC_CLK_TCK")


def _own_cpu_seconds() -> float:
    t = os.times()
    return t.user + t.system


@dataclass
class CpuMeter:
    """CPU use over an interval: `CpuMeter.start()`, then `.stop()`."""

    wall0: float
    busy0: float | None
    own0: float

    @classmethod
    def start(cls) -> CpuMeter:
        return cls(time.perf_counter(), _busy_cpu_seconds(), _own_cpu_seconds())

    def stop(self) -> dict:
        wall = time.perf_counter() - self.wall0
        own = _own_cpu_seconds() - self.own0
        busy = _busy_cpu_seconds()
        out = {"wall_s": round(wall, 2), "own_cpu_s": round(own, 2),
               "own_cores": round(own / wall, 2) if wall else None}
        if busy is not None and self.busy0 is not None and wall > 0:
            # Clamped: the two clocks tick at different granularities.
            out["other_cores"] = round(max(0.0, (busy - self.busy0 - own) / wall), 2)
        return out


def write_json(result: dict, path, *, indent: int = 2) -> None:
    """Write a benchmark's result, creating its folder; print where it went."""
    import json
    from pathlib import Path

    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(result, indent=indent))
    print(f"wrote {path}")
