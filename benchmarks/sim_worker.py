"""One simulated engine worker: the real scheduler, KV cache manager and
adapter slot policy, with a fitted step-time model (benchmarks/step_time.py)
in place of the model runner.

Time is the simulation's: a step that starts at `now` ends at `now` plus
the model's busy time for its features, and only then do its tokens count.
The LoRA slots are bookkeeping only (no weights): `max_loras` device slots,
least recently used evicted first, fed from a host cache of `max_cpu_loras`
adapters that each take `disk_load_s` to read, as adapters/slots.py does
with real weights. The worker publishes what a real one does, an
`EngineSnapshot` from `take_snapshot`, after every step.
"""

from __future__ import annotations

from collections import OrderedDict, deque
from collections.abc import Callable, Hashable, Iterable
from dataclasses import dataclass, replace

from step_time import StepFeatures, StepTimeModel

from engine.adapter_slots import AdapterSlotPolicy
from engine.config import EngineConfig
from engine.kv_cache_manager import KVCacheManager
from engine.request import Request
from engine.scheduler import Scheduler
from engine.snapshot import EngineSnapshot, StepCounter, take_snapshot
from engine.step_io import RequestStepUsage, RequestUpdate, RunnerOutput, SampledToken, SchedulerOutput

# The token every simulated step samples: never an EOS, so lengths are forced.
SAMPLED_TOKEN = 7


class SimSlots:
    """The slot manager's bookkeeping without weights; read by `take_snapshot`
    through the same attributes as adapters/slots.py's LoraSlotManager."""

    def __init__(self, max_loras: int, max_cpu_loras: int, disk_load_s: float, slot_load_s: float,
                 clock: Callable[[], float], *, waiting_keys: Callable[[], set] | None = None):
        self.max_loras = max_loras
        self.max_cpu_loras = max(max_cpu_loras, max_loras)
        self.disk_load_s = disk_load_s
        self.slot_load_s = slot_load_s
        self.clock = clock
        self.waiting_keys = waiting_keys
        self._slots: OrderedDict[Hashable, None] = OrderedDict()  # resident, LRU first
        self._host: OrderedDict[Hashable, None] = OrderedDict()  # loaded on the host, LRU first
        self._loading: dict[Hashable, float] = {}  # key -> when its disk read completes
        self.num_loads = 0
        self.num_evictions = 0
        self.recent_load_seconds: deque[float] = deque(maxlen=64)

    @property
    def resident(self) -> list[Hashable]:
        return list(self._slots)

    @property
    def host_resident(self) -> list[Hashable]:
        return list(self._host)

    def prefetch(self, key: Hashable) -> None:
        if key not in self._host and key not in self._loading:
            self._loading[key] = self.clock() + self.disk_load_s

    def is_ready(self, key: Hashable) -> bool:
        self._settle_loads()
        if key not in self._host and self.waiting_keys is not None:
            self.prefetch(key)  # evicted while its request ran, now preempted
        return key in self._host

    def next_load_done(self) -> float | None:
        return min(self._loading.values(), default=None)

    def activate(self, keys: Iterable[Hashable]) -> int:
        """Give every adapter of the step a slot; how many had to be loaded."""
        keys = list(dict.fromkeys(keys))
        assert len(keys) <= self.max_loras, "the slot policy let more adapters into a step than slots"
        loads = 0
        for key in keys:
            if key in self._slots:
                self._slots.move_to_end(key)
                continue
            if len(self._slots) >= self.max_loras:
                victim = next(k for k in self._slots if k not in keys)
                del self._slots[victim]
                self.num_evictions += 1
            self._slots[key] = None
            self._host[key] = None  # a running request's adapter may have left the host cache
            self._host.move_to_end(key)
            loads += 1
        self.num_loads += loads
        self.recent_load_seconds.extend([self.slot_load_s] * loads)
        return loads

    def _settle_loads(self) -> None:
        now = self.clock()
        for key in [k for k, t in self._loading.items() if t <= now]:
            del self._loading[key]
            self._host[key] = None
            self._evict_host(keep={key})

    def _evict_host(self, keep: set) -> None:
        """Drop the least recently used host copies no slot holds.

        The real slot manager prefetches only when a request arrives and
        evicts any host copy no slot holds, so with more distinct adapters
        queued than `max_cpu_loras` one can leave the host before its request
        runs and never be loaded again: that request waits forever. With
        `waiting_keys` the simulation models the fix (queued requests pin
        their adapters' host copies, and a missing one is loaded again);
        without it, it reproduces the hang."""
        if len(self._host) <= self.max_cpu_loras:
            return
        if self.waiting_keys is not None:
            keep = keep | self.waiting_keys()
        for old in list(self._host):
            if len(self._host) <= self.max_cpu_loras:
                break
            if old not in self._slots and old not in keep:
                del self._host[old]


@dataclass(frozen=True)
class WorkerShape:
    """How big one worker is. `scale` multiplies everything, compute too:
    the one giant worker of the prefix comparison is `scale` = fleet size."""

    num_kv_blocks: int = 1024
    block_size: int = 16
    max_model_len: int = 4096
    max_num_seqs: int = 64
    max_loras: int = 4
    max_cpu_loras: int = 16
    disk_load_s: float = 0.05
    pin_queued_adapters: bool = True  # see SimSlots._evict_host
    scale: int = 1


class SimWorker:
    def __init__(self, worker_id: str, shape: WorkerShape, model: StepTimeModel, clock: Callable[[], float]):
        # The serving defaults (premium reserve, standard prefill cap) of
        # `loragw worker`, with the simulation's sizes.
        from gateway.config import serving_engine_config

        config: EngineConfig = serving_engine_config()
        s = shape.scale
        num_blocks = shape.num_kv_blocks * s
        sched_config = replace(config.scheduler, max_model_len=shape.max_model_len,
                               max_num_seqs=shape.max_num_seqs * s,
                               max_num_batched_tokens=config.scheduler.max_num_batched_tokens * s,
                               max_standard_prefill_tokens=_scaled(config.scheduler.max_standard_prefill_tokens, s))
        kv = KVCacheManager(num_blocks, shape.block_size,
                            premium_reserved_blocks=config.premium_reserved_blocks(num_blocks))
        self.lora_slots = SimSlots(shape.max_loras * s, shape.max_cpu_loras * s, shape.disk_load_s,
                                   model.coefficients_s["adapter_loads"], clock,
                                   waiting_keys=self._waiting_adapters if shape.pin_queued_adapters else None)
        self.scheduler = Scheduler(sched_config, kv, AdapterSlotPolicy(
            shape.max_loras * s, config.lora.max_slot_wait_steps, is_ready=self.lora_slots.is_ready))
        self.worker_id = worker_id
        self.model = model
        self.scale = s
        self.counter = StepCounter()
        self.snapshot: EngineSnapshot | None = None
        self.busy = False  # a step is in flight

    def add_request(self, req: Request) -> None:
        self.scheduler.add_request(req)
        if req.adapter_key is not None:
            self.lora_slots.prefetch(req.adapter_key)

    def begin_step(self) -> tuple[SchedulerOutput, float] | None:
        """Schedule a step and price it; None if nothing could run."""
        out = self.scheduler.schedule()
        if out.is_empty:
            return None
        loads = self.lora_slots.activate(r.adapter_key for r in out.requests if r.adapter_key is not None)
        f = StepFeatures.of((RequestStepUsage.from_slice(r) for r in out.requests), loads)
        busy_s = self.model.predict(_per_unit(f, self.scale))
        self.busy = True
        return out, busy_s

    def end_step(self, out: SchedulerOutput, busy_s: float) -> list[RequestUpdate]:
        sampled = {r.request_id: [SampledToken(SAMPLED_TOKEN)] * r.num_samples for r in out.requests if r.sample}
        result = self.scheduler.update(out, RunnerOutput(sampled=sampled, busy_time_us=round(busy_s * 1e6)))
        self.counter.count(result.usage.busy_time_us)
        self.snapshot = take_snapshot(self, self.counter)
        self.busy = False
        return result.updates

    def _waiting_adapters(self) -> set:
        return {r.adapter_key for q in self.scheduler.waiting.values() for r in q}

    def abort_all(self) -> list[str]:
        ids = [r.request_id for r in list(self.scheduler.requests.values())]
        for request_id in ids:
            self.scheduler.abort(request_id)
        return ids


def _scaled(value: int | None, scale: int) -> int | None:
    return None if value is None else value * scale


def _per_unit(f: StepFeatures, scale: int) -> StepFeatures:
    """A giant worker's step as `scale` ordinary workers share it."""
    if scale == 1:
        return f
    return StepFeatures(round(f.tokens / scale), round(f.decode_rows / scale),
                        round(f.distinct_adapters / scale), round(f.adapter_loads / scale))
