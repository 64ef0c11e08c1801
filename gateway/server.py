"""`loragw serve` in process: build the gateway, run it under uvicorn, and
drain it gracefully on SIGTERM.

The drain: the first SIGTERM (or Ctrl-C) sets `gateway.draining`, so new
/v1 requests get 503 and /ready turns 503 while the listener stays open (a
load balancer sees the 503s instead of refused connections). In-flight
requests, running streams included, go on until `gateway.in_flight` is 0
or `drain_timeout_s` passes; then uvicorn stops, the engine shuts down and
the process exits 0. A second signal stops at once.

With `--metrics-port`, a second uvicorn server in the same event loop serves
/metrics alone on `--metrics-host` (docs/observability.md); it runs and
stops with the public one.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import signal
import socket
import time
from dataclasses import dataclass

import uvicorn

from engine.heap import freeze_startup_heap
from gateway.app import Gateway, create_app
from gateway.config import ConfigError, GatewayConfig
from gateway.demo_tenant import announce_demo_key, ensure_demo_tenant
from gateway.engine_client import EngineClient
from gateway.http_protocol import GatewayH11Protocol
from gateway.metrics import GatewayMetrics
from gateway.routes.observability import metrics_app
from gateway.slo import SloMonitor
from gateway.tenancy import Tier
from gateway.tracing import Tracing, TracingObserver

log = logging.getLogger(__name__)

# Requests still running when the drain timed out get this long before uvicorn cancels them.
_FORCE_STOP_S = 2.0


def build_gateway(config: GatewayConfig, *, engine: EngineClient | None = None, log_level: str = "info") -> Gateway:
    """The production wiring: SQL store, the engine workers (`engine`
    replaces them: tests pass an InProcessEngineClient), admission control
    judged against the fleet's capacity."""
    from gateway.admission import AdmissionController
    from gateway.store.sql import SqlStore
    from gateway.tenant_limits import make_tenant_limiter
    from gateway.workers.fleet import build_fleet

    store = SqlStore.from_url(config.resolved_db_url())
    if engine is None:
        engine = build_fleet(config, log_level=log_level)
    limiter = make_tenant_limiter(config, clock=time.monotonic)
    admission = AdmissionController({Tier.PREMIUM: config.premium, Tier.STANDARD: config.standard},
                                    lambda: engine.kv_capacity, enabled=config.enable_tiers,
                                    clock=time.monotonic, tenant_limiter=limiter)
    gateway = Gateway(config=config, store=store, engine=engine, admission=admission, clock=time.monotonic,
                      background=[limiter])
    add_observability(gateway, tracing=Tracing.from_env())
    add_billing(gateway)
    return gateway


def add_billing(gateway: Gateway) -> None:
    """The meter on the engine's step usage; records via the spool (in the
    data directory) to the ledger in the gateway's database."""
    from billing.ledger import Ledger
    from gateway.metering import build_usage_observer

    build_usage_observer(gateway, spool_path=gateway.config.resolved_data_dir() / "usage-spool.db",
                         ledger=Ledger(gateway.store.engine))


def add_observability(gateway: Gateway, *, tracing: Tracing | None) -> None:
    """Metrics, traces (None: off) and the SLO monitor, registered as the
    gateway's request observers."""
    config = gateway.config
    gateway.metrics = GatewayMetrics(engine=gateway.engine, admission=gateway.admission,
                                     max_adapter_labels=config.metrics_adapter_labels,
                                     max_tenant_labels=config.metrics_tenant_labels)
    gateway.slo = SloMonitor(config.slo, clock=gateway.clock, wall_clock=gateway.wall_clock)
    gateway.observers += [gateway.metrics, gateway.slo]
    if tracing is not None:
        gateway.tracing = tracing
        gateway.observers.append(TracingObserver(tracing))


class MetricsServer(uvicorn.Server):
    """The `--metrics-port` listener. The public server owns the signals
    (and the drain) and stops this one after itself."""

    @contextlib.contextmanager
    def capture_signals(self):
        yield


@dataclass
class MetricsListener:
    server: MetricsServer
    # Bound when the server is made, so a taken port fails `loragw serve` at
    # once and a test knows the port (0: the OS picks) before serving.
    socket: socket.socket

    @property
    def port(self) -> int:
        return self.socket.getsockname()[1]


def http_protocol(config: GatewayConfig):
    """The HTTP/1.1 protocol both listeners serve, with the request read
    deadline (gateway/http_protocol.py)."""
    return functools.partial(GatewayH11Protocol, read_timeout_s=config.request_read_timeout_s)


def make_metrics_listener(gateway: Gateway, *, log_level: str = "info") -> MetricsListener:
    config = gateway.config
    family = socket.AF_INET6 if ":" in config.metrics_host else socket.AF_INET
    try:
        sock = socket.create_server((config.metrics_host, config.metrics_port), family=family)
    except OSError as exc:
        raise ConfigError(f"--metrics-port {config.metrics_port} on {config.metrics_host}: {exc}") from exc
    # No access log: Prometheus scrapes every few seconds.
    uv_config = uvicorn.Config(metrics_app(gateway), log_level=log_level, lifespan="off", access_log=False,
                               http=http_protocol(config), h11_max_incomplete_event_size=config.max_header_bytes)
    listener = MetricsListener(MetricsServer(uv_config), sock)
    log.info("metrics on http://%s:%d/metrics", config.metrics_host, listener.port)
    return listener


class DrainingServer(uvicorn.Server):
    def __init__(self, config: uvicorn.Config, gateway: Gateway, drain_timeout_s: float,
                 metrics: MetricsListener | None = None):
        super().__init__(config)
        self.gateway = gateway
        self.metrics = metrics
        self.drain_timeout_s = drain_timeout_s
        self._loop: asyncio.AbstractEventLoop | None = None
        self._drain: asyncio.Task | None = None
        # Once the engine client is ready: the fleet loads the tokenizer and
        # the adapter registry in a thread after the lifespan has started
        # (gateway/workers/fleet.py), and what they import is part of the
        # startup heap. Not in a test process, which would keep it frozen (engine/heap.py).
        self.freeze_heap_when_ready = False
        self._freeze: asyncio.Task | None = None

    async def startup(self, sockets=None) -> None:
        await super().startup(sockets)
        if self.freeze_heap_when_ready and not self.should_exit:
            self._freeze = asyncio.ensure_future(self._freeze_heap_when_ready())

    async def _freeze_heap_when_ready(self) -> None:
        while not self.gateway.engine.ready:
            await asyncio.sleep(0.1)
        log.info("%d startup objects frozen", freeze_startup_heap())

    async def serve(self, sockets=None) -> None:
        self._loop = asyncio.get_running_loop()
        if self.metrics is None:
            await super().serve(sockets)
            return
        metrics = asyncio.ensure_future(self.metrics.server.serve(sockets=[self.metrics.socket]))
        try:
            await super().serve(sockets)
        finally:
            self.metrics.server.should_exit = True
            await metrics

    def handle_exit(self, sig: int, frame) -> None:
        # Not uvicorn's: it would stop listening at once and re-raise the
        # signal after shutdown (so the process would not exit 0).
        if self.gateway.draining or self._loop is None:
            if sig == signal.SIGINT and self.should_exit:
                self.force_exit = True
            self.should_exit = True
            return
        log.info("signal %s: draining (up to %.0fs for %d in-flight requests)",
                 signal.Signals(sig).name, self.drain_timeout_s, self.gateway.in_flight)
        self.begin_drain()

    def begin_drain(self) -> None:
        """Start draining; safe from a signal handler or another thread."""
        self.gateway.draining = True
        self._loop.call_soon_threadsafe(self._start_drain_task)

    def _start_drain_task(self) -> None:
        if self._drain is None:
            self._drain = asyncio.ensure_future(self._wait_for_in_flight())

    async def _wait_for_in_flight(self) -> None:
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.drain_timeout_s
        while self.gateway.in_flight > 0 and loop.time() < deadline:
            await asyncio.sleep(0.05)
        if self.gateway.in_flight > 0:
            log.warning("drain timeout: stopping with %d requests still running", self.gateway.in_flight)
        else:
            log.info("drained; stopping")
        self.should_exit = True


def make_server(gateway: Gateway, *, log_level: str = "info") -> DrainingServer:
    config = gateway.config
    # The HTTP parser is pinned, with its head limit, rather than left to
    # uvicorn's choice of whatever is installed (gateway/http_protocol.py).
    uv_config = uvicorn.Config(create_app(gateway), host=config.host, port=config.port, log_level=log_level,
                               lifespan="on", timeout_graceful_shutdown=_FORCE_STOP_S,
                               http=http_protocol(config), h11_max_incomplete_event_size=config.max_header_bytes)
    metrics = None if config.metrics_port is None else make_metrics_listener(gateway, log_level=log_level)
    return DrainingServer(uv_config, gateway, config.drain_timeout_s, metrics)


async def serve(config: GatewayConfig, *, log_level: str = "info") -> None:
    """Build the gateway, create the demo tenant where the config asks for
    it (demo_tenant.py), and serve until drained. The schema must already be
    migrated."""
    gateway = build_gateway(config, log_level=log_level)
    server = make_server(gateway, log_level=log_level)
    issued = await ensure_demo_tenant(config, gateway.store, gateway.wall_clock())
    if issued is not None:
        announce_demo_key(issued)
    server.freeze_heap_when_ready = True
    await server.serve()
