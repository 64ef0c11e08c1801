"""How many workers a fleet should run, from its queue depth.

Pure Python, no clock of its own: the Ray pool asks once per poll with the
workers' waiting-request counts and the time. The signal is requests waiting
per worker (what KEDA reads as `loragw:num_requests_waiting` on Kubernetes),
never GPU utilisation: a saturated accelerator with an empty queue serves
everyone on time, and an idle-looking one behind a long prefill does not.
"""

from __future__ import annotations

import math
from dataclasses import dataclass


@dataclass(frozen=True)
class ScalingPolicy:
    min_workers: int = 1
    max_workers: int = 1
    # Scale up when more requests than this wait per worker.
    target_waiting_per_worker: float = 4.0
    # Scale down by one when nothing has waited for this long.
    scale_down_after_s: float = 60.0
    # No decision within this long after the previous one: a new worker
    # needs time to load before its effect shows in the queue.
    cooldown_s: float = 30.0

    def __post_init__(self):
        if not 0 <= self.min_workers <= self.max_workers or self.max_workers < 1:
            raise ValueError(f"need 0 <= min_workers <= max_workers and max_workers >= 1, "
                             f"got {self.min_workers} and {self.max_workers}")
        if self.target_waiting_per_worker <= 0:
            raise ValueError("target_waiting_per_worker must be positive")


class QueueDepthScaler:
    def __init__(self, policy: ScalingPolicy):
        self.policy = policy
        self._last_change: float | None = None
        self._quiet_since: float | None = None

    def desired(self, current: int, waiting: list[int], now: float) -> int:
        """The worker count to run. `current`: workers that exist (starting
        ones included); `waiting`: the waiting requests of each live worker."""
        p = self.policy
        bounded = min(max(current, p.min_workers), p.max_workers)
        if bounded != current:
            return self._changed(bounded, now)
        total = sum(waiting)
        self._quiet_since = (self._quiet_since if self._quiet_since is not None else now) if total == 0 else None
        if self._last_change is not None and now - self._last_change < p.cooldown_s:
            return current
        if total > p.target_waiting_per_worker * max(current, 1):
            wanted = min(p.max_workers, max(math.ceil(total / p.target_waiting_per_worker), current + 1))
            return self._changed(wanted, now) if wanted != current else current
        if (current > p.min_workers and self._quiet_since is not None
                and now - self._quiet_since >= p.scale_down_after_s):
            self._quiet_since = now
            return self._changed(current - 1, now)
        return current

    def _changed(self, count: int, now: float) -> int:
        self._last_change = now
        return count

    def note_change(self, now: float) -> None:
        """A change made outside `desired` (a worker Ray could not place)
        starts the cooldown too."""
        self._last_change = now
