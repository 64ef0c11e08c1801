"""The speculative-decoding counters ride in the engine's snapshot, cross
the worker protocol, add up across workers, and come out on /metrics under
vLLM's names (`loragw:` for ours, `vllm:` for the model-server protocol)."""

from __future__ import annotations

import dataclasses

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.parser import text_string_to_metric_families

from engine import LLM
from engine.model_server_metrics import ModelServerCollector
from engine.snapshot import combine_snapshots, take_snapshot
from engine.snapshot_metrics import SnapshotCollector
from engine.wire import PROTOCOL_VERSION, Codec, Status
from tests.engine.spec_decode.test_spec_exactness import GREEDY, SPEC, mixed_prompts, with_oracle

NAMES = ("spec_decode_num_drafts", "spec_decode_num_draft_tokens", "spec_decode_num_accepted_tokens")


def scrape(collector) -> dict[str, float]:
    registry = CollectorRegistry()
    registry.register(collector)
    text = generate_latest(registry).decode()
    return {s.name: s.value for family in text_string_to_metric_families(text) for s in family.samples}


def test_counters_travel_with_the_snapshot_to_metrics(tiny_llama_dir):
    prompts = mixed_prompts()[:4]
    plain = LLM(str(tiny_llama_dir)).generate(prompts, GREEDY)
    llm = with_oracle(LLM(str(tiny_llama_dir), **SPEC), plain)
    llm.generate(prompts, GREEDY)
    stats = llm.engine.scheduler.speculation.stats
    assert stats.num_accepted_tokens > 0
    expected = (stats.num_drafts, stats.num_draft_tokens, stats.num_accepted_tokens)

    snap = take_snapshot(llm.engine)
    codec = Codec()
    wired = codec.decode_to_gateway(codec.encode(Status(PROTOCOL_VERSION, snapshot=snap))).snapshot
    assert tuple(getattr(wired, name) for name in NAMES) == expected
    both = combine_snapshots([snap, snap])
    assert tuple(getattr(both, name) for name in NAMES) == tuple(2 * n for n in expected)

    ours = scrape(SnapshotCollector(lambda: {"0": wired}, label_workers=True))
    assert tuple(ours[f"loragw:{name}_total"] for name in NAMES) == expected
    vllm = scrape(ModelServerCollector(lambda: wired))
    assert tuple(vllm[f"vllm:{name}_total"] for name in NAMES) == expected

    off = take_snapshot(LLM(str(tiny_llama_dir)).engine)
    assert dataclasses.asdict(off)["spec_decode_num_drafts"] == 0
