"""A live gateway over real engine worker processes, for the worker tests.

`start_fleet_server` builds what `loragw serve --workers N` runs, by hand
(the fleet, its supervisor of local worker processes on Unix sockets, a
router), on the tiny random Llama, with tenants seeded and adapters imported
into the registry the workers load from. Worker processes take seconds to
start, so modules share one server (module-scoped fixtures) and pick the
engine settings they need. The gateway's usage is also recorded per worker
as it arrives, the ground truth for conservation.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import pytest

from engine.config import EngineConfig
from engine.step_io import StepUsage
from gateway.config import GatewayConfig, TierLimits
from gateway.router import RoutingConfig, make_router
from gateway.server import build_gateway
from gateway.tenancy import Tier
from gateway.workers.fleet import WorkerFleet
from gateway.workers.supervisor import LocalWorkers
from tests.gateway.live import ADMIN_TOKEN, LiveServer, seed_tenants, start_live_server, wait_for

# Distinct adapters for the worker tests: (name, seed). Different seeds give
# different weights, so each one changes the output in its own way.
LORAS = [("lora-a", 11), ("lora-b", 12), ("lora-c", 13), ("lora-d", 14)]
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
                       tenants: dict[str, Tier], grants=(), adapter_dirs: dict[str, Path] | None = None,
                       tier_limits: TierLimits = TierLimits(max_waiting=64), heartbeat_timeout_s: float = 10.0,
                       backoff_s: float = 0.2, **engine_kwargs) -> FleetServer:
    """Tenants (one key each), adapter grants (name, owner, shared) imported
    from `adapter_dirs[name]`, and a live gateway over `workers` local worker
    processes routed by `policy`; returns once every worker is ready."""
    db_url = f"sqlite+aiosqlite:///{tmp / 'loragw.db'}"
    keys = seed_tenants(db_url, tenants, grants)
    engine = EngineConfig(model=str(model_dir), data_dir=str(tmp / "data"), num_threads=1, **engine_kwargs)
    supervisor = LocalWorkers(engine, workers, backoff_s=backoff_s, log_level="warning")
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


@pytest.fixture(scope="session")
def lora_dirs(tiny_llama_dir, tmp_path_factory) -> dict[str, Path]:
    """The LORAS as PEFT adapters on the tiny Llama (r=4 on q, v and o)."""
    from tests.adapters.conftest import build_peft_adapter

    dirs = {}
    for name, seed in LORAS:
        out = dirs[name] = tmp_path_factory.mktemp(name)
        build_peft_adapter(tiny_llama_dir, out, seed=seed, r=4, lora_alpha=8,
                           target_modules=["q_proj", "v_proj", "o_proj"])
    return dirs


@pytest.fixture(scope="module")
def fleet_server(tiny_llama_dir, lora_dirs, tmp_path_factory):
    """Two workers on the tiny Llama behind one gateway (affinity routing),
    tenant `acme` (standard) and `gold` (premium), every LORAS adapter
    imported and shared."""
    server = start_fleet_server(
        tmp_path_factory.mktemp("fleet"), tiny_llama_dir, tenants={"acme": Tier.STANDARD, "gold": Tier.PREMIUM},
        grants=[(name, None, True) for name, _ in LORAS], adapter_dirs=lora_dirs,
        max_num_seqs=8, num_kv_blocks=256, max_loras=4)
    yield server
    server.stop()
