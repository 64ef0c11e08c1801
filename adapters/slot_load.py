"""The record of one slot load, as a step's usage reports it.

Plain values, no torch: the slot manager makes one for each adapter it
copies into a device slot, the engine carries them in its `RunnerOutput` and
`StepUsage` (engine/step_io.py), and the billing meter charges each load to
its adapter's owner.
"""

from __future__ import annotations

from dataclasses import dataclass

# A LoRA adapter's registry key: (name, version, content digest). The engine
# treats it as opaque; the worker protocol (engine/wire.py) carries it as this.
AdapterKey = tuple[str, int, str]


@dataclass(frozen=True)
class AdapterLoad:
    """One adapter copied into a device slot during a step, and how long it took."""

    adapter_key: AdapterKey
    load_us: int
