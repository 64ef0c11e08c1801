"""Gateway configuration: what `loragw serve` takes as flags or LORAGW_* env."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from billing.pricing import PriceBook
from engine.config import EngineConfig
from gateway.slo import SloConfig


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
    max_upload_bytes: int = 256 * 1024 * 1024
    data_dir: Path | None = None  # None: $LORAGW_DATA_DIR or the user data dir
    prices: PriceBook = field(default_factory=PriceBook)  # per tier, applied to usage exports
    # Metrics label bounds: the first N adapters / tenants seen get a series
    # of their own, the rest share "other" (docs/observability.md).
    metrics_adapter_labels: int = 16
    metrics_tenant_labels: int = 32
    slo: SloConfig = field(default_factory=SloConfig)

    def resolved_data_dir(self) -> Path:
        from adapters.registry import default_data_dir

        return Path(self.data_dir) if self.data_dir is not None else default_data_dir()

    def resolved_db_url(self) -> str:
        if self.db_url:
            return self.db_url
        path = self.resolved_data_dir() / "loragw.db"
        path.parent.mkdir(parents=True, exist_ok=True)
        return f"sqlite+aiosqlite:///{path}"
