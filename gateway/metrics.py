"""Prometheus metrics: vLLM's names and buckets under the `loragw:` prefix,
labelled by tier, with bounded adapter and tenant labels.

`GatewayMetrics` owns its `CollectorRegistry` (no global registry), so
every gateway, and every test, has metrics of its own. Three sources feed it:

- request-level histograms and counters from `on_request_end` (it is a
  `RequestObserver`, registered in `build_gateway`);
- engine state, read at scrape time from the workers' latest snapshots
  (`EngineClient.snapshots()`, engine/snapshot_metrics.py), labelled by
  `worker`; admission state from `AdmissionController.snapshot()`;
- billing, which calls `count_usage` for every metered request.

Label cardinality is documented in docs/observability.md: `tier` (2),
`finished_reason` (5), `reason` (5), `adapter` (at most
`max_adapter_labels` names plus "other" and "base"), `tenant` (at most
`max_tenant_labels` plus "other"). Never a request id.
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

from engine.snapshot_metrics import PREFIX, SnapshotCollector
from gateway.lifecycle import RequestObserver, RequestRecord
from gateway.tenancy import Tier

OTHER = "other"  # the label value once a bounded label is full
BASE_MODEL = "base"  # the adapter label of requests to the base model

# vLLM's buckets (vllm/v1/metrics/loggers.py), so its dashboards carry over;
# TTFT adds 0.4, the default alert threshold, so deploy/prometheus/'s burn
# rates count slow requests exactly.
TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
                20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)
TPOT_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0,
                40.0, 80.0)
REQUEST_LATENCY_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0,
                           120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0)
FINISH_REASONS = ("stop", "length", "abort", "client_disconnect", "error")
REJECT_REASONS = ("max_waiting", "max_queued_tokens", "max_concurrent", "requests_per_minute",
                  "tokens_per_minute")


class BoundedLabel:
    """Label values for an unbounded set (adapters, tenants): the first
    `limit` distinct values keep their own series, every later one is
    "other". First come, first kept, so a series never changes meaning."""

    def __init__(self, limit: int):
        self.limit = limit
        self._kept: set[str] = set()

    def value(self, name: str) -> str:
        if name in self._kept:
            return name
        if len(self._kept) < self.limit:
            self._kept.add(name)
            return name
        return OTHER


class GatewayMetrics(RequestObserver):
    def __init__(self, *, engine, admission, max_adapter_labels: int = 16, max_tenant_labels: int = 32):
        self.registry = CollectorRegistry()
        self._adapters = BoundedLabel(max_adapter_labels)
        self._tenants = BoundedLabel(max_tenant_labels)
        r, by_request = self.registry, ("tier", "adapter")
        self.ttft = Histogram(f"{PREFIX}time_to_first_token_seconds", "Histogram of time to first token in seconds.",
                              by_request, buckets=TTFT_BUCKETS, registry=r)
        self.tpot = Histogram(f"{PREFIX}time_per_output_token_seconds",
                              "Histogram of time per output token in seconds.", by_request,
                              buckets=TPOT_BUCKETS, registry=r)
        self.e2e = Histogram(f"{PREFIX}e2e_request_latency_seconds",
                             "Histogram of end to end request latency in seconds (gateway: admitted to ended).",
                             by_request, buckets=REQUEST_LATENCY_BUCKETS, registry=r)
        self.queue = Histogram(f"{PREFIX}request_queue_time_seconds",
                               "Histogram of time spent in WAITING phase for request.", by_request,
                               buckets=REQUEST_LATENCY_BUCKETS, registry=r)
        self.success = Counter(f"{PREFIX}request_success", "Count of processed requests by finish reason.",
                               ("tier", "finished_reason"), registry=r)
        self.prompt_tokens = Counter(f"{PREFIX}prompt_tokens", "Number of prefill tokens processed.", ("tier",),
                                     registry=r)
        self.generation_tokens = Counter(f"{PREFIX}generation_tokens", "Number of generation tokens processed.",
                                         ("tier",), registry=r)
        self.tenant_gpu_seconds = Counter(f"{PREFIX}tenant_gpu_seconds", "GPU-seconds billed to the tenant.",
                                          ("tenant",), registry=r)
        self.tenant_prompt_tokens = Counter(f"{PREFIX}tenant_prompt_tokens", "Prompt tokens billed to the tenant.",
                                            ("tenant",), registry=r)
        self.tenant_generation_tokens = Counter(f"{PREFIX}tenant_generation_tokens",
                                                "Generated tokens billed to the tenant.", ("tenant",), registry=r)
        for tier in Tier:  # every tier's series exist from the start, so rate() sees the first request
            for reason in FINISH_REASONS:
                self.success.labels(tier.value, reason)
            self.prompt_tokens.labels(tier.value)
            self.generation_tokens.labels(tier.value)
        r.register(_AdmissionCollector(admission))
        # Engine state from the workers' snapshots, one series per worker.
        r.register(SnapshotCollector(engine.snapshots, label_workers=True))

    # ---- sources --------------------------------------------------------------

    def on_request_end(self, record: RequestRecord) -> None:
        tier = record.tier.value
        labels = (tier, self._adapters.value(record.adapter) if record.adapter else BASE_MODEL)
        self.success.labels(tier, record.finish_reason).inc()
        self.prompt_tokens.labels(tier).inc(record.prompt_tokens)
        self.generation_tokens.labels(tier).inc(record.completion_tokens)
        self.e2e.labels(*labels).observe(record.e2e_s)
        if record.ttft_s is not None:
            self.ttft.labels(*labels).observe(record.ttft_s)
        if record.queue_time_s is not None:
            self.queue.labels(*labels).observe(record.queue_time_s)
        tpot = time_per_output_token(record)
        if tpot is not None:
            self.tpot.labels(*labels).observe(tpot)

    def count_usage(self, tenant: str, gpu_us: int, prompt_tokens: int, completion_tokens: int) -> None:
        """Billing's per-request usage: GPU microseconds and tokens, by tenant."""
        label = self._tenants.value(tenant)
        self.tenant_gpu_seconds.labels(label).inc(gpu_us / 1e6)
        self.tenant_prompt_tokens.labels(label).inc(prompt_tokens)
        self.tenant_generation_tokens.labels(label).inc(completion_tokens)

    def render(self) -> bytes:
        """The text exposition format, for `GET /metrics`."""
        return generate_latest(self.registry)


def time_per_output_token(record: RequestRecord) -> float | None:
    """Decode seconds per generated token after the first, on the engine's
    clock; None when there was no second token."""
    m = record.engine_metrics
    if m is None or m.first_token_time is None or m.finished_time is None or record.completion_tokens < 2:
        return None
    return (m.finished_time - m.first_token_time) / (record.completion_tokens - 1)


class _AdmissionCollector(Collector):
    """Admission state, read when Prometheus scrapes."""

    def __init__(self, admission):
        self._admission = admission

    def collect(self):
        waiting = GaugeMetricFamily(f"{PREFIX}admission_waiting_requests",
                                    "Admitted requests without a first token yet (the tier's 429 queue).",
                                    labels=["tier"])
        queued = GaugeMetricFamily(f"{PREFIX}admission_queued_prompt_tokens",
                                   "Prompt tokens held by the tier's admitted, waiting requests.", labels=["tier"])
        rejected = CounterMetricFamily(f"{PREFIX}rejected_requests", "Requests refused with 429, by limit.",
                                       labels=["tier", "reason"])
        for tier, snap in self._admission.snapshot().items():
            waiting.add_metric([tier], snap["waiting"])
            queued.add_metric([tier], snap["queued_tokens"])
            for reason in sorted(set(REJECT_REASONS) | set(snap["rejected"])):
                rejected.add_metric([tier, reason], snap["rejected"].get(reason, 0))
        yield from (waiting, queued, rejected)
        limiter = self._admission.limiter_health()
        if limiter.backend == "redis":  # only where --redis-url is set
            yield GaugeMetricFamily(f"{PREFIX}redis_up", "1 while the tenant limits' Redis answers, 0 while "
                                    "this gateway judges them by its --redis-failure-mode.",
                                    value=1 if limiter.up else 0)
