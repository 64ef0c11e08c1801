"""engine/heap.py: what is alive when startup ends leaves the collector's
passes for good; garbage of the startup, and everything made afterwards,
is still collected.

Each check runs in a fresh interpreter: freezing the test process's own
heap would keep whatever the other tests leave behind alive."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]

SCRIPT = """
import gc, json, weakref
from engine.heap import freeze_startup_heap

class Node:
    pass

def cycle():
    node = Node()
    node.self = node  # only the collector frees a cycle
    return weakref.ref(node)

kept = [Node() for _ in range(1000)]
startup_garbage = cycle()
frozen = freeze_startup_heap()
tracked = {id(o) for o in gc.get_objects()}
later_garbage = cycle()
later_kept = Node()
gc.collect()
print(json.dumps({
    "frozen": frozen,
    "kept_tracked": sum(id(n) in tracked for n in kept),
    "tracked_after_freeze": len(tracked),
    "startup_garbage_freed": startup_garbage() is None,
    "later_garbage_freed": later_garbage() is None,
    "later_kept_tracked": any(o is later_kept for o in gc.get_objects()),
}))
"""


def test_startup_objects_leave_the_passes_and_later_garbage_is_still_collected():
    done = subprocess.run([sys.executable, "-c", SCRIPT], cwd=ROOT, capture_output=True, text=True, timeout=60,
                          check=True)
    result = json.loads(done.stdout)
    assert result["frozen"] >= 1000
    assert result["kept_tracked"] == 0, "a frozen object is still walked by every full pass"
    assert result["tracked_after_freeze"] < 100
    assert result["startup_garbage_freed"], "garbage of the startup was frozen instead of freed"
    assert result["later_garbage_freed"], "a cycle made after the freeze was not collected"
    assert result["later_kept_tracked"]
