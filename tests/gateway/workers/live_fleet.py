"""A live gateway over real engine worker processes, for the worker tests.

`start_fleet_server` builds what `loragw serve --workers N` runs, by hand
(the fleet, its supervisor of local worker processes on Unix sockets, a
router), on the tiny random Llama, with tenants seeded and adapters imported
into the registry the workers load from; the gateway under uvicorn, billing
on. The gateway's usage is also recorded per worker as it arrives, the
ground truth for conservation."""

from __future__ import annotations

import json
import time
from dataclasses import dataclass, field
from pathlib import Path

import httpx

from engine.config import EngineConfig
from engine.step_io import StepUsage
from gateway.config import GatewayConfig, TierLimits
from gateway.router import RoutingConfig, make_router
from gateway.server import build_gateway
from gateway.tenancy import Tier
from gateway.workers.fleet import WorkerFleet
from gateway.workers.supervisor import LocalWorkers
from tests.gateway.live import ADMIN_TOKEN, LiveServer, seed_tenants, start_live_server, wait_for

# Every client call in these tests has a timeout: a hang fails, never blocks.
CLIENT_TIMEOUT_S = 60.0
# Generous: each worker imports torch and loads the model, on a shared machine;
# the first run on a machine also builds the C++ kernels.
WORKER_START_S = 300.0


@dataclass
class FleetServer:
    live: LiveServer
    fleet: WorkerFleet
    supervisor: LocalWorkers
    keys: dict[str, str]  # tenant name -> API key
    model: str  # the base model's served name
    db_url: str
    # Every StepUsage the gateway received, per worker id, in arrival order.
    usage: dict[str, list[StepUsage]] = field(default_factory=dict)

    @property
    def key(self) -> str:
        """The first tenant's key (one tenant, "acme", unless given others)."""
        return next(iter(self.keys.values()))

    @property
    def steps(self) -> list[StepUsage]:
        """Every step's usage the gateway's meter heard, from every worker."""
        return [u for steps in self.usage.values() for u in steps]

    @property
    def url(self) -> str:
        return self.live.url

    def client(self, timeout: float = 120.0) -> httpx.AsyncClient:
        return httpx.AsyncClient(base_url=self.url, timeout=timeout)

    def headers(self, tenant: str) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.keys[tenant]}"}

    def snapshots(self):
        return self.fleet.snapshots()

    def stop(self) -> None:
        self.live.stop()


def record_usage_by_worker(fleet: WorkerFleet) -> dict[str, list[StepUsage]]:
    """Tee each connection's usage callback: the fleet's own sinks cannot
    tell which worker a step came from, and conservation holds per worker."""
    seen: dict[str, list[StepUsage]] = {}
    for worker_id, conn in fleet.workers.items():
        steps = seen[worker_id] = []
        forward = conn._on_usage

        def tee(usage: StepUsage, steps=steps, forward=forward) -> None:
            steps.append(usage)
            forward(usage)

        conn._on_usage = tee
    return seen


def start_fleet_server(tmp: Path, model_dir: Path, *, workers: int = 2, policy: str = "affinity",
                       tenants: dict[str, Tier] | None = None, grants=(), adapter_dirs: dict[str, Path] | None = None,
                       db_url: str | None = None, tier_limits: TierLimits = TierLimits(max_waiting=128),
                       heartbeat_timeout_s: float = 10.0, backoff_s: float = 0.2, niceness: int = 0,
                       **engine_kwargs) -> FleetServer:
    """Tenants (one key each; default "acme", standard), adapter grants
    (name, owner, shared) imported from `adapter_dirs[name]`, and a live
    gateway over `workers` local worker processes (one torch thread each)
    routed by `policy`, `niceness` below the gateway; returns once every
    worker is ready."""
    db_url = db_url or f"sqlite+aiosqlite:///{tmp / 'loragw.db'}"
    keys = seed_tenants(db_url, tenants or {"acme": Tier.STANDARD}, grants)
    engine_kwargs.setdefault("max_loras", 0 if not grants else 4)
    engine = EngineConfig.from_flat(model=str(model_dir), data_dir=str(tmp / "data"), num_threads=1, **engine_kwargs)
    supervisor = LocalWorkers(engine, workers, backoff_s=backoff_s, backoff_max_s=max(backoff_s, 30.0),
                              log_level="warning", niceness=niceness)
    fleet = WorkerFleet(engine, supervisor.endpoints, router=make_router(RoutingConfig(policy=policy), time.monotonic),
                        supervisor=supervisor, heartbeat_timeout_s=heartbeat_timeout_s)
    usage = record_usage_by_worker(fleet)
    gw = build_gateway(GatewayConfig(db_url=db_url, admin_token=ADMIN_TOKEN, engine=engine, data_dir=tmp / "data",
                                     standard=tier_limits, premium=tier_limits), engine=fleet)
    live = start_live_server(gw, ready_timeout_s=WORKER_START_S)
    server = FleetServer(live, fleet, supervisor, keys, gw.served_model_name, db_url, usage)
    try:
        wait_for(lambda: all(c.ready for c in fleet.workers.values()), WORKER_START_S, "every worker to be ready")
        for name, _owner, _shared in grants:
            gw.registry.import_dir(name, adapter_dirs[name])
    except BaseException:
        server.stop()
        raise
    return server


@dataclass
class StreamResult:
    status: int
    text: str  # the completion's text, from the content deltas
    finish_reason: str | None
    errors: list[dict]  # error events
    done: bool  # the stream ended with [DONE]
    usage: dict | None


def stream_completion(url: str, key: str, body: dict, *, request_id: str, on_first_token=None,
                      timeout_s: float = CLIENT_TIMEOUT_S) -> StreamResult:
    """POST a streamed /v1/completions and read it to the end, parsing its
    SSE events; `on_first_token()` runs once the first text arrives."""
    headers = {"Authorization": f"Bearer {key}", "X-Request-Id": request_id}
    text, finish, errors, done, usage = [], None, [], False, None
    with httpx.Client(timeout=timeout_s) as client:
        with client.stream("POST", f"{url}/v1/completions", json={**body, "stream": True}, headers=headers) as r:
            if r.status_code != 200:
                r.read()
                return StreamResult(r.status_code, "", None, [r.json()], False, None)
            for line in r.iter_lines():
                if not line.startswith("data: "):
                    continue
                data = line[len("data: "):]
                if data == "[DONE]":
                    done = True
                    continue
                event = json.loads(data)
                if "error" in event:
                    errors.append(event["error"])
                    continue
                if event.get("usage"):
                    usage = event["usage"]
                for choice in event["choices"]:
                    if choice["text"] and not text and on_first_token is not None:
                        on_first_token()
                    text.append(choice["text"])
                    finish = choice["finish_reason"] or finish
    return StreamResult(200, "".join(text), finish, errors, done, usage)
