"""The router's contract: what it reads about each worker and each request,
and the ranking it answers with.

A routing policy is pure Python: no I/O, no torch, no clock of its own. The
fleet client hands it a `WorkerView` per worker (liveness is the fleet's
call; the snapshot is the worker's latest) and a `RouteRequest`, and gets
the workers ranked best first. Ranking is a question: it changes nothing.
`record` commits where a request went (the view it was sent to), so a retry
(`rank` again, the failed worker excluded or no longer alive) sees the same
state as the first try.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Collection, Sequence
from dataclasses import dataclass

from engine.request import Tier
from engine.snapshot import EngineSnapshot

# An adapter as the registry and the snapshots name it: (name, version, digest).
AdapterKey = tuple[str, int, str]


class NoWorkerAvailable(Exception):
    """No alive worker is left to take the request (all dead or excluded)."""


@dataclass(frozen=True)
class WorkerView:
    """One worker as the fleet sees it when a request arrives.

    `in_flight`: requests the gateway dispatched to it and has not seen
    finish. It is fresher than `snapshot`, which lags a step behind."""

    worker_id: str
    alive: bool
    snapshot: EngineSnapshot | None  # None until the worker's first snapshot
    in_flight: int = 0


@dataclass(frozen=True)
class RouteRequest:
    """What routing needs of a request: the prefix-cache scope (tenant,
    cache salt, adapter) and the prompt's token ids."""

    tenant_id: str
    cache_salt: str | None
    tier: Tier
    adapter: AdapterKey | None  # None: the base model
    prompt_ids: Sequence[int]


@dataclass(frozen=True)
class Ranking:
    """Alive workers, best first; never empty (no worker raises instead)."""

    workers: tuple[str, ...]

    @property
    def best(self) -> str:
        return self.workers[0]


class RoutingPolicy(ABC):
    """Contract: `rank` reads its arguments and the policy's memory and
    mutates nothing; it returns every alive worker not in `exclude`, each
    once, best first, deterministically for the same state, or raises
    `NoWorkerAvailable`. `record` is told, once per dispatch, the view of the
    worker a request went to (retries included). `forget_worker` drops what the policy remembers
    of a worker that died or left the fleet: a restarted worker has an empty
    cache. The fleet calls all three from one thread (the event loop)."""

    name: str = "abstract"

    @abstractmethod
    def rank(self, request: RouteRequest, workers: Sequence[WorkerView], *,
             exclude: Collection[str] = ()) -> Ranking: ...

    @abstractmethod
    def record(self, request: RouteRequest, worker: WorkerView) -> None: ...

    @abstractmethod
    def forget_worker(self, worker_id: str) -> None: ...


def candidates(workers: Sequence[WorkerView], exclude: Collection[str]) -> list[WorkerView]:
    """The alive workers not excluded, by id; raises if there are none."""
    alive = sorted((w for w in workers if w.alive and w.worker_id not in exclude), key=lambda w: w.worker_id)
    if not alive:
        raise NoWorkerAvailable(f"no alive worker among {len(workers)} (excluded: {sorted(exclude)})")
    return alive
