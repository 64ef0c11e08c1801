"""The collector's full passes in the long-running processes.

CPython's oldest-generation collection walks every object the collector
tracks. A gateway or a worker holds most of its objects from startup on
(300,000 to 430,000: the modules of torch, transformers and SQLAlchemy,
the model, the app), and every full pass walked all of them: 90 to 225 ms
on two Zen 5 cores, logged during `benchmarks/tiers.py`
(docs/benchmarks.md), each a stall of every stream in the process. What
is alive when startup ends lives until the process ends, so it moves to
the permanent generation, which no pass walks (vLLM's API server does the
same). Objects made afterwards are collected as before.

Only process entry points call this: frozen objects are never freed, so a
library or a test process must not leave its heap frozen (a test that
stands in for a served process unfreezes it when it ends:
tests/gateway/workers/test_health_under_load.py).
"""

from __future__ import annotations

import gc


def freeze_startup_heap() -> int:
    """Collect the startup's garbage, then freeze what is left; the number frozen."""
    gc.collect()
    gc.freeze()
    return gc.get_freeze_count()
