"""Prometheus series of engine snapshots, for the gateway's /metrics (one
series per worker) and a worker's own /metrics (no worker label: a worker
does not know the name its gateway gives it). A worker's /metrics also
speaks the inference extension's model-server protocol
(engine/model_server_metrics.py).

The names and meanings follow vLLM's under the `loragw:` prefix, so its
dashboards carry over; docs/observability.md lists them.
"""

from __future__ import annotations

from typing import Callable

from prometheus_client import Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

from engine.request import Tier
from engine.snapshot import EngineSnapshot

PREFIX = "loragw:"
ADAPTER_LOAD_BUCKETS = (0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0)


class SnapshotCollector(Collector):
    """Reads `snapshots()` ({worker id: latest snapshot}) at scrape time.
    With `label_workers`, every series carries `worker`; the worker ids are
    a fixed list (the configured workers), so the label stays bounded."""

    def __init__(self, snapshots: Callable[[], dict[str, EngineSnapshot]], *, label_workers: bool):
        self._snapshots = snapshots
        self._worker_label = ["worker"] if label_workers else []
        self._load_seconds = Histogram(f"{PREFIX}lora_adapter_load_seconds",
                                       "Seconds to load an adapter into a device slot.", self._worker_label,
                                       buckets=ADAPTER_LOAD_BUCKETS, registry=None)
        self._loads_seen: dict[str, int] = {}

    def collect(self):
        snaps = self._snapshots()
        if not snaps:
            return
        families = _Families(self._worker_label)
        for worker, snap in sorted(snaps.items()):
            labels = [worker] if self._worker_label else []
            families.add(labels, snap)
            self._observe_loads(worker, labels, snap)
        yield from families.all()
        yield from self._load_seconds.collect()

    def _observe_loads(self, worker: str, labels: list[str], snap: EngineSnapshot) -> None:
        # A restarted worker counts from 0 again: then every load it reports is new.
        seen = self._loads_seen.get(worker, 0)
        if snap.adapter_loads < seen:
            seen = 0
        recent = snap.recent_adapter_load_seconds
        new = min(len(recent), snap.adapter_loads - seen)
        histogram = self._load_seconds.labels(*labels) if labels else self._load_seconds
        for seconds in recent[len(recent) - new:]:
            histogram.observe(seconds)
        self._loads_seen[worker] = snap.adapter_loads


class _Families:
    """One scrape's metric families, filled one snapshot at a time."""

    def __init__(self, worker_label: list[str]):
        w = worker_label

        def gauge(name, doc, labels=()):
            return GaugeMetricFamily(f"{PREFIX}{name}", doc, labels=[*labels, *w])

        def counter(name, doc, labels=()):
            return CounterMetricFamily(f"{PREFIX}{name}", doc, labels=[*labels, *w])

        self.running = gauge("num_requests_running", "Number of requests in model execution batches.", ["tier"])
        self.waiting = gauge("num_requests_waiting", "Number of requests waiting to be processed.", ["tier"])
        self.preemptions = counter("num_preemptions",
                                   "Cumulative number of preemptions, by the preempted request's tier.", ["tier"])
        self.steps_dropped = counter("num_steps_dropped",
                                     "Engine steps dropped part way for a premium arrival, to be done again.")
        self.kv_usage = gauge("kv_cache_usage_perc", "KV-cache usage. 1 means 100 percent usage.")
        self.tier_usage = gauge("kv_cache_tier_usage_perc",
                                "Blocks held by the tier's requests over the blocks the tier may use.", ["tier"])
        self.blocks = gauge("kv_cache_blocks", "KV blocks per tier: reserved for it, used by it, free for it to take.",
                            ["tier", "state"])
        self.prefix_queries = counter("prefix_cache_queries",
                                      "Prefix cache queries, in terms of number of queried tokens.")
        self.prefix_hits = counter("prefix_cache_hits", "Prefix cache hits, in terms of number of cached tokens.")
        self.resident = gauge("lora_adapter_resident", "1 for each adapter version in a device slot now.",
                              ["adapter", "version"])
        self.loads = counter("lora_adapter_loads", "Adapter loads into a device slot.")
        self.evictions = counter("lora_adapter_evictions", "Adapters evicted from a device slot.")
        self.spec = spec_decode_counters(counter)

    def add(self, w: list[str], snap: EngineSnapshot) -> None:
        for tier in Tier:
            t = tier.value
            self.running.add_metric([t, *w], snap.num_running.get(tier, 0))
            self.waiting.add_metric([t, *w], snap.num_waiting.get(tier, 0))
            self.preemptions.add_metric([t, *w], snap.num_preemptions.get(tier, 0))
            usable = snap.usable_blocks(tier)
            used = snap.kv_used_by_tier.get(tier, 0)
            self.tier_usage.add_metric([t, *w], used / usable if usable else 0.0)
            reserved = snap.kv_premium_reserved_blocks if tier is Tier.PREMIUM else 0
            self.blocks.add_metric([t, "reserved", *w], reserved)
            self.blocks.add_metric([t, "used", *w], used)
            self.blocks.add_metric([t, "free", *w], snap.kv_free_blocks_for(tier))
        self.steps_dropped.add_metric(w, snap.steps_dropped)
        self.kv_usage.add_metric(w, snap.kv_used_blocks / snap.kv_num_blocks if snap.kv_num_blocks else 0.0)
        self.prefix_queries.add_metric(w, snap.prefix_cache_queries)
        self.prefix_hits.add_metric(w, snap.prefix_cache_hits)
        for name, version, _digest in snap.resident_adapters:
            self.resident.add_metric([name, str(version), *w], 1)
        self.loads.add_metric(w, snap.adapter_loads)
        self.evictions.add_metric(w, snap.adapter_evictions)
        for family, value in zip(self.spec, spec_decode_values(snap)):
            family.add_metric(w, value)

    def all(self):
        return [self.running, self.waiting, self.preemptions, self.steps_dropped, self.kv_usage, self.tier_usage,
                self.blocks, self.prefix_queries, self.prefix_hits, self.resident, self.loads, self.evictions,
                *self.spec]


def spec_decode_counters(counter) -> tuple:
    """vLLM's speculative-decoding counters, made by `counter(name, doc)`
    (which adds the prefix): here `loragw:`, for the model server `vllm:`."""
    return (counter("spec_decode_num_drafts", "Number of spec decoding drafts."),
            counter("spec_decode_num_draft_tokens", "Number of draft tokens."),
            counter("spec_decode_num_accepted_tokens", "Number of accepted tokens."))


def spec_decode_values(snap: EngineSnapshot) -> tuple[int, int, int]:
    return (snap.spec_decode_num_drafts, snap.spec_decode_num_draft_tokens, snap.spec_decode_num_accepted_tokens)


def serve_worker_metrics(snapshot: Callable[[], EngineSnapshot | None], *, port: int, host: str) -> None:
    """A worker's own /metrics on `host:port`, on a daemon thread."""
    from prometheus_client import CollectorRegistry, start_http_server

    from engine.model_server_metrics import ModelServerCollector

    registry = CollectorRegistry()

    def snapshots() -> dict[str, EngineSnapshot]:
        snap = snapshot()
        return {} if snap is None else {"self": snap}

    registry.register(SnapshotCollector(snapshots, label_workers=False))
    registry.register(ModelServerCollector(snapshot))
    start_http_server(port, addr=host, registry=registry)
