"""Engine workers on a Ray cluster: `loragw serve --ray ADDRESS`.

Ray core actors, not Ray Serve (docs/architecture.md, "Workers on Ray"):
Ray places each worker (`num_gpus` per actor, one per GPU), restarts a dead
one (`max_restarts=-1`), and names it, which is how gateways discover the
live workers. Requests never pass through Ray: the gateway connects to each
actor's ZeroMQ endpoint, exactly as to a local worker, and its own router
ranks them. Scaling follows the queue (gateway/workers/scaling.py).

Actors are detached and named `loragw-worker-N` in the `loragw` namespace,
so they outlive one gateway and every gateway replica on the cluster finds
the same fleet.
"""

from __future__ import annotations

import asyncio
import logging
import os
import time
from typing import Callable

from engine.host_cpu import OMP_WAIT_POLICY
from engine.ray_worker import ACTOR_PREFIX, NAMESPACE
from gateway.workers.scaling import QueueDepthScaler, ScalingPolicy

log = logging.getLogger(__name__)

# How long a poll waits for a restarting actor to say where it listens.
_ENDPOINT_TIMEOUT_S = 2.0


class RayWorkers:
    """Discovers, places and scales the fleet's Ray actors. `on_endpoints`
    (set by the fleet) receives the live workers' endpoints after each poll."""

    def __init__(self, engine_config, *, address: str, policy: ScalingPolicy, num_gpus: float = 0.0,
                 num_cpus: float = 1.0, secret: str | None = None, poll_s: float = 1.0,
                 log_level: str = "warning", clock: Callable[[], float] = time.monotonic):
        self.engine_config = engine_config
        self.address = address
        self.scaler = QueueDepthScaler(policy)
        self.num_gpus = num_gpus
        self.num_cpus = num_cpus
        self.secret = secret
        self.poll_s = poll_s
        self.log_level = log_level
        self.clock = clock
        self.on_endpoints: Callable[[dict[str, str]], object] | None = None
        self.waiting: Callable[[], dict[str, int]] = dict  # worker id -> waiting requests
        self.endpoints: dict[str, str] = {}
        self._task: asyncio.Task | None = None

    async def start(self) -> None:
        import ray

        if not ray.is_initialized():
            await asyncio.to_thread(ray.init, address=self.address, namespace=NAMESPACE, log_to_driver=False,
                                    ignore_reinit_error=True)
        await self.poll()
        self._task = asyncio.create_task(self._run())

    async def stop(self) -> None:
        """Stop polling. The actors stay: they belong to the cluster, and
        other gateway replicas may be routing to them."""
        if self._task is not None:
            self._task.cancel()
            try:
                await self._task
            except asyncio.CancelledError:
                pass

    async def _run(self) -> None:
        while True:
            await asyncio.sleep(self.poll_s)
            try:
                await self.poll()
            except Exception:  # noqa: BLE001 - the next poll tries again
                log.exception("polling the Ray cluster failed")

    async def poll(self) -> None:
        """Find the live workers, tell the fleet, and scale."""
        names = await asyncio.to_thread(_worker_names)
        endpoints = {}
        for name in names:
            endpoint = await self._endpoint(name)
            if endpoint is not None:
                endpoints[name] = endpoint
        self.endpoints = endpoints
        if self.on_endpoints is not None:
            result = self.on_endpoints(endpoints)
            if asyncio.iscoroutine(result):
                await result
        await self._scale(names)

    async def _endpoint(self, name: str) -> str | None:
        """The actor's endpoint; None while it is (re)starting."""
        import ray

        try:
            actor = ray.get_actor(name, namespace=NAMESPACE)
            return await asyncio.wait_for(actor.endpoint.remote(), _ENDPOINT_TIMEOUT_S)
        except (asyncio.TimeoutError, ValueError, ray.exceptions.RayError):
            return None

    async def _scale(self, names: list[str]) -> None:
        waiting = self.waiting()
        counts = [waiting.get(name, 0) for name in names if name in self.endpoints]
        desired = self.scaler.desired(len(names), counts, self.clock())
        if desired > len(names):
            await asyncio.to_thread(self._create, desired - len(names), set(names))
        elif desired < len(names):
            victim = self._idlest(names, waiting)
            if victim is None:
                self.scaler.note_change(self.clock())
            else:
                log.info("scaling down: stopping Ray worker %s", victim)
                await asyncio.to_thread(_kill, victim)

    def _idlest(self, names: list[str], waiting: dict[str, int]) -> str | None:
        """A worker with nothing waiting, the newest first (it has the
        coldest caches); None when every one is busy."""
        idle = [n for n in names if waiting.get(n, 0) == 0]
        return max(idle, key=_index) if idle else None

    def _create(self, count: int, taken: set[str]) -> None:
        import msgspec
        import ray

        from engine.ray_worker import WorkerActor

        config_json = msgspec.json.encode(self.engine_config).decode()
        index = 0
        for _ in range(count):
            while f"{ACTOR_PREFIX}{index}" in taken:
                index += 1
            name = f"{ACTOR_PREFIX}{index}"
            taken.add(name)
            log.info("starting Ray worker %s", name)
            ray.remote(WorkerActor).options(
                name=name, namespace=NAMESPACE, lifetime="detached", get_if_exists=True,
                max_restarts=-1, max_task_retries=0, num_gpus=self.num_gpus, num_cpus=self.num_cpus,
                # An actor's process loads torch before our code runs in it.
                runtime_env={"env_vars": {"OMP_WAIT_POLICY": os.environ.get("OMP_WAIT_POLICY", OMP_WAIT_POLICY)}},
            ).remote(config_json, self.secret, self.log_level)


def _worker_names() -> list[str]:
    import ray

    named = ray.util.list_named_actors(all_namespaces=True)
    return sorted((a["name"] for a in named
                   if a.get("namespace") == NAMESPACE and a["name"].startswith(ACTOR_PREFIX)), key=_index)


def _index(name: str) -> int:
    suffix = name[len(ACTOR_PREFIX):]
    return int(suffix) if suffix.isdigit() else 0


def _kill(name: str) -> None:
    import ray

    try:
        ray.kill(ray.get_actor(name, namespace=NAMESPACE), no_restart=True)
    except ValueError:
        pass  # already gone
