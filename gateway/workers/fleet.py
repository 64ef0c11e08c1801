"""The gateway's engine: a fleet of worker processes behind one EngineClient.

The gateway tokenizes and templates (it holds the tokenizer, not the
weights) and keeps the adapter registry; each request goes to the worker the
router ranks first (gateway/router/). If that worker is lost before the
request delivered any output, the request is sent once more, to the next
worker in the ranking; one that already streamed ends as an engine failure
ends it, with an output that carries the error: the stream turns it into an
error event and the ledger records finish reason "error". Admission and
/metrics read the workers' latest snapshots: the fleet's capacity is the sum
of the workers that are up.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import time
import uuid
from collections import OrderedDict
from pathlib import Path
from typing import AsyncIterator, Callable

import zmq.asyncio

from engine.outputs import RequestOutput
from engine.prompts import PromptEncoder
from engine.snapshot import EngineSnapshot
from gateway.engine_client import EngineClient, EngineNotReady, EngineRequest, FleetHealth, Health
from gateway.router import NoWorkerAvailable, RouteRequest, RoutingPolicy, WorkerView
from gateway.workers.connection import WorkerConnection, WorkerLost, WorkerState

log = logging.getLogger(__name__)

_SERVED_BY_ENTRIES = 65536


class WorkerFleet(EngineClient):
    """`endpoints` maps worker ids to ZeroMQ endpoints. `supervisor`, when
    given, runs local worker processes at some of them (started before the
    connections, stopped after) and reports their exits through
    `worker_exited`."""

    def __init__(self, engine_config, endpoints: dict[str, str], *, router: RoutingPolicy,
                 secret: str | None = None, heartbeat_timeout_s: float = 10.0, supervisor=None,
                 discovery=None, clock: Callable[[], float] = time.monotonic):
        self.engine_config = engine_config
        self.router = router
        self.supervisor = supervisor
        # Finds workers that come and go (gateway/workers/ray_pool.py): it
        # calls sync_workers with the live ones after each look.
        self.discovery = discovery
        self.clock = clock
        self._context = zmq.asyncio.Context()
        self._session = uuid.uuid4().hex[:12]
        self._secret = secret
        self._heartbeat_timeout_s = heartbeat_timeout_s
        self.workers = {worker_id: self._connection(worker_id, endpoint) for worker_id, endpoint in endpoints.items()}
        self._sinks: list = []
        # request id -> the worker serving it (the last one, after a retry):
        # where an abort goes, and, after the request ended, billing's
        # step_mark. Bounded, oldest first out; an entry for a request the
        # worker no longer holds is harmless (its abort is a no-op there).
        self._served_by: OrderedDict[str, WorkerConnection] = OrderedDict()
        self._prompts: PromptEncoder | None = None
        self._registry = None
        self._model_dir: Path | None = None
        self._setup_error: str | None = None
        self.retried = 0  # requests sent to a second worker after the first was lost
        self._stopping = False

    # ---- lifecycle --------------------------------------------------------------

    def _connection(self, worker_id: str, endpoint: str) -> WorkerConnection:
        return WorkerConnection(worker_id, endpoint, context=self._context, session=self._session,
                                on_usage=self._on_usage, secret=self._secret,
                                heartbeat_timeout_s=self._heartbeat_timeout_s, clock=self.clock)

    async def start(self) -> None:
        if self.supervisor is not None:
            self.supervisor.on_exit = self.worker_exited
            await self.supervisor.start()
        for conn in self.workers.values():
            await conn.start()
        asyncio.get_running_loop().run_in_executor(None, self._load_frontend)
        if self.discovery is not None:
            self.discovery.on_endpoints = self.sync_workers
            self.discovery.waiting = self._waiting_by_worker
            await self.discovery.start()

    async def sync_workers(self, endpoints: dict[str, str]) -> None:
        """Make the fleet's workers exactly `endpoints`: connect to new ones,
        drop those gone, and reconnect to one whose address changed (a
        restarted Ray actor listens on a new port). Requests on a dropped
        worker end as on any lost worker: retried if they delivered nothing."""
        for worker_id, conn in list(self.workers.items()):
            if endpoints.get(worker_id) != conn.endpoint:
                log.info("worker %s left %s", worker_id, conn.endpoint)
                del self.workers[worker_id]
                conn.mark_lost("the worker left the fleet")
                await conn.stop()
                self.router.forget_worker(worker_id)
        for worker_id, endpoint in endpoints.items():
            if worker_id not in self.workers:
                log.info("worker %s joined at %s", worker_id, endpoint)
                conn = self.workers[worker_id] = self._connection(worker_id, endpoint)
                await conn.start()

    def _waiting_by_worker(self) -> dict[str, int]:
        return {worker_id: sum(snap.num_waiting.values()) for worker_id, snap in self.snapshots().items()}

    def _load_frontend(self) -> None:
        """The tokenizer and the adapter registry: the model's files, never its weights."""
        from engine.builder import build_adapter_registry
        from engine.model.loader import load_hf_config, resolve_model_dir

        try:
            model_dir = resolve_model_dir(self.engine_config.model)
            prompts = PromptEncoder.from_model_dir(model_dir)
            self._registry = build_adapter_registry(self.engine_config, load_hf_config(model_dir))
            self._model_dir, self._prompts = model_dir, prompts
        except Exception as exc:  # noqa: BLE001 - reported through /ready and load_error
            log.exception("cannot load the tokenizer")
            self._setup_error = f"{type(exc).__name__}: {exc}"

    async def shutdown(self) -> None:
        self._stopping = True  # what the connections' stop ends is not sent elsewhere
        if self.discovery is not None:
            await self.discovery.stop()
        for conn in list(self.workers.values()):
            await conn.stop()
        if self.supervisor is not None:
            await self.supervisor.stop()
        self._context.term()

    def worker_exited(self, worker_id: str, returncode: int) -> None:
        conn = self.workers.get(worker_id)
        if conn is not None:
            conn.mark_lost(f"the worker process exited with code {returncode}")
        self.router.forget_worker(worker_id)

    # ---- state ------------------------------------------------------------------

    @property
    def ready(self) -> bool:
        return self._prompts is not None and any(c.ready for c in self.workers.values())

    @property
    def load_error(self) -> str | None:
        if self._setup_error is not None:
            return self._setup_error
        states = [c.state for c in self.workers.values()]
        if states and all(s in (WorkerState.FAILED, WorkerState.REFUSED) for s in states):
            return "; ".join(f"worker {c.worker_id}: {c.problem}" for c in self.workers.values())
        return None

    def health(self) -> FleetHealth:
        workers = {worker_id: conn.describe() for worker_id, conn in self.workers.items()}
        # Down: lost, failed or refused, or not ready again since it was.
        # A worker loading its model for the first time is starting.
        down = [c for c in self.workers.values() if not c.ready and (
            c.ever_ready or c.state not in (WorkerState.CONNECTING, WorkerState.LOADING))]
        if not down:
            status = Health.OK
        elif any(c.ready for c in self.workers.values()):
            status = Health.DEGRADED
        else:
            status = Health.UNAVAILABLE
        return FleetHealth(status, workers)

    def snapshots(self) -> dict[str, EngineSnapshot]:
        return {worker_id: c.snapshot for worker_id, c in self.workers.items() if c.ready and c.snapshot}

    @property
    def prompts(self) -> PromptEncoder:
        if self._prompts is None:
            raise EngineNotReady(self._setup_error or "the tokenizer is still loading")
        return self._prompts

    @property
    def model_dir(self) -> Path:
        if self._model_dir is None:
            raise EngineNotReady(self._setup_error or "the tokenizer is still loading")
        return self._model_dir

    @property
    def max_model_len(self) -> int:
        for conn in self.workers.values():
            if conn.ready and conn.info is not None:
                return conn.info.max_model_len
        raise EngineNotReady(self.load_error or "no engine worker is up")

    @property
    def adapter_registry(self):
        self.prompts  # noqa: B018 - raises EngineNotReady until the registry is built too
        return self._registry

    def add_usage_sink(self, sink) -> None:
        self._sinks.append(sink)

    def _on_usage(self, usage) -> None:
        for sink in self._sinks:
            sink(usage)

    # ---- requests -----------------------------------------------------------------

    async def generate(self, request: EngineRequest) -> AsyncIterator[RequestOutput]:
        """Yield the request's output deltas from the worker the router picks."""
        route = RouteRequest(request.tenant_id, request.cache_salt, request.tier, request.adapter_key,
                             request.prompt_ids)
        failed: set[str] = set()
        finished = False
        while True:
            conn = self._place(route, failed)
            try:
                mailbox = conn.submit(request)
            except WorkerLost:  # lost between its last heartbeat and now
                if failed:
                    raise
                failed.add(conn.worker_id)
                continue
            self._remember(request.request_id, conn)
            delivered: RequestOutput | None = None  # the last output it yielded
            try:
                while True:
                    item = await mailbox.get()
                    if isinstance(item, WorkerLost) and delivered is None and not failed and not self._stopping:
                        log.warning("request %s: %s; sending it to another worker", request.request_id, item)
                        failed.add(conn.worker_id)
                        self.retried += 1
                        break
                    if isinstance(item, WorkerLost) and delivered is not None:
                        # Ended as an engine failure ends its requests, with a
                        # last output that carries the error: the stream's error
                        # event and the ledger's finish reason ("error") follow.
                        finished = True
                        yield dataclasses.replace(delivered, outputs=[], finished=True, error=str(item))
                        return
                    if isinstance(item, BaseException):
                        finished = True
                        raise item
                    delivered, finished = item, item.finished
                    yield item
                    if finished:
                        return
            finally:
                if not finished and not failed & {conn.worker_id}:
                    conn.abort(request.request_id)

    def _place(self, route: RouteRequest, failed: set[str]) -> WorkerConnection:
        views = [WorkerView(worker_id, c.ready, c.snapshot, len(c.in_flight)) for worker_id, c in self.workers.items()]
        try:
            ranking = self.router.rank(route, views, exclude=failed)
        except NoWorkerAvailable as exc:
            raise EngineNotReady(f"no engine worker is up: {exc}") from exc
        conn = self.workers[ranking.best]
        self.router.record(route, next(v for v in views if v.worker_id == ranking.best))
        return conn

    def abort(self, request_id: str) -> None:
        conn = self._served_by.get(request_id)
        if conn is not None:
            conn.abort(request_id)

    def _remember(self, request_id: str, conn: WorkerConnection) -> None:
        self._served_by[request_id] = conn
        self._served_by.move_to_end(request_id)
        while len(self._served_by) > _SERVED_BY_ENTRIES:
            self._served_by.popitem(last=False)

    def step_mark(self, request_id: str) -> object:
        conn = self._served_by.get(request_id)
        if conn is None or not conn.ready or conn.snapshot is None:
            return None
        return conn, conn.sessions, conn.snapshot.steps

    def stepped_since(self, mark: object) -> bool:
        if mark is None:
            return True
        conn, session, steps = mark
        # A lost worker's steps are gone with it; a new session counts anew.
        if not conn.ready or conn.sessions != session or conn.snapshot is None:
            return True
        return conn.snapshot.steps > steps


def build_fleet(config, *, log_level: str = "info", clock: Callable[[], float] = time.monotonic) -> WorkerFleet:
    """The fleet `loragw serve` runs: `--workers` local worker processes
    (supervised; `--num-threads` is per worker), plus every `--worker`
    endpoint, routed by `--routing`."""
    from gateway.router import RoutingConfig, make_router
    from gateway.workers.supervisor import LocalWorkers

    pool = config.worker_pool
    endpoints: dict[str, str] = {}
    supervisor = None
    router = make_router(RoutingConfig(policy=pool.routing), clock)
    if pool.ray_address is not None:
        return WorkerFleet(config.engine, {}, router=router, secret=pool.worker_secret,
                           heartbeat_timeout_s=pool.heartbeat_timeout_s, discovery=ray_workers(config, log_level),
                           clock=clock)
    if pool.workers > 0:
        devices = pool.worker_devices.split(",") if pool.worker_devices else None
        supervisor = LocalWorkers(config.engine, pool.workers, devices=devices, backoff_s=pool.restart_backoff_s,
                                  backoff_max_s=pool.restart_backoff_max_s, secret=pool.worker_secret,
                                  log_level=log_level, niceness=pool.worker_niceness)
        endpoints.update(supervisor.endpoints)
    for i, endpoint in enumerate(pool.worker_endpoints):
        endpoints[f"remote-{i}"] = endpoint
    return WorkerFleet(config.engine, endpoints, router=router, secret=pool.worker_secret,
                       heartbeat_timeout_s=pool.heartbeat_timeout_s, supervisor=supervisor, clock=clock)


def ray_workers(config, log_level: str = "warning"):
    """The Ray pool `loragw serve --ray ADDRESS` runs."""
    import importlib.util

    from gateway.config import ConfigError

    if importlib.util.find_spec("ray") is None:
        raise ConfigError("--ray needs Ray, the `ray` extra: pip install 'loragw[ray]'")
    from gateway.workers.ray_pool import RayWorkers
    from gateway.workers.scaling import ScalingPolicy

    pool = config.worker_pool
    policy = ScalingPolicy(min_workers=pool.ray_min_workers, max_workers=pool.ray_max_workers,
                           target_waiting_per_worker=pool.scale_target_waiting,
                           scale_down_after_s=pool.scale_down_after_s, cooldown_s=pool.scale_cooldown_s)
    return RayWorkers(config.engine, address=pool.ray_address, policy=policy, num_gpus=pool.ray_gpus_per_worker,
                      num_cpus=pool.ray_cpus_per_worker, secret=pool.worker_secret, log_level=log_level)
