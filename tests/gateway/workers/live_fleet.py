"""A live gateway over a fleet of local engine worker processes, for the
fault and health tests: real `python -m engine.worker` processes under the
supervisor, the gateway under uvicorn, billing on."""

from __future__ import annotations

import json
import time
from dataclasses import dataclass
from pathlib import Path

import httpx

from engine.config import EngineConfig
from gateway.config import GatewayConfig, TierLimits
from gateway.router import RoutingConfig, make_router
from gateway.server import build_gateway
from gateway.tenancy import Tier
from gateway.workers.fleet import WorkerFleet
from gateway.workers.supervisor import LocalWorkers
from tests.gateway.live import LiveServer, seed_tenants, start_live_server, wait_for

# Every client call in these tests has a timeout: a hang fails, never blocks.
CLIENT_TIMEOUT_S = 60.0


@dataclass
class FleetServer:
    live: LiveServer
    fleet: WorkerFleet
    supervisor: LocalWorkers
    key: str
    model: str
    db_url: str
    steps: list  # every StepUsage the gateway's meter heard, from every worker

    @property
    def url(self) -> str:
        return self.live.url

    def stop(self) -> None:
        self.live.stop()


def start_fleet_server(tmp: Path, model_dir, *, db_url: str | None = None, workers: int = 2,
                       routing: str = "round-robin", backoff_s: float = 0.2, heartbeat_timeout_s: float = 10.0,
                       max_waiting: int = 128, **engine_kwargs) -> FleetServer:
    """One tenant ("acme", standard) and a gateway over `workers` local
    workers, one torch thread each. Round-robin routing by default, so a
    test knows where its requests go."""
    db_url = db_url or f"sqlite+aiosqlite:///{tmp / 'loragw.db'}"
    keys = seed_tenants(db_url, {"acme": Tier.STANDARD})
    engine = EngineConfig(model=str(model_dir), data_dir=str(tmp / "data"), num_threads=1, max_loras=0,
                          **engine_kwargs)
    limits = TierLimits(max_waiting=max_waiting)
    config = GatewayConfig(db_url=db_url, engine=engine, data_dir=tmp / "data", standard=limits, premium=limits)
    supervisor = LocalWorkers(engine, workers, backoff_s=backoff_s, backoff_max_s=max(backoff_s, 30.0),
                              log_level="warning")
    fleet = WorkerFleet(engine, supervisor.endpoints, router=make_router(RoutingConfig(policy=routing), time.monotonic),
                        supervisor=supervisor, heartbeat_timeout_s=heartbeat_timeout_s)
    gw = build_gateway(config, engine=fleet)
    steps: list = []
    fleet.add_usage_sink(steps.append)
    live = start_live_server(gw)
    try:
        # /ready turns 200 with the first worker up: wait for all of them.
        wait_for(lambda: all(c.ready for c in fleet.workers.values()), 120, "every worker to load")
    except AssertionError:
        live.stop()
        raise
    return FleetServer(live, fleet, supervisor, keys["acme"], gw.served_model_name, db_url, steps)


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
