"""The router: which worker of the fleet serves a request.

Policies (one file each) share the contract in `base.py`; `make_router` is
the one place that chooses among them, by the name `--routing` gives:
"affinity" (the default: adapter residency, prefix, KV room, queue) or
"round-robin" (the baseline). Pure Python, like the scheduler: importing
this package never imports torch, and time comes from the caller's clock.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from gateway.config import ConfigError
from gateway.router.affinity import AffinityRouter, AffinityWeights
from gateway.router.base import (AdapterKey, NoWorkerAvailable, Ranking, RouteRequest, RoutingPolicy,
                                 WorkerView)
from gateway.router.prefix_memory import PrefixMemory
from gateway.router.round_robin import RoundRobinRouter

__all__ = ["ROUTING_POLICIES", "AdapterKey", "AffinityRouter", "AffinityWeights", "NoWorkerAvailable",
           "PrefixMemory", "Ranking", "RoundRobinRouter", "RouteRequest", "RoutingConfig", "RoutingPolicy",
           "WorkerView", "make_router"]


@dataclass(frozen=True)
class RoutingConfig:
    policy: str = "affinity"
    # The affinity policy's memory of where prompts went: (block, worker)
    # pairs kept, and how long one counts (None: until evicted).
    prefix_memory_entries: int = 65536
    prefix_ttl_s: float | None = None
    # Hashing granularity for a worker that has sent no snapshot yet; the
    # engine's KV block size.
    default_block_size: int = 16

    def __post_init__(self) -> None:
        if self.policy not in ROUTING_POLICIES:
            raise ConfigError(f"routing: unknown policy {self.policy!r}; choose one of {', '.join(ROUTING_POLICIES)}")
        if self.prefix_memory_entries < 1 or self.default_block_size < 1:
            raise ConfigError("routing: prefix_memory_entries and default_block_size must be >= 1")
        if self.prefix_ttl_s is not None and self.prefix_ttl_s <= 0:
            raise ConfigError("routing: prefix_ttl_s must be > 0 (or unset)")


def _affinity(config: RoutingConfig, clock: Callable[[], float]) -> RoutingPolicy:
    return AffinityRouter(clock, prefix_memory_entries=config.prefix_memory_entries,
                          prefix_ttl_s=config.prefix_ttl_s, default_block_size=config.default_block_size)


def _round_robin(config: RoutingConfig, clock: Callable[[], float]) -> RoutingPolicy:
    return RoundRobinRouter()


ROUTING_POLICIES: dict[str, Callable[[RoutingConfig, Callable[[], float]], RoutingPolicy]] = {
    AffinityRouter.name: _affinity,
    RoundRobinRouter.name: _round_robin,
}


def make_router(config: RoutingConfig, clock: Callable[[], float]) -> RoutingPolicy:
    """A fresh policy for one gateway; `clock` is monotonic seconds."""
    return ROUTING_POLICIES[config.policy](config, clock)
