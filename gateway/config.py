"""Gateway configuration: what `loragw serve` takes as flags or LORAGW_* env."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from billing.pricing import PriceBook
from engine.config import EngineConfig
from gateway.slo import SloConfig

# Shorter tokens are refused at start: the admin token guards every tenant,
# key and adapter, and /metrics. 32 random hex characters are 128 bits, too
# many to guess online.
MIN_ADMIN_TOKEN_CHARS = 32


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

    max_waiting: int = 64
    max_queued_tokens: int | None = None
    kv_overcommit: float = 2.0
    # Refuse a request the queue would hold longer than this before its first
    # token, judged from the tier's recent rate of first tokens. None: no bound.
    max_queue_wait_s: float | None = None


@dataclass
class GatewayConfig:
    host: str = "127.0.0.1"
    port: int = 8000
    db_url: str | None = None  # None: SQLite in the data directory
    admin_token: str | None = None  # None: the admin API answers 401 to everyone
    # None: /metrics only on the public port, behind the admin token. A port
    # (0: any free one): a second listener on metrics_host serving /metrics
    # alone, without auth, for Prometheus.
    metrics_port: int | None = None
    metrics_host: str = "127.0.0.1"
    # The `demo` tenant on an empty database: always for the embedded SQLite
    # (no db_url), otherwise only when asked for.
    demo_tenant: bool = False
    engine: EngineConfig = field(default_factory=EngineConfig)
    served_model_name: str | None = None  # None: the checkpoint directory's name
    # Tiers off means plain FCFS: no premium reserve, no tier ordering, no
    # admission limits (the baseline of benchmarks/tiers.py).
    enable_tiers: bool = True
    premium: TierLimits = field(default_factory=lambda: TierLimits(max_waiting=64))
    standard: TierLimits = field(default_factory=lambda: TierLimits(max_waiting=64, max_queue_wait_s=10.0))
    drain_timeout_s: float = 30.0
    # A stream's longest life, from its first byte; then it is aborted and
    # ends with an error event. Ten minutes is the OpenAI Python client's own
    # default timeout, and time for a max-length answer at a few tokens per
    # second under load; it bounds how long a stalled reader holds a sequence
    # slot and its undelivered output. None: no deadline.
    max_stream_seconds: float | None = 600.0
    max_upload_bytes: int = 256 * 1024 * 1024  # POST /admin/adapters, the one route with a larger body limit
    # Bounds at the edge (docs/gateway.md, "Limits"). A body over
    # `max_request_bytes` is refused with 413 while it is read, never
    # buffered; a request head (request line and headers) over
    # `max_header_bytes` gets 431 from the HTTP parser.
    max_request_bytes: int = 4 * 1024 * 1024
    max_header_bytes: int = 64 * 1024
    # Worker threads that parse, template and tokenize /v1 requests, so the
    # event loop never does; more requests than this wait their turn.
    prepare_threads: int = 4
    data_dir: Path | None = None  # None: $LORAGW_DATA_DIR or the user data dir
    prices: PriceBook = field(default_factory=PriceBook)  # per tier, applied to usage exports
    # Metrics label bounds: the first N adapters / tenants seen get a series
    # of their own, the rest share "other" (docs/observability.md).
    metrics_adapter_labels: int = 16
    metrics_tenant_labels: int = 32
    slo: SloConfig = field(default_factory=SloConfig)
    # The auth cache (gateway/auth_cache.py): a key's principal and the
    # adapter grants are reused this long, so revocation, tenant deletion and
    # limit changes take effect within auth_cache_ttl_s; while the database
    # is down, recently used entries serve auth_cache_stale_s longer.
    auth_cache_ttl_s: float = 5.0
    auth_cache_stale_s: float = 60.0
    auth_cache_max_entries: int = 10_000

    def __post_init__(self):
        if self.admin_token is not None and len(self.admin_token) < MIN_ADMIN_TOKEN_CHARS:
            raise ConfigError(f"the admin token has {len(self.admin_token)} characters; it needs at least "
                              f"{MIN_ADMIN_TOKEN_CHARS} (e.g. `openssl rand -hex 32`)")

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
