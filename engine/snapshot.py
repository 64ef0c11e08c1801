"""What an engine publishes about itself: a snapshot of plain values.

The engine's own thread takes one after a step (`take_snapshot`), so nobody
ever reads the scheduler, the KV manager or the slot manager while they
change. It crosses the worker protocol as is (engine/wire.py), and the
gateway's metrics, admission and router read only the latest one, as vLLM's
frontend reads the `SchedulerStats` that ride in `EngineCoreOutputs`.
Dicts are keyed by tier; counters are cumulative since the engine started.
"""

from __future__ import annotations

from dataclasses import dataclass

from engine.request import Tier
from engine.spec_decode.policy import SpecDecodeStats

# The most recent slot-load durations a snapshot carries.
_RECENT_LOADS = 64


@dataclass(frozen=True)
class EngineSnapshot:
    num_running: dict[Tier, int]
    num_waiting: dict[Tier, int]
    num_preemptions: dict[Tier, int]  # cumulative, by the victim's tier
    kv_num_blocks: int
    kv_used_blocks: int
    kv_free_blocks: int  # cached (evictable) blocks included
    kv_premium_reserved_blocks: int
    kv_used_by_tier: dict[Tier, int]  # distinct blocks held by the tier's requests
    block_size: int = 16
    prefix_cache_queries: int = 0  # tokens looked up, cumulative
    prefix_cache_hits: int = 0  # tokens found, cumulative
    # LoRA: the device slots (0: LoRA off), the adapters in them now and
    # those loaded on the host, each as its registry key (name, version, digest).
    num_lora_slots: int = 0
    resident_adapters: tuple[tuple[str, int, str], ...] = ()
    host_adapters: tuple[tuple[str, int, str], ...] = ()
    # The distinct adapters of the waiting requests, in queue order.
    waiting_adapters: tuple[tuple[str, int, str], ...] = ()
    adapter_loads: int = 0  # host -> device slot loads, cumulative
    adapter_evictions: int = 0
    # Seconds of the most recent slot loads, oldest first; the last
    # `min(len, adapter_loads - seen)` are new to a reader.
    recent_adapter_load_seconds: tuple[float, ...] = ()
    steps: int = 0  # engine steps run, cumulative
    steps_dropped: int = 0  # of those, dropped part way for a premium arrival
    busy_time_us: int = 0  # the sum of those steps' busy time
    # Speculative decoding, cumulative, as vLLM counts: sequence-steps that
    # carried drafts, the drafts, and those the target model accepted.
    spec_decode_num_drafts: int = 0
    spec_decode_num_draft_tokens: int = 0
    spec_decode_num_accepted_tokens: int = 0

    @property
    def num_requests(self) -> int:
        return sum(self.num_running.values()) + sum(self.num_waiting.values())

    def kv_free_blocks_for(self, tier: Tier) -> int:
        """Blocks a new allocation of `tier` could take now: standard may not
        dip into the part of the premium reserve premium is not using."""
        if tier is Tier.PREMIUM:
            return self.kv_free_blocks
        return max(0, self.kv_free_blocks - self.kv_premium_reserved_blocks)

    def usable_blocks(self, tier: Tier) -> int:
        """The most blocks the tier's requests can ever hold at once."""
        reserved = 0 if tier is Tier.PREMIUM else self.kv_premium_reserved_blocks
        return self.kv_num_blocks - reserved


@dataclass
class StepCounter:
    """Steps and busy time, counted on the engine thread for the snapshot."""

    steps: int = 0
    busy_time_us: int = 0

    def count(self, busy_time_us: int) -> None:
        self.steps += 1
        self.busy_time_us += busy_time_us


def take_snapshot(llm_engine, counter: StepCounter | None = None) -> EngineSnapshot:
    """Read the engine's state. Only on the thread that steps it."""
    sched = llm_engine.scheduler
    kv = sched.kv
    usage = kv.usage()
    slots = llm_engine.lora_slots
    spec = sched.speculation.stats if sched.speculation is not None else SpecDecodeStats()
    return EngineSnapshot(
        num_running=dict(sched.num_running), num_waiting=dict(sched.num_waiting),
        num_preemptions=dict(sched.num_preemptions),
        kv_num_blocks=usage.num_blocks, kv_used_blocks=usage.num_used, kv_free_blocks=usage.num_free,
        kv_premium_reserved_blocks=usage.num_reserved_premium, kv_used_by_tier=dict(usage.used_by_tier),
        block_size=kv.block_size, prefix_cache_queries=kv.prefix_queries, prefix_cache_hits=kv.prefix_hits,
        num_lora_slots=slots.max_loras if slots else 0,
        resident_adapters=tuple(tuple(k) for k in slots.resident) if slots else (),
        host_adapters=tuple(tuple(k) for k in slots.host_resident) if slots else (),
        waiting_adapters=sched.waiting_adapters,
        adapter_loads=slots.num_loads if slots else 0,
        adapter_evictions=slots.num_evictions if slots else 0,
        recent_adapter_load_seconds=tuple(slots.recent_load_seconds)[-_RECENT_LOADS:] if slots else (),
        steps=counter.steps if counter else 0, busy_time_us=counter.busy_time_us if counter else 0,
        steps_dropped=sched.num_steps_dropped,
        spec_decode_num_drafts=spec.num_drafts, spec_decode_num_draft_tokens=spec.num_draft_tokens,
        spec_decode_num_accepted_tokens=spec.num_accepted_tokens)


def combine_snapshots(snapshots: list[EngineSnapshot]) -> EngineSnapshot:
    """One snapshot of several engines: counts and blocks add up, adapters
    are the union. Block counts stay per-block, so `block_size` must agree."""
    if not snapshots:
        raise ValueError("no snapshots to combine")

    def add(name: str) -> dict[Tier, int]:
        out: dict[Tier, int] = {}
        for snap in snapshots:
            for tier, n in getattr(snap, name).items():
                out[tier] = out.get(tier, 0) + n
        return out

    def total(name: str):
        return sum(getattr(snap, name) for snap in snapshots)

    def union(name: str) -> tuple:
        return tuple(dict.fromkeys(key for snap in snapshots for key in getattr(snap, name)))

    return EngineSnapshot(
        num_running=add("num_running"), num_waiting=add("num_waiting"), num_preemptions=add("num_preemptions"),
        kv_num_blocks=total("kv_num_blocks"), kv_used_blocks=total("kv_used_blocks"),
        kv_free_blocks=total("kv_free_blocks"), kv_premium_reserved_blocks=total("kv_premium_reserved_blocks"),
        kv_used_by_tier=add("kv_used_by_tier"), block_size=snapshots[0].block_size,
        prefix_cache_queries=total("prefix_cache_queries"), prefix_cache_hits=total("prefix_cache_hits"),
        num_lora_slots=total("num_lora_slots"), resident_adapters=union("resident_adapters"),
        host_adapters=union("host_adapters"), waiting_adapters=union("waiting_adapters"), adapter_loads=total("adapter_loads"),
        adapter_evictions=total("adapter_evictions"),
        recent_adapter_load_seconds=tuple(s for snap in snapshots for s in snap.recent_adapter_load_seconds),
        steps=total("steps"), busy_time_us=total("busy_time_us"), steps_dropped=total("steps_dropped"),
        spec_decode_num_drafts=total("spec_decode_num_drafts"),
        spec_decode_num_draft_tokens=total("spec_decode_num_draft_tokens"),
        spec_decode_num_accepted_tokens=total("spec_decode_num_accepted_tokens"))
