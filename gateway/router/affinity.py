"""The affinity policy: send a request where its adapter, its prefix and room
for it already are, unless that worker is much busier than another.

In the spirit of the Kubernetes Gateway API Inference Extension's scorers
(LoRA affinity, prefix cache, queue), but where those normalize each score
to [0, 1] and add them with weights, every term here is counted in one
unit, *queued requests*, so that "how many queued requests is a resident
adapter worth" is a number a reader can judge. Workers are sorted by this
key, most significant first:

1. KV room. A worker whose free blocks for the request's tier
   (`kv_free_blocks_for`: standard may not use the premium reserve) hold
   the whole prompt comes before any that do not: there the request would
   wait for blocks to free, or, if premium, preempt someone, whatever else
   that worker offers.
2. Cost = queue + adapter cost - prefix credit, lower first.
   - queue: the worker's waiting requests (for a premium request, only
     the premium ones: the scheduler serves premium first and preempts
     standard work for it), plus the requests dispatched to it that its
     snapshot (a step behind) does not show yet.
   - adapter cost (0 for the base model): 0 if the adapter is resident in
     a slot. Otherwise a load, `load_from_host` (1) if its weights are on
     the host, `load_from_disk` (2) if not, plus `slot_eviction` (2) when
     every slot is taken: then the request waits until a running adapter
     drains (engine/adapter_slots.py), and the adapter evicted will want a
     load of its own. So resident (0) < free slot (1-2) < on the host (3)
     < a load from disk (4).
   - prefix credit: `full_prefix_hit` (3) times the share of the prompt's
     full blocks that the router last sent to this worker (its
     PrefixMemory), so a longer match counts for more.
   The adapter and prefix terms are bounded (4 and 3), and that bound is
   the cap: affinity can draw a request to a worker at most 7 queued
   requests busier than the idlest one, never further. A resident adapter
   is worth a few queued requests, not an overloaded worker.
3. Requests in flight, fewer first: between equal costs, the worker with
   less outstanding work (running requests included).
4. Worker id, so that equal workers always rank the same way.

A worker with no snapshot yet is taken as just started: room for anything,
no adapter in its slots, a free slot, and a queue of its in-flight requests.
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Sequence
from dataclasses import dataclass

from engine.request import Tier
from engine.snapshot import EngineSnapshot
from gateway.router.base import (AdapterKey, Ranking, RouteRequest, RoutingPolicy, WorkerView,
                                 candidates)
from gateway.router.prefix_memory import PrefixMemory, block_hashes


@dataclass(frozen=True)
class AffinityWeights:
    """The cost terms, in queued requests (see the module docstring)."""

    load_from_host: float = 1.0
    load_from_disk: float = 2.0
    slot_eviction: float = 2.0
    full_prefix_hit: float = 3.0


def queue_depth(worker: WorkerView, tier: Tier = Tier.STANDARD) -> int:
    """Requests that would run before one of `tier`: the snapshot's waiting
    (for premium, only premium: the scheduler serves it before any standard
    request, preempting standard work if it must), plus the dispatched
    requests it has not shown yet."""
    snap = worker.snapshot
    if snap is None:
        return worker.in_flight
    unseen = max(0, worker.in_flight - snap.num_requests)
    if tier is Tier.PREMIUM:
        return snap.num_waiting.get(Tier.PREMIUM, 0) + unseen
    return sum(snap.num_waiting.values()) + unseen


def adapter_cost(adapter: AdapterKey | None, snap: EngineSnapshot | None, weights: AffinityWeights) -> float:
    if adapter is None:
        return 0.0
    resident = snap.resident_adapters if snap is not None else ()
    if adapter in resident:
        return 0.0
    on_host = snap is not None and adapter in snap.host_adapters
    cost = weights.load_from_host if on_host else weights.load_from_disk
    free_slot = snap is None or len(resident) < snap.num_lora_slots
    return cost if free_slot else cost + weights.slot_eviction


def has_room(request: RouteRequest, snap: EngineSnapshot | None) -> bool:
    """The tier's free KV blocks hold the whole prompt now."""
    if snap is None:
        return True
    needed = -(-len(request.prompt_ids) // snap.block_size)
    return snap.kv_free_blocks_for(request.tier) >= needed


class AffinityRouter(RoutingPolicy):
    name = "affinity"

    def __init__(self, clock: Callable[[], float], *, weights: AffinityWeights = AffinityWeights(),
                 prefix_memory_entries: int = 65536, prefix_ttl_s: float | None = None,
                 default_block_size: int = 16):
        self.weights = weights
        self.prefix_memory = PrefixMemory(clock, max_entries=prefix_memory_entries, ttl_s=prefix_ttl_s)
        # The hashing granularity of a worker with no snapshot yet.
        self.default_block_size = default_block_size

    def rank(self, request: RouteRequest, workers: Sequence[WorkerView], *,
             exclude: Collection[str] = ()) -> Ranking:
        alive = candidates(workers, exclude)
        # Hashes and matches per block size: one in a fleet started from one config.
        matches: dict[int, tuple[int, dict[str, int]]] = {}

        def key(worker: WorkerView) -> tuple[bool, float, int, str]:
            block_size = self._block_size(worker)
            if block_size not in matches:
                hashes = self._hashes(request, block_size)
                matches[block_size] = (len(hashes), self.prefix_memory.match(hashes))
            num_blocks, matched = matches[block_size]
            credit = self.weights.full_prefix_hit * matched.get(worker.worker_id, 0) / num_blocks if num_blocks else 0.0
            cost = (queue_depth(worker, request.tier) + adapter_cost(request.adapter, worker.snapshot, self.weights)
                    - credit)
            return (not has_room(request, worker.snapshot), cost, worker.in_flight, worker.worker_id)

        return Ranking(tuple(w.worker_id for w in sorted(alive, key=key)))

    def record(self, request: RouteRequest, worker: WorkerView) -> None:
        self.prefix_memory.record(self._hashes(request, self._block_size(worker)), worker.worker_id)

    def forget_worker(self, worker_id: str) -> None:
        self.prefix_memory.forget_worker(worker_id)

    def _block_size(self, worker: WorkerView) -> int:
        return worker.snapshot.block_size if worker.snapshot is not None else self.default_block_size

    @staticmethod
    def _hashes(request: RouteRequest, block_size: int) -> list[int]:
        scope = (request.tenant_id, request.cache_salt, request.adapter)
        return block_hashes(scope, request.prompt_ids, block_size)
