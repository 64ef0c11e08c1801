"""Which LoRA adapters may run at once: at most `max_loras` distinct ones.

Pure Python, like the scheduler that consults it. The runner owns the device
slots; this policy only guarantees it never needs more than `max_loras` of
them in one step, that a request is admitted only once its adapter's weights
are on the host (loading never blocks the step loop), and that no request
waits forever behind slot pressure:

A request blocked because every slot holds another adapter may be passed by
requests whose adapters are resident. Once it has waited `max_wait_steps`
steps it is *starving*: from then on no other adapter may be admitted (nor
more requests of resident adapters, which would keep them resident), so the
running ones drain within their remaining max_tokens and a slot frees.
Base-model requests need no slot and always pass.

Tiers. A premium request is never held back by a starving standard one,
and when every slot is taken the scheduler frees one for the premium head
by preempting the standard sequences of an adapter no premium sequence
uses (`standard_only_adapter`), as it preempts standard work for KV blocks
and seats. Without that, premium time to first token under overload is
bounded by the slowest standard adapter to drain.
"""

from __future__ import annotations

import enum
from collections import Counter
from typing import Callable, Hashable

from engine.request import Request, Tier


class SlotVerdict(enum.Enum):
    ADMIT = "admit"
    WAIT_SLOT = "wait_slot"  # every slot holds another adapter, or one is starving
    WAIT_LOAD = "wait_load"  # the adapter's weights are still loading


class AdapterSlotPolicy:
    def __init__(self, max_loras: int, max_wait_steps: int = 32,
                 is_ready: Callable[[Hashable], bool] | None = None):
        self.max_loras = max_loras
        self.max_wait_steps = max_wait_steps
        self.is_ready = is_ready or (lambda _key: True)
        self.running: Counter = Counter()  # adapter key -> running sequences
        self._blocked_since: dict[str, tuple[int, Hashable]] = {}  # request id -> (step, key)

    def verdict(self, req: Request, step: int) -> SlotVerdict:
        key = req.adapter_key
        if key is None:
            return SlotVerdict.ADMIT
        if not self.is_ready(key):
            return SlotVerdict.WAIT_LOAD
        starving = self._starving_key(step)
        if starving is not None and key != starving and req.tier is not Tier.PREMIUM:
            return SlotVerdict.WAIT_SLOT
        if self.has_slot(key):
            return SlotVerdict.ADMIT
        self._blocked_since.setdefault(req.request_id, (step, key))
        return SlotVerdict.WAIT_SLOT

    def has_slot(self, key: Hashable, taking: set = frozenset()) -> bool:
        """Whether `key` can run beside the running adapters and those in
        `taking` (about to start); unlike `verdict`, no clock starts."""
        return key in self.running or key in taking or len(taking | self.running.keys()) < self.max_loras

    def on_running(self, req: Request) -> None:
        self._blocked_since.pop(req.request_id, None)
        if req.adapter_key is not None:
            self.running[req.adapter_key] += 1

    def on_stopped_running(self, req: Request) -> None:
        """The request left the running set (finished, aborted or preempted)."""
        key = req.adapter_key
        if key is not None:
            self.running[key] -= 1
            if self.running[key] <= 0:
                del self.running[key]

    def forget(self, req: Request) -> None:
        self._blocked_since.pop(req.request_id, None)

    def _starving_key(self, step: int) -> Hashable | None:
        oldest = min(self._blocked_since.values(), default=None, key=lambda v: v[0])
        if oldest is None or step - oldest[0] < self.max_wait_steps:
            return None
        return oldest[1]


def standard_only_adapter(running: list[Request]) -> Hashable | None:
    """The adapter whose slot costs least to free for a premium request: one
    that only standard sequences use, the fewest of them; None if every
    adapter in a slot serves a premium sequence."""
    counts: Counter = Counter()
    premium: set = set()
    for req in running:
        if req.adapter_key is None:
            continue
        counts[req.adapter_key] += 1
        if req.tier is Tier.PREMIUM:
            premium.add(req.adapter_key)
    candidates = [key for key in counts if key not in premium]
    return min(candidates, key=lambda key: counts[key]) if candidates else None
