"""Gateway configuration: what `loragw serve` takes as flags or LORAGW_*
variables. The flags are generated from these fields (engine/config_flags.py)."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from billing.pricing import PriceBook
from engine.config import CacheConfig, EngineConfig, SchedulerConfig
from engine.config_flags import section, setting
from engine.host_cpu import WORKER_NICENESS
from gateway.slo import SloConfig

# Shorter tokens are refused at start: the admin token guards every tenant,
# key and adapter, and /metrics. 32 random hex characters are 128 bits, too
# many to guess online.
MIN_ADMIN_TOKEN_CHARS = 32
ROUTING_POLICIES = ("affinity", "round-robin")


class ConfigError(ValueError):
    """A `loragw serve` setting that cannot work; `loragw serve` prints it and exits 1."""


@dataclass(frozen=True)
class TierLimits:
    """Admission limits for one tier, checked before a request reaches the engine.

    `max_waiting`: requests admitted to the engine that have not produced
    their first token yet. `max_queued_tokens`: the prompt tokens those
    waiting requests hold; None derives it from the tier's share of the KV
    cache times `kv_overcommit`, so the queue never holds much more work than
    the cache can start on."""

    max_waiting: int = setting(64, help="requests of this tier queued before 429")
    max_queued_tokens: int | None = setting(
        None, help="prompt tokens this tier's queue may hold before 429; default: its KV share times kv-overcommit")
    kv_overcommit: float = setting(2.0, help="queued prompt tokens per token of this tier's KV share")
    # Judged from the tier's recent engine steps and the first tokens each started (gateway.admission).
    max_queue_wait_s: float | None = setting(
        None, zero_is_none=True,
        help="seconds a request of this tier may expect to queue before its first token, else 429 (0: no bound)")


@dataclass(frozen=True)
class WorkerPoolConfig:
    """The engine workers behind this gateway: local processes it starts and
    supervises, and workers that run elsewhere and are attached by address."""

    workers: int = setting(1, help="local engine worker processes to start and supervise")
    worker_devices: str | None = setting(
        None, help="comma-separated devices, one per local worker (e.g. cuda:0,cuda:1); default: auto")
    worker_niceness: int = setting(
        WORKER_NICENESS, flag="--worker-nice",
        help="how much nicer than the gateway a local CPU worker runs, 0-19, so that its spinning threads "
             "yield the cores to the event loop (0: the same priority)")
    worker_endpoints: tuple[str, ...] = setting(
        (), flag="--worker", help="attach a worker that runs elsewhere, e.g. tcp://10.0.0.5:7100 (repeatable)")
    # The shared secret the gateway presents to a non-loopback worker. Never
    # on argv: the CLI reads it from --worker-secret-file or $LORAGW_WORKER_SECRET.
    worker_secret: str | None = setting(None, flag=None, repr=False, help="the workers' shared secret")
    heartbeat_timeout_s: float = setting(10.0, flag="--worker-heartbeat-timeout",
                                         help="seconds without a heartbeat before a worker is treated as dead")
    restart_backoff_s: float = setting(1.0, flag="--worker-restart-backoff",
                                       help="seconds before a dead local worker's first restart")
    restart_backoff_max_s: float = setting(30.0, flag="--worker-restart-backoff-max",
                                           help="the longest wait between restarts of a worker that keeps dying")
    # Round-robin is the baseline that routing tests and benchmarks compare against.
    routing: str = setting("affinity", choices=ROUTING_POLICIES,
                           help="how a request picks its worker: affinity (adapter residency, prefix, KV "
                                "headroom, queue depth) or round-robin")
    # Ray (gateway/workers/ray_pool.py): the cluster places, restarts and
    # names the workers; the gateway scales them on queue depth.
    ray_address: str | None = setting(
        None, flag="--ray", help="run the workers on this Ray cluster (an address, or auto) instead of locally")
    ray_min_workers: int = setting(1, help="Ray workers kept running however idle the fleet is")
    ray_max_workers: int = setting(1, help="Ray workers the queue may grow the fleet to")
    ray_gpus_per_worker: float = setting(1.0, help="GPUs Ray reserves per worker (0: CPU-only workers)")
    ray_cpus_per_worker: float = setting(1.0, help="CPUs Ray reserves per worker")
    scale_target_waiting: float = setting(
        4.0, help="add a Ray worker when more requests than this wait per worker")
    scale_down_after_s: float = setting(60.0, help="remove a Ray worker after the queue has been empty this long")
    scale_cooldown_s: float = setting(30.0, help="seconds between two scaling decisions")

    def __post_init__(self):
        if self.ray_address is not None:
            if self.workers not in (0, 1) or self.worker_endpoints:
                raise ConfigError("--ray runs every worker on the cluster: drop --workers and --worker")
            if not self.worker_secret:
                raise ConfigError("--ray needs --worker-secret-file (or LORAGW_WORKER_SECRET): Ray workers "
                                  "listen on the network, and every gateway replica presents the same secret")
            if not 0 <= self.ray_min_workers <= self.ray_max_workers or self.ray_max_workers < 1:
                raise ConfigError("need 0 <= --ray-min-workers <= --ray-max-workers and --ray-max-workers >= 1")
        elif self.workers < 0 or self.workers + len(self.worker_endpoints) < 1:
            raise ConfigError("need at least one worker: --workers N (local) or --worker ENDPOINT")
        if not 0 <= self.worker_niceness <= 19:
            raise ConfigError(f"--worker-nice must be 0-19 (the niceness added), not {self.worker_niceness}")
        devices = self.worker_devices.split(",") if self.worker_devices else []
        if devices and len(devices) != self.workers:
            raise ConfigError(f"--worker-devices names {len(devices)} devices for {self.workers} local workers")
        if not 0 < self.restart_backoff_s <= self.restart_backoff_max_s or self.heartbeat_timeout_s <= 0:
            raise ConfigError("need 0 < --worker-restart-backoff <= --worker-restart-backoff-max and a "
                              "positive --worker-heartbeat-timeout")
        if self.routing not in ROUTING_POLICIES:
            raise ConfigError(f"routing must be one of {ROUTING_POLICIES}")
        for endpoint in self.worker_endpoints:
            if not endpoint.startswith(("tcp://", "ipc://")):
                raise ConfigError(f"--worker {endpoint}: a worker's address is tcp://HOST:PORT or ipc://PATH")


@dataclass(frozen=True)
class RedisLimitsConfig:
    """Tenant limits shared by several gateway replicas through one Redis
    (docs/gateway.md, "Several gateway replicas"). Without a URL they live
    in each gateway's memory.

    The default failure mode is `local`: an outage of the limits' store
    then costs the limits' precision across replicas (each enforces them
    alone, so a tenant spread over N replicas may get up to N times its
    limits), not the service itself. `refuse` is for operators whose limits
    must never be exceeded, at the price of 503s while Redis is down."""

    # repr=False: a URL may carry Redis's password.
    url: str | None = setting(None, repr=False,
                              help="redis://[:password@]host:port/db holding the tenant limits, shared by every "
                                   "replica that names it; unset: limits in this gateway's memory")
    failure_mode: str = setting(
        "local", choices=("local", "refuse"),
        help="while Redis is unreachable: local (this gateway's in-memory limits, per replica) or refuse (503)")
    # Longer than --max-stream-seconds, so that only a dead replica's holds lapse.
    lease_s: float = setting(900.0, help="seconds a request's concurrency slot lasts in Redis unless released: "
                                         "bounds what a replica that died mid-request leaves held")
    timeout_s: float = setting(0.5, help="seconds to wait on Redis before judging it unreachable")

    def __post_init__(self):
        if self.failure_mode not in ("local", "refuse"):
            raise ConfigError(f"--redis-failure-mode must be local or refuse, not {self.failure_mode!r}")
        if self.lease_s <= 0 or self.timeout_s <= 0:
            raise ConfigError("--redis-lease and --redis-timeout must be positive")


def serving_engine_config() -> EngineConfig:
    """The engine defaults of `loragw serve`'s workers and `loragw worker`:
    the one place where serving differs from `LLM()`.

    Offline, every request is standard by default, so a premium reserve
    would only shrink the cache and a standard prefill cap would only slow
    the batch. Serving mixes tiers: 20% of the KV cache stays free for
    premium, and while premium requests come (SchedulerConfig's window)
    standard prefill is capped at 128 tokens a step, so that a premium
    arrival waits out a short step (benchmarks/tiers.py: 256 missed the
    premium target on a 2-core CPU, 64 the throughput one; step time grows
    with every token there, on a GPU raise the cap)."""
    return EngineConfig(
        scheduler=SchedulerConfig(max_standard_prefill_tokens=128),
        cache=CacheConfig(premium_reserved_fraction=0.2))


@dataclass
class GatewayConfig:
    host: str = setting("127.0.0.1", help="interface to listen on")
    port: int = setting(8000, help="port to listen on")
    db_url: str | None = setting(
        None, flag="--db", help="SQLAlchemy URL (sqlite+aiosqlite:///... or postgresql+asyncpg://...); default: "
                                "loragw.db in the data directory ($LORAGW_DATA_DIR)")
    admin_token: str | None = setting(
        None, help="bearer token of the /admin API and /metrics, 32+ characters (visible in ps: prefer "
                   "--admin-token-file or the env variable); unset: /admin refuses everyone")
    # A second listener serves /metrics alone, without auth, for Prometheus.
    metrics_port: int | None = setting(
        None, help="serve /metrics without auth on this port (on --metrics-host; 0: any free port), for "
                   "Prometheus; unset: /metrics only on --port, behind the admin token")
    metrics_host: str = setting("127.0.0.1", help="interface of the --metrics-port listener")
    # The embedded SQLite (no db_url) always gets the demo tenant.
    demo_tenant: bool = setting(False, help="create the 'demo' tenant on an empty --db too (always done for the "
                                            "default SQLite database)")
    # The engine section's flags, tiers (`--no-tiers`) included, are the engine's own.
    engine: EngineConfig = section(serving_engine_config, title="engine")
    served_model_name: str | None = setting(
        None, help="the base model's id in the API; default: the checkpoint directory's name")
    premium: TierLimits = section(lambda: TierLimits(max_waiting=64), prefix="premium-", title="premium tier")
    standard: TierLimits = section(lambda: TierLimits(max_waiting=64, max_queue_wait_s=10.0),
                                   prefix="standard-", title="standard tier")
    drain_timeout_s: float = setting(30.0, help="seconds in-flight requests get after SIGTERM")
    # Ten minutes is the OpenAI Python client's own default timeout, and time
    # for a max-length answer at a few tokens per second under load; it
    # bounds how long a stalled reader holds a sequence slot and its
    # undelivered output.
    max_stream_seconds: float | None = setting(
        600.0, zero_is_none=True, help="a streamed response's longest life; past it the request is aborted and "
                                       "the stream ends with an error event (0: no limit)")
    # Bounds at the edge (docs/gateway.md, "Limits"): a body over the limit
    # is refused while it is read, never buffered.
    max_upload_bytes: int = setting(256 * 1024 * 1024, help="largest adapter upload (POST /admin/adapters)")
    max_request_bytes: int = setting(
        4 * 1024 * 1024, help="largest request body; more is refused with 413 while it is read (adapter uploads: "
                              "--max-upload-bytes)")
    max_header_bytes: int = setting(64 * 1024, help="largest request line plus headers; more is refused with 431")
    # nginx's client_header_timeout and client_body_timeout are 60 s each;
    # this one bounds the whole request, so it starts lower and grows with
    # what arrives (gateway/http_protocol.py).
    request_read_timeout_s: float | None = setting(
        30.0, zero_is_none=True,
        help="seconds a client gets to send a request's head and body, one more for each KiB received; past it "
             "the request gets 408 and its connection is closed (0: no limit)")
    # More requests than this wait their turn; the event loop never tokenizes.
    prepare_threads: int = setting(4, help="worker threads that parse, template and tokenize requests off the "
                                           "event loop")
    data_dir: Path | None = setting(None, flag=None, help="None: $LORAGW_DATA_DIR or the user data dir")
    prices: PriceBook = setting(default_factory=PriceBook, flag=None, help="per tier, applied to usage exports "
                                                                           "(the --price flags)")
    # The first N adapters / tenants seen get a series of their own, the rest
    # share "other" (docs/observability.md).
    metrics_adapter_labels: int = setting(16, help="adapters with their own metrics series; more: 'other'")
    metrics_tenant_labels: int = setting(32, help="tenants with their own metrics series; more: 'other'")
    slo: SloConfig = section(SloConfig, prefix="slo-", title="TTFT SLO and its page")
    # The auth cache (gateway/auth_cache.py): revocation, tenant deletion and
    # limit changes take effect within the TTL.
    auth_cache_ttl_s: float = setting(
        5.0, help="seconds an API key's tenant and the adapter grants are reused before the database is asked "
                  "again: the bound on how late a revocation or limit change takes effect (0: ask every time)")
    auth_cache_stale_s: float = setting(
        60.0, help="while the database is unavailable, seconds past the TTL that recently used keys keep working")
    auth_cache_max_entries: int = setting(
        10_000, flag="--auth-cache-size",
        help="most keys (and, apart, adapter grants) held in the auth cache; least recently used go first")
    worker_pool: WorkerPoolConfig = section(WorkerPoolConfig, title="engine workers")
    redis: RedisLimitsConfig = section(RedisLimitsConfig, prefix="redis-", title="tenant limits across replicas")

    def __post_init__(self):
        if self.admin_token is not None and len(self.admin_token) < MIN_ADMIN_TOKEN_CHARS:
            raise ConfigError(f"the admin token has {len(self.admin_token)} characters; it needs at least "
                              f"{MIN_ADMIN_TOKEN_CHARS} (e.g. `openssl rand -hex 32`)")

    @property
    def enable_tiers(self) -> bool:
        """Tiers off (`--no-tiers`) means plain FCFS: no premium reserve, no
        tier ordering, no admission limits (the baseline of
        benchmarks/tiers.py). The engine's setting is the one switch."""
        return self.engine.scheduler.enable_tiers

    @property
    def creates_demo_tenant(self) -> bool:
        return self.db_url is None or self.demo_tenant

    def resolved_data_dir(self) -> Path:
        from adapters.registry import default_data_dir

        return Path(self.data_dir) if self.data_dir is not None else default_data_dir()

    def resolved_db_url(self) -> str:
        if self.db_url:
            return self.db_url
        path = self.resolved_data_dir() / "loragw.db"
        path.parent.mkdir(parents=True, exist_ok=True)
        return f"sqlite+aiosqlite:///{path}"


def secret_from(value: str | None, path: str | None, *, what: str, sources: str) -> str | None:
    """A secret given as `value` (a flag or a variable) or as the first line
    of the file at `path`, not both; `sources` names them for the error."""
    if not path:
        return value or None
    if value:
        raise ConfigError(f"give the {what} once: {sources}")
    with open(path, encoding="utf-8") as file:
        secret = file.readline().strip()
    if not secret:
        raise ConfigError(f"the {what} file {path} is empty")
    return secret
