"""Billing settles an aborted request after a step of the worker that ran
it, never after another worker's (gateway/metering.py): the fleet's step
marks, on connections whose state is set by hand."""

from __future__ import annotations

import dataclasses
import time

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
