"""The round-robin policy: the baseline the affinity policy is measured
against (`--routing round-robin`). It rotates over the alive workers in id
order and reads nothing else: no snapshot, no adapter, no prompt.

The rotation turns in `record`, not in `rank`, so a retry ranks from the
same place: the next alive worker after the one that failed.
"""

from __future__ import annotations

import bisect
from collections.abc import Collection, Sequence

from gateway.router.base import Ranking, RouteRequest, RoutingPolicy, WorkerView, candidates


class RoundRobinRouter(RoutingPolicy):
    name = "round-robin"

    def __init__(self) -> None:
        self._last: str | None = None  # the worker the last request went to

    def rank(self, request: RouteRequest, workers: Sequence[WorkerView], *,
             exclude: Collection[str] = ()) -> Ranking:
        ids = [w.worker_id for w in candidates(workers, exclude)]
        # Start after the last worker by id, not by position, so workers
        # joining or leaving the fleet do not skip or repeat anyone.
        start = 0 if self._last is None else bisect.bisect_right(ids, self._last) % len(ids)
        return Ranking(tuple(ids[start:] + ids[:start]))

    def record(self, request: RouteRequest, worker: WorkerView) -> None:
        self._last = worker.worker_id

    def forget_worker(self, worker_id: str) -> None:
        """Nothing to forget: the rotation is by id and skips the dead."""
