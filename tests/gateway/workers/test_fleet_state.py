"""What the fleet derives from its workers' state, on connections whose
state is set by hand: the capacity admission judges (the fleet's, not one
engine's), health, and the step marks billing settles aborted requests by
(a step of the worker that ran the request, never another worker's)."""

from __future__ import annotations

import dataclasses
import time

from engine.request import Tier
from gateway.engine_client import Health, KVCapacity
from gateway.router import RoutingConfig, make_router
from gateway.workers.connection import WorkerState
from gateway.workers.fleet import WorkerFleet
from tests.gateway.fakes import FakeEngineClient


def fleet_with_two_ready_workers() -> WorkerFleet:
    fleet = WorkerFleet(None, {"0": "ipc:///nonexistent-0", "1": "ipc:///nonexistent-1"},
                        router=make_router(RoutingConfig(), time.monotonic))
    for conn in fleet.workers.values():
        conn.state, conn.sessions = WorkerState.READY, 1
        conn.snapshot = dataclasses.replace(FakeEngineClient.engine_stats, steps=10)
    return fleet


def step(conn, n: int = 1) -> None:
    conn.snapshot = dataclasses.replace(conn.snapshot, steps=conn.snapshot.steps + n)


def test_only_the_serving_workers_step_settles_a_request():
    fleet = fleet_with_two_ready_workers()
    w0, w1 = fleet.workers["0"], fleet.workers["1"]
    fleet._remember("req", w0)
    mark = fleet.step_mark("req")
    assert not fleet.stepped_since(mark)
    step(w1, 5)  # the other worker stepping says nothing of req's last step
    assert not fleet.stepped_since(mark)
    step(w0)
    assert fleet.stepped_since(mark)


def test_a_lost_or_restarted_worker_settles_at_once_and_unknown_requests_too():
    fleet = fleet_with_two_ready_workers()
    w0 = fleet.workers["0"]
    fleet._remember("lost", w0)
    fleet._remember("restarted", w0)
    lost, restarted = fleet.step_mark("lost"), fleet.step_mark("restarted")
    w0.sessions += 1  # a new session: its step count started again
    assert fleet.stepped_since(restarted)
    w0.state = WorkerState.DOWN
    assert fleet.stepped_since(lost)
    assert fleet.stepped_since(fleet.step_mark("never-placed"))


def test_the_memory_of_where_requests_ran_is_bounded(monkeypatch):
    import gateway.workers.fleet as fleet_module

    monkeypatch.setattr(fleet_module, "_SERVED_BY_ENTRIES", 3)
    fleet = fleet_with_two_ready_workers()
    for i in range(5):
        fleet._remember(f"r{i}", fleet.workers["0"])
    assert list(fleet._served_by) == ["r2", "r3", "r4"]


def test_admission_judges_the_capacity_of_the_workers_that_are_up():
    fleet = fleet_with_two_ready_workers()
    one = FakeEngineClient.engine_stats  # 256 blocks of 16 tokens, 64 reserved for premium
    both = fleet.kv_capacity
    assert both == KVCapacity(total_tokens=2 * 256 * 16, premium_reserved_tokens=2 * 64 * 16)
    assert both.usable_tokens(Tier.STANDARD) == 2 * (256 - 64) * 16
    assert fleet.stats().kv_num_blocks == 2 * one.kv_num_blocks
    fleet.workers["1"].state = WorkerState.DOWN
    assert fleet.kv_capacity == KVCapacity(total_tokens=256 * 16, premium_reserved_tokens=64 * 16)
    assert fleet.health().status is Health.DEGRADED
    fleet.workers["0"].state = WorkerState.DOWN
    assert fleet.health().status is Health.UNAVAILABLE
