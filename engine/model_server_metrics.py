"""A worker's /metrics in the model-server protocol of the Kubernetes
Gateway API Inference Extension, beside loragw's own names, so an endpoint
picker that speaks it (llm-d's, the extension's reference EPP) can score
loragw workers as it scores vLLM pods.

The names and meanings are the protocol's, as written in
kubernetes-sigs/gateway-api-inference-extension,
docs/proposals/003-model-server-protocol/README.md (the "Metrics Reporting"
table and "LoRA Adapter Serving"), which names vLLM's series:

- `vllm:num_requests_waiting`, `vllm:num_requests_running`: gauges, all tiers;
- `vllm:kv_cache_usage_perc`: a gauge from 0 to 1 (KV blocks in use over all
  blocks; cached blocks nobody holds count as free, as in vLLM);
- `vllm:cache_config_info{block_size, num_gpu_blocks}`: an info gauge of 1;
  the EPP's prefix scorer reads both labels;
- `vllm:spec_decode_num_drafts`, `vllm:spec_decode_num_draft_tokens`,
  `vllm:spec_decode_num_accepted_tokens`: vLLM's speculative-decoding
  counters (not in the protocol; dashboards built for vLLM read them);
- `vllm:lora_requests_info{max_lora, running_lora_adapters,
  waiting_lora_adapters}`: a gauge whose value is the time of the update
  (the EPP takes the series with the largest value as the current one). The
  labels are comma-separated adapter names: running = loaded in device memory
  and ready to serve (our device slots), waiting = wanted by requests that
  wait to be served; `max_lora` = the adapters a batch can hold (our slots).

An adapter is listed by its name, the `model` a client sends for its newest
version: that is what the EPP compares with the request's model.
"""

from __future__ import annotations

import time
from typing import Callable

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

from engine.snapshot import EngineSnapshot
from engine.snapshot_metrics import spec_decode_counters, spec_decode_values


def _names(keys: tuple[tuple[str, int, str], ...]) -> str:
    return ",".join(dict.fromkeys(name for name, _version, _digest in keys))


class ModelServerCollector(Collector):
    """Reads `snapshot()` at scrape time; nothing before the model loaded.
    `clock` (wall seconds) stamps the LoRA series: the state a snapshot
    describes holds until the next step, so it is current at the scrape."""

    def __init__(self, snapshot: Callable[[], EngineSnapshot | None], clock: Callable[[], float] = time.time):
        self._snapshot = snapshot
        self._clock = clock

    def collect(self):
        snap = self._snapshot()
        if snap is None:
            return
        waiting = GaugeMetricFamily("vllm:num_requests_waiting", "Number of requests waiting to be processed.")
        waiting.add_metric([], sum(snap.num_waiting.values()))
        running = GaugeMetricFamily("vllm:num_requests_running", "Number of requests in model execution batches.")
        running.add_metric([], sum(snap.num_running.values()))
        usage = GaugeMetricFamily("vllm:kv_cache_usage_perc", "KV-cache usage. 1 means 100 percent usage.")
        usage.add_metric([], snap.kv_used_blocks / snap.kv_num_blocks if snap.kv_num_blocks else 0.0)
        cache = GaugeMetricFamily("vllm:cache_config_info", "Information of the KV cache configuration.",
                                  labels=["block_size", "num_gpu_blocks"])
        cache.add_metric([str(snap.block_size), str(snap.kv_num_blocks)], 1)
        lora = GaugeMetricFamily("vllm:lora_requests_info", "Running stats on LoRA requests.",
                                 labels=["max_lora", "running_lora_adapters", "waiting_lora_adapters"])
        lora.add_metric([str(snap.num_lora_slots), _names(snap.resident_adapters), _names(snap.waiting_adapters)],
                        self._clock())
        spec = spec_decode_counters(lambda name, doc: CounterMetricFamily(f"vllm:{name}", doc))
        for family, value in zip(spec, spec_decode_values(snap)):
            family.add_metric([], value)
        yield from (waiting, running, usage, cache, lora, *spec)
