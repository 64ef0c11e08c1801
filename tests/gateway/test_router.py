"""The router, on hand-built snapshots: no worker, no engine, no clock."""

from __future__ import annotations

from collections import Counter, OrderedDict

import pytest

from engine.request import Tier
from engine.snapshot import EngineSnapshot
from gateway.config import ConfigError
from gateway.router import (AffinityRouter, NoWorkerAvailable, PrefixMemory, RoundRobinRouter, RouteRequest,
                            RoutingConfig, WorkerView, make_router)

BLOCK = 4


class FakeClock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def adapter(name: str) -> tuple[str, int, str]:
    return (name, 1, f"digest-{name}")


def snap(*, waiting: int = 0, running: int = 0, free: int = 64, reserved: int = 0, slots: int = 2,
         resident=(), host=()) -> EngineSnapshot:
    return EngineSnapshot(
        num_running={Tier.STANDARD: running}, num_waiting={Tier.STANDARD: waiting}, num_preemptions={},
        kv_num_blocks=64, kv_used_blocks=64 - free, kv_free_blocks=free, kv_premium_reserved_blocks=reserved,
        kv_used_by_tier={}, block_size=BLOCK, num_lora_slots=slots,
        resident_adapters=tuple(resident), host_adapters=tuple(host))


def worker(worker_id: str, snapshot: EngineSnapshot | None = None, *, in_flight: int = 0,
           alive: bool = True) -> WorkerView:
    return WorkerView(worker_id, alive, snapshot if snapshot is not None else snap(), in_flight)


def request(prompt=(1, 2, 3), *, tenant="t1", salt=None, tier=Tier.STANDARD, lora=None) -> RouteRequest:
    return RouteRequest(tenant_id=tenant, cache_salt=salt, tier=tier, adapter=lora, prompt_ids=list(prompt))


def ranked(router, req, workers, **kw) -> list[str]:
    return list(router.rank(req, workers, **kw).workers)


# --- tie-breaks and the terms one at a time ---------------------------------------


def test_equal_workers_rank_by_id_whatever_order_they_come_in():
    router = AffinityRouter(FakeClock())
    workers = [worker("w2"), worker("w0"), worker("w1")]
    assert ranked(router, request(), workers) == ["w0", "w1", "w2"]


def test_equal_cost_goes_to_fewer_requests_in_flight():
    router = AffinityRouter(FakeClock())
    # Both snapshots already show every dispatched request running: no queue on either.
    busy = worker("w0", snap(running=3), in_flight=3)
    light = worker("w1", snap(running=1), in_flight=1)
    assert ranked(router, request(), [busy, light]) == ["w1", "w0"]


def test_queue_counts_dispatched_requests_the_snapshot_has_not_shown():
    router = AffinityRouter(FakeClock())
    lagging = worker("w0", snap(), in_flight=2)  # two sent since its last snapshot
    waiting = worker("w1", snap(waiting=1), in_flight=1)  # the one sent is already queued
    assert ranked(router, request(), [lagging, waiting]) == ["w1", "w0"]


def test_premium_counts_only_the_premium_queue_standard_counts_both():
    import dataclasses

    router = AffinityRouter(FakeClock())
    # w0: six standard requests waiting; w1: one premium request waiting.
    standard_queue = worker("w0", dataclasses.replace(snap(), num_waiting={Tier.STANDARD: 6, Tier.PREMIUM: 0}))
    premium_queue = worker("w1", dataclasses.replace(snap(), num_waiting={Tier.STANDARD: 0, Tier.PREMIUM: 1}))
    # The scheduler serves premium before any standard request: w0's queue is not in its way.
    assert ranked(router, request(tier=Tier.PREMIUM), [standard_queue, premium_queue]) == ["w0", "w1"]
    assert ranked(router, request(tier=Tier.STANDARD), [standard_queue, premium_queue]) == ["w1", "w0"]


def test_a_worker_without_kv_room_for_the_prompt_ranks_last():
    router = AffinityRouter(FakeClock())
    prompt = range(5 * BLOCK)  # 5 blocks
    full = worker("w0", snap(free=4))
    busy_with_room = worker("w1", snap(waiting=6, free=5))
    assert ranked(router, request(prompt), [full, busy_with_room]) == ["w1", "w0"]
    # Room for a short prompt on the same worker: its empty queue wins again.
    assert ranked(router, request(range(BLOCK)), [full, busy_with_room]) == ["w0", "w1"]


def test_standard_headroom_excludes_the_premium_reserve():
    router = AffinityRouter(FakeClock())
    prompt = range(4 * BLOCK)
    reserved = worker("w0", snap(free=10, reserved=8))  # standard may take only 2 of the 10
    loaded = worker("w1", snap(free=6, waiting=2))
    assert ranked(router, request(prompt, tier=Tier.STANDARD), [reserved, loaded]) == ["w1", "w0"]
    assert ranked(router, request(prompt, tier=Tier.PREMIUM), [reserved, loaded]) == ["w0", "w1"]


@pytest.mark.parametrize("router", [AffinityRouter(FakeClock()), RoundRobinRouter()], ids=["affinity", "rr"])
def test_a_dead_worker_is_never_ranked(router):
    a = adapter("a")
    dead = worker("w0", snap(resident=[a]), alive=False)  # better than w1 in every respect
    alive = worker("w1", snap(waiting=9, slots=1, resident=[adapter("b")]))
    for _ in range(3):
        ranking = router.rank(request(lora=a), [dead, alive])
        assert ranking.workers == ("w1",)
        router.record(request(lora=a), alive)
    with pytest.raises(NoWorkerAvailable):
        router.rank(request(), [dead, worker("w1", alive=False)])
    with pytest.raises(NoWorkerAvailable):
        router.rank(request(), [dead, alive], exclude={"w1"})


def test_a_worker_with_no_snapshot_yet_counts_as_just_started():
    router = AffinityRouter(FakeClock())
    a, b, c = adapter("a"), adapter("b"), adapter("c")
    fresh = WorkerView("w0", True, None, in_flight=1)
    full = worker("w1", snap(resident=[b, c]))  # idle, but `a` needs a load and an eviction
    assert ranked(router, request(range(64 * BLOCK), lora=a), [fresh, full]) == ["w0", "w1"]
    router.record(request(range(8 * BLOCK)), fresh)  # remembered at the default block size
    assert router.rank(request(range(8 * BLOCK)), [fresh, worker("w1")]).best == "w0"


def test_no_workers_at_all_is_an_error():
    with pytest.raises(NoWorkerAvailable):
        AffinityRouter(FakeClock()).rank(request(), [])


# --- adapter residency ------------------------------------------------------------


def test_resident_beats_free_slot_beats_host_beats_load():
    router = AffinityRouter(FakeClock())
    a, b, c = adapter("a"), adapter("b"), adapter("c")
    workers = [
        worker("w0", snap(resident=[b, c])),  # slots full, `a` on disk: a load and an eviction
        worker("w1", snap(resident=[b, c], host=[a])),  # slots full, `a` on the host
        worker("w2", snap(resident=[b])),  # a free slot, `a` on disk
        worker("w3", snap(resident=[a, b])),  # resident
    ]
    assert ranked(router, request(lora=a), workers) == ["w3", "w2", "w1", "w0"]
    # A free slot with the weights on the host beats a free slot without.
    on_host = worker("w4", snap(resident=[b], host=[a]))
    assert ranked(router, request(lora=a), workers[:3] + [on_host]) == ["w4", "w2", "w1", "w0"]
    # The base model needs no slot: only the tie-break is left.
    assert ranked(router, request(), workers) == ["w0", "w1", "w2", "w3"]


def test_an_adapter_resident_in_two_places_goes_to_the_shorter_queue():
    router = AffinityRouter(FakeClock())
    a, b = adapter("a"), adapter("b")
    workers = [worker("w0", snap(waiting=2, resident=[a])), worker("w1", snap(waiting=1, resident=[a, b])),
               worker("w2", snap(resident=[b, adapter("c")]))]
    assert ranked(router, request(lora=a), workers) == ["w1", "w0", "w2"]


def test_residency_is_worth_a_few_queued_requests_not_an_overloaded_worker():
    router = AffinityRouter(FakeClock())
    a, b, c = adapter("a"), adapter("b"), adapter("c")
    cold = worker("w1", snap(resident=[b, c]))  # idle, but `a` needs a load and an eviction
    for queue, best in [(3, "w0"), (5, "w1")]:
        warm = worker("w0", snap(waiting=queue, resident=[a, b]))
        assert ranked(router, request(lora=a), [warm, cold])[0] == best


# --- prefix affinity --------------------------------------------------------------


def test_a_repeated_long_prompt_returns_to_its_worker_but_not_across_tenants_or_salts():
    router = AffinityRouter(FakeClock())
    prompt = range(100, 100 + 8 * BLOCK)
    first = request(prompt, tenant="t1", salt="s")
    workers = [worker("w0"), worker("w1")]
    assert router.rank(first, workers).best == "w0"
    router.record(first, workers[0])
    # w0 now has a request more in its queue; without the prefix w1 would win.
    workers = [worker("w0", snap(waiting=1)), worker("w1")]
    assert router.rank(request(prompt, tenant="t1", salt="s"), workers).best == "w0"
    assert router.rank(request(prompt, tenant="t2", salt="s"), workers).best == "w1"
    assert router.rank(request(prompt, tenant="t1", salt="other"), workers).best == "w1"
    assert router.rank(request(prompt, tenant="t1", salt=None), workers).best == "w1"


def test_the_longer_prefix_match_wins():
    router = AffinityRouter(FakeClock())
    shared = list(range(8 * BLOCK))
    w0, w1 = worker("w0"), worker("w1")
    router.record(request(shared[:2 * BLOCK] + [-1] * BLOCK), w0)
    router.record(request(shared[:6 * BLOCK] + [-2] * BLOCK), w1)
    assert ranked(router, request(shared), [w0, w1]) == ["w1", "w0"]
    # A partial block is not matched: the engine caches full blocks only.
    other = AffinityRouter(FakeClock())
    other.record(request(shared[:BLOCK - 1]), w1)
    assert ranked(other, request(shared), [w0, w1]) == ["w0", "w1"]


def test_a_forgotten_worker_has_no_prefixes():
    router = AffinityRouter(FakeClock())
    prompt = range(8 * BLOCK)
    router.record(request(prompt), worker("w0"))
    workers = [worker("w0", snap(waiting=1)), worker("w1")]
    assert router.rank(request(prompt), workers).best == "w0"
    router.forget_worker("w0")
    assert router.rank(request(prompt), workers).best == "w1"
    assert len(router.prefix_memory) == 0


def test_prefix_entries_expire_after_the_ttl():
    clock = FakeClock()
    router = AffinityRouter(clock, prefix_ttl_s=60.0)
    prompt = range(8 * BLOCK)
    router.record(request(prompt), worker("w0"))
    workers = [worker("w0", snap(waiting=1)), worker("w1")]
    clock.now = 60.0
    assert router.rank(request(prompt), workers).best == "w0"
    clock.now = 60.5
    assert router.rank(request(prompt), workers).best == "w1"
    router.record(request(range(1000, 1000 + BLOCK)), worker("w1"))  # recording sweeps the expired
    assert len(router.prefix_memory) == 1


def test_prefix_memory_matches_only_unbroken_runs_from_the_first_block():
    memory = PrefixMemory(FakeClock())
    memory.record([11, 12], "w0")
    memory.record([12, 13], "w1")  # its later blocks without the first one
    assert memory.match([11, 12, 13]) == {"w0": 2}
    assert memory.match([12, 13]) == {"w0": 1, "w1": 2}


def test_prefix_memory_is_bounded_and_keeps_leading_blocks_longest():
    memory = PrefixMemory(FakeClock(), max_entries=6)
    first, second = [11, 12, 13, 14], [21, 22, 23, 24]  # block hashes of two 4-block prompts
    memory.record(first, "w0")
    memory.record(second, "w1")
    assert len(memory) == 6
    # The first prompt lost its two tail blocks, not its head.
    assert memory.match(first) == {"w0": 2}
    assert memory.match(second) == {"w1": 4}
    for i in range(100):
        memory.record([1000 + i], "w2")
    assert len(memory) == 6
    assert memory.match(first) == {} and memory.match(second) == {}


# --- round-robin and the registry -------------------------------------------------


def test_round_robin_rotates_over_alive_workers_and_ignores_everything_else():
    router = RoundRobinRouter()
    a = adapter("a")
    views = {w.worker_id: w for w in [worker("w0", snap(free=0)), worker("w1", snap(resident=[a])),
                                       worker("w2", snap(waiting=50))]}
    picks = []
    for _ in range(4):
        best = router.rank(request(range(64), lora=a), list(views.values())).best
        router.record(request(), views[best])
        picks.append(best)
    assert picks == ["w0", "w1", "w2", "w0"]
    # w1 dies: the rotation skips it and goes on from where it was.
    views["w1"] = worker("w1", alive=False)
    assert ranked(router, request(), list(views.values())) == ["w2", "w0"]


def test_round_robin_retry_takes_the_next_worker_after_the_failed_one():
    router = RoundRobinRouter()
    workers = [worker("w0"), worker("w1"), worker("w2")]
    router.record(request(), workers[0])
    assert router.rank(request(), workers).best == "w1"
    assert ranked(router, request(), workers, exclude={"w1"}) == ["w2", "w0"]


def test_the_registry_builds_each_policy_and_refuses_unknown_names():
    clock = FakeClock()
    assert isinstance(make_router(RoutingConfig(), clock), AffinityRouter)
    assert isinstance(make_router(RoutingConfig(policy="round-robin"), clock), RoundRobinRouter)
    with pytest.raises(ConfigError, match="'random'.*affinity, round-robin"):
        RoutingConfig(policy="random")


# --- a small fleet: 2 workers x 2 slots, 4 adapters -------------------------------


def simulate_adapter_loads(router, bursts: list[list[str]], *, num_workers: int = 2, slots: int = 2) -> Counter:
    """Dispatch each burst's requests back to back (their snapshots lag: each
    shows an idle engine, so only `in_flight` tells the load), then let the
    burst finish. Each worker's slots are an LRU of `slots` adapters; a
    request whose adapter is not in its worker's slots loads it there."""
    slot_lru = {f"w{i}": OrderedDict() for i in range(num_workers)}
    loads: Counter = Counter()
    prompt = 0
    for burst in bursts:
        in_flight: Counter = Counter()
        for name in burst:
            views = [worker(w, snap(slots=slots, resident=list(lru)), in_flight=in_flight[w])
                     for w, lru in slot_lru.items()]
            prompt += 1
            req = request(range(prompt * 100, prompt * 100 + 3 * BLOCK), lora=adapter(name))
            target = router.rank(req, views).best
            router.record(req, next(v for v in views if v.worker_id == target))
            in_flight[target] += 1
            lru = slot_lru[target]
            if adapter(name) not in lru:
                loads[name] += 1
                if len(lru) == slots:
                    lru.popitem(last=False)
            lru[adapter(name)] = True
            lru.move_to_end(adapter(name))
    return loads


def test_affinity_loads_each_adapter_once_where_round_robin_thrashes():
    # Each adapter's requests come in pairs, cycling a, b, c, d, ten times.
    bursts = [[name for name in "abcd" for _ in range(2)] for _ in range(10)]
    affine = simulate_adapter_loads(AffinityRouter(FakeClock()), bursts)
    assert affine == {"a": 1, "b": 1, "c": 1, "d": 1}
    # Round-robin deals each worker a, b, c, d in turn: with two slots, every request loads.
    rotated = simulate_adapter_loads(RoundRobinRouter(), bursts)
    assert sum(rotated.values()) == 80
