"""The niceness of a process's threads, as the kernel accounts it: the
independent reference for the tests of engine/host_cpu.py's lower_priority."""

from __future__ import annotations

from pathlib import Path


def niceness_of_threads(pid: int | str = "self") -> dict[int, int]:
    """Thread id -> niceness: field 19 of each thread's stat, counted after
    the command name, which may hold spaces, in parentheses."""
    out = {}
    for task in Path(f"/proc/{pid}/task").iterdir():
        out[int(task.name)] = int((task / "stat").read_text().rpartition(")")[2].split()[16])
    return out
