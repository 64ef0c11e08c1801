"""Workers on a Ray cluster: a local two-node cluster (`ray.cluster_utils`)
on this CPU, one CPU per node, so the two one-CPU workers Ray places land on
different nodes. The gateway finds them through Ray and routes to them over
the same protocol as local workers; Ray restarts a killed one; the fleet
grows and shrinks on queue depth."""

from __future__ import annotations

import asyncio
import threading
import time

import httpx
import pytest

from engine.config import EngineConfig
from gateway.config import GatewayConfig, TierLimits
from gateway.router import RoutingConfig, make_router
from gateway.server import build_gateway
from gateway.tenancy import Tier
from gateway.workers.fleet import WorkerFleet
from gateway.workers.scaling import ScalingPolicy
from tests.gateway.hangups import client_request_id
from tests.gateway.live import ADMIN_TOKEN, seed_tenants, start_live_server, wait_for
from tests.gateway.workers.live_fleet import stream_completion

ray = pytest.importorskip("ray", reason="Ray is the `ray` extra (installed by make test)")
from ray.cluster_utils import Cluster  # noqa: E402

from engine.ray_worker import NAMESPACE  # noqa: E402
from gateway.workers.ray_pool import RayWorkers, _worker_names  # noqa: E402

SECRET = "ray-test-secret-0123456789abcdef"
START_S = 300.0
STORE_BYTES = 80 * 2**20


@pytest.fixture(scope="module")
def cluster():
    c = Cluster(initialize_head=True, head_node_args={"num_cpus": 1, "object_store_memory": STORE_BYTES,
                                                     "include_dashboard": False})
    c.add_node(num_cpus=1, object_store_memory=STORE_BYTES)
    ray.init(address=c.address, namespace=NAMESPACE, log_to_driver=False)
    yield c
    ray.shutdown()
    c.shutdown()


def _kill_all_workers() -> None:
    for name in _worker_names():
        ray.kill(ray.get_actor(name, namespace=NAMESPACE), no_restart=True)
    wait_for(lambda: not _worker_names(), 60, "the Ray workers to be gone")


def _serve(cluster, tmp, model_dir, policy: ScalingPolicy, *, routing="round-robin", cooldown_poll_s=0.5,
           **engine_kwargs):
    db_url = f"sqlite+aiosqlite:///{tmp / 'loragw.db'}"
    keys = seed_tenants(db_url, {"acme": Tier.STANDARD})
    engine = EngineConfig.from_flat(model=str(model_dir), data_dir=str(tmp / "data"), num_threads=1, max_loras=0,
                                    **engine_kwargs)
    pool = RayWorkers(engine, address=cluster.address, policy=policy, num_gpus=0, num_cpus=1, secret=SECRET,
                      poll_s=cooldown_poll_s)
    fleet = WorkerFleet(engine, {}, router=make_router(RoutingConfig(policy=routing), time.monotonic),
                        secret=SECRET, heartbeat_timeout_s=2.0, discovery=pool)
    limits = TierLimits(max_waiting=128)
    gw = build_gateway(GatewayConfig(db_url=db_url, admin_token=ADMIN_TOKEN, engine=engine, data_dir=tmp / "data",
                                     standard=limits, premium=limits), engine=fleet)
    live = start_live_server(gw, ready_timeout_s=START_S)
    return live, fleet, pool, keys["acme"], gw.served_model_name


def _ready(fleet: WorkerFleet, count: int) -> bool:
    return sum(c.ready for c in list(fleet.workers.values())) == count


def _node_of(name: str) -> str:
    return ray.get(ray.get_actor(name, namespace=NAMESPACE).node_id.remote(), timeout=30)


def test_workers_on_both_nodes_serve_requests(cluster, tiny_llama_dir, tmp_path):
    live, fleet, _pool, key, model = _serve(cluster, tmp_path, tiny_llama_dir, ScalingPolicy(2, 2))
    try:
        wait_for(lambda: _ready(fleet, 2), START_S, "two Ray workers")
        names = sorted(fleet.workers)
        assert len({_node_of(n) for n in names}) == 2, "Ray placed both workers on one node"
        bodies = [{"model": model, "prompt": f"request {i}", "max_tokens": 4} for i in range(6)]
        with httpx.Client(base_url=live.url, timeout=60, headers={"Authorization": f"Bearer {key}"}) as client:
            for body in bodies:
                r = client.post("/v1/completions", json=body)
                assert r.status_code == 200, r.text
                assert r.json()["usage"]["completion_tokens"] == 4
        steps = {worker_id: snap.steps for worker_id, snap in fleet.snapshots().items()}
        assert set(steps) == set(names) and all(s > 0 for s in steps.values()), steps
    finally:
        live.stop()
        _kill_all_workers()


def test_killed_worker_ends_streams_retries_queued_and_comes_back(cluster, tiny_llama_dir, tmp_path):
    # One sequence per worker: of the three requests each worker gets, one
    # streams and two queue without output, so the kill shows both kinds.
    live, fleet, _pool, key, model = _serve(cluster, tmp_path, tiny_llama_dir, ScalingPolicy(2, 2), max_num_seqs=1)
    try:
        wait_for(lambda: _ready(fleet, 2), START_S, "two Ray workers")
        victim = sorted(fleet.workers)[0]
        old_endpoint = fleet.workers[victim].endpoint
        body = {"model": model, "prompt": "tell me a long story", "max_tokens": 400, "min_tokens": 400}
        results: dict[int, object] = {}
        streamed: set[str] = set()  # client ids with a first token

        def run(i: int) -> None:
            results[i] = stream_completion(live.url, key, body, request_id=f"ray-{i}",
                                           on_first_token=lambda: streamed.add(f"ray-{i}"), timeout_s=120)

        def victim_streams() -> bool:
            # The victim's own running request must have streamed: a first
            # token on the other worker says nothing of it, and a request
            # killed before its first token is retried, not cut.
            held = {client_request_id(r) for r in list(fleet.workers[victim].in_flight)}
            return len(held) == 3 and bool(held & streamed)

        threads = [threading.Thread(target=run, args=(i,)) for i in range(6)]
        for t in threads:
            t.start()
        wait_for(victim_streams, 60, "three requests on the victim, one streaming")
        ray.kill(ray.get_actor(victim, namespace=NAMESPACE), no_restart=False)
        for t in threads:
            t.join(180)
        outcomes = [(r.finish_reason, bool(r.errors)) for r in results.values()]
        # The victim's streaming request ends with an error event; its two
        # queued ones were retried on the other worker and completed.
        assert outcomes.count((None, True)) == 1, outcomes
        assert outcomes.count(("length", False)) == 5, outcomes
        assert fleet.retried == 2
        # Ray restarts the actor; the gateway finds it at its new address.
        wait_for(lambda: victim in fleet.workers and fleet.workers[victim].endpoint != old_endpoint
                 and _ready(fleet, 2), START_S, "the killed worker back")
    finally:
        live.stop()
        _kill_all_workers()


def test_fleet_scales_up_on_queue_depth_and_back_down_when_quiet(cluster, tiny_llama_dir, tmp_path):
    policy = ScalingPolicy(min_workers=1, max_workers=2, target_waiting_per_worker=2, scale_down_after_s=2.0,
                           cooldown_s=0.0)
    live, fleet, _pool, key, model = _serve(cluster, tmp_path, tiny_llama_dir, policy, max_num_seqs=1)
    try:
        wait_for(lambda: _ready(fleet, 1), START_S, "the first Ray worker")
        assert len(_worker_names()) == 1
        body = {"model": model, "prompt": "queue", "max_tokens": 200, "min_tokens": 200}

        async def flood() -> list[int]:
            async with httpx.AsyncClient(base_url=live.url, timeout=180,
                                         headers={"Authorization": f"Bearer {key}"}) as client:
                async def one():
                    return (await client.post("/v1/completions", json=body)).status_code
                return await asyncio.gather(*(one() for _ in range(8)))

        statuses: list[int] = []
        flood_thread = threading.Thread(target=lambda: statuses.extend(asyncio.run(flood())))
        flood_thread.start()
        # Eight requests, one running: seven wait on one worker, over the target of two.
        wait_for(lambda: len(_worker_names()) == 2, 60, "a second worker for the queue")
        flood_thread.join(300)
        assert statuses == [200] * 8
        # Quiet for scale_down_after_s: back to the minimum.
        wait_for(lambda: len(_worker_names()) == 1, 60, "scale-down to one worker")
    finally:
        live.stop()
        _kill_all_workers()
