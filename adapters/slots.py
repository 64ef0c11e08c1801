"""LoRA adapters on the device: `max_loras` slots of stacked weights, fed
from a host-side LRU cache of loaded adapters (`max_cpu_loras`).

Loading from disk happens in a background thread, so a request whose adapter
is not on the host yet waits (the scheduler asks `is_ready`) while everyone
else keeps running. Copying host weights into a device slot happens at the
start of the step that first needs it; it is a few small copies.

Weights are stacked per packed projection of each layer, matching the
model's fused matmuls: qkv_proj stacks the q, k and v A matrices along the
rank axis, `[num_slots, 3R, hidden]`, so one shrink serves all three, and
keeps one B stack per slice. Every slot is zero-padded to the max rank R:
padding, and modules an adapter does not target, contribute exactly zero.
"""

from __future__ import annotations

import threading
import time
from collections import OrderedDict, deque
from concurrent.futures import FIRST_COMPLETED, Future, ThreadPoolExecutor, wait
from dataclasses import dataclass
from typing import Callable, Hashable, Iterable

import torch

from adapters.slot_load import AdapterLoad

# Our packed projections and the HF (peft) modules behind their slices.
PACKED_MODULES: dict[str, tuple[str, ...]] = {
    "qkv_proj": ("q_proj", "k_proj", "v_proj"),
    "o_proj": ("o_proj",),
    "gate_up_proj": ("gate_proj", "up_proj"),
    "down_proj": ("down_proj",),
}


class AdapterLoadError(RuntimeError):
    """An adapter's weights could not be loaded; requests for it fail."""


@dataclass
class LoraStack:
    """One packed projection's LoRA weights for every slot."""

    lora_a: torch.Tensor  # [num_slots, n * R, in_features]
    lora_b: list[torch.Tensor]  # n of [num_slots, out_i, R]; maybe a view of rank-major memory
    offsets: list[int]  # first output column of each slice in the packed output
    modules: tuple[str, ...]  # the HF module of each slice


def _b_stack(slots: int, out: int, rank: int, dtype, device, rank_major: bool) -> torch.Tensor:
    """A zeroed [slots, out, rank] B stack; rank-major underneath if asked."""
    if rank_major:
        return torch.zeros(slots, rank, out, dtype=dtype, device=device).transpose(1, 2)
    return torch.zeros(slots, out, rank, dtype=dtype, device=device)


class LoraSlotManager:
    def __init__(
        self,
        packed_linears: dict[tuple[int, str], object],  # (layer, packed name) -> PackedLinear
        *,
        max_loras: int,
        max_lora_rank: int,
        max_cpu_loras: int,
        load_fn: Callable[[Hashable], object],  # adapter key -> LoraWeights (host, float32)
        dtype: torch.dtype,
        device: torch.device,
        rank_major_b: bool = False,  # the ops backend's wish (LoraOps.rank_major_b)
    ):
        self.max_loras = max_loras
        self.rank = max_lora_rank
        self.max_cpu_loras = max(max_cpu_loras, max_loras)
        self._load_fn = load_fn
        self.stacks: dict[tuple[int, str], LoraStack] = {}
        for (layer, name), linear in packed_linears.items():
            slices = linear.slice_names
            self.stacks[(layer, name)] = LoraStack(
                lora_a=torch.zeros(max_loras, len(slices) * max_lora_rank, linear.in_features,
                                   dtype=dtype, device=device),
                lora_b=[_b_stack(max_loras, linear.sizes[s], max_lora_rank, dtype, device, rank_major_b)
                        for s in slices],
                offsets=[linear.offsets[s] for s in slices],
                modules=PACKED_MODULES[name],
            )
        self._slots: OrderedDict[Hashable, int] = OrderedDict()  # resident key -> slot, LRU first
        self._free_slots = list(range(max_loras - 1, -1, -1))
        self._host: OrderedDict[Hashable, object] = OrderedDict()  # key -> LoraWeights, LRU first
        self._loading: dict[Hashable, Future] = {}
        self._failed: dict[Hashable, BaseException] = {}
        self._lock = threading.Lock()
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="lora-load")
        self.num_loads = 0  # host -> device slot loads
        self._step_loads: list[AdapterLoad] = []  # slot loads since the last take_loads()
        self.num_evictions = 0
        # Seconds each recent slot load took (host -> device copy), oldest
        # first; with `num_loads`, metrics can tell which ones are new.
        self.recent_load_seconds: deque[float] = deque(maxlen=1024)

    # ---- host side (any thread) ----------------------------------------------

    def prefetch(self, key: Hashable) -> None:
        """Start loading `key` onto the host unless it is there or on its way."""
        with self._lock:
            if key in self._host or key in self._loading:
                return
            self._failed.pop(key, None)
            self._loading[key] = self._pool.submit(self._load, key)

    def is_ready(self, key: Hashable) -> bool:
        """True when `key` is on the host. A key neither there nor loading
        was evicted from the host cache while its request waited (more
        adapters queued than `max_cpu_loras`): it is loaded again, or the
        request would wait forever."""
        with self._lock:
            if key in self._host:
                return True
            if key not in self._loading and key not in self._failed:
                self._loading[key] = self._pool.submit(self._load, key)
            return False

    def wait_for_loads(self, timeout: float) -> None:
        """Block until an in-flight load finishes (or `timeout` passes), so an
        engine with nothing else to do does not spin while weights load."""
        with self._lock:
            pending = list(self._loading.values())
        if pending:
            wait(pending, timeout=timeout, return_when=FIRST_COMPLETED)

    def pop_failures(self) -> dict[Hashable, BaseException]:
        with self._lock:
            failed, self._failed = self._failed, {}
        return failed

    def _load(self, key: Hashable) -> None:
        try:
            weights = self._load_fn(key)
            if weights.rank > self.rank:
                raise AdapterLoadError(
                    f"adapter {key!r} has rank {weights.rank}, above this engine's max_lora_rank={self.rank}")
        except BaseException as exc:  # noqa: BLE001 - reported to the requests, not raised here
            with self._lock:
                self._loading.pop(key, None)
                self._failed[key] = exc
            return
        with self._lock:
            self._loading.pop(key, None)
            self._host[key] = weights
            self._host.move_to_end(key)
            # Keep device-resident adapters; drop the least recently used others.
            for old in list(self._host):
                if len(self._host) <= self.max_cpu_loras:
                    break
                if old not in self._slots and old != key:
                    del self._host[old]

    # ---- device side (the step thread) -------------------------------------------

    def activate(self, keys: Iterable[Hashable]) -> dict[Hashable, int]:
        """Put every adapter of this step in a slot; returns key -> slot.
        Evicts least recently used slots that this step does not need."""
        keys = list(dict.fromkeys(keys))
        if len(keys) > self.max_loras:
            raise AdapterLoadError(f"{len(keys)} adapters in one step, but max_loras={self.max_loras}")
        for key in keys:
            if key in self._slots:
                self._slots.move_to_end(key)
        for key in keys:
            if key not in self._slots:
                self._load_into_slot(key, self._take_slot(set(keys)))
        return {key: self._slots[key] for key in keys}

    def take_loads(self) -> tuple[AdapterLoad, ...]:
        """The slot loads since the last call (the runner reports them per step)."""
        loads, self._step_loads = tuple(self._step_loads), []
        return loads

    def slot_of(self, key: Hashable) -> int | None:
        return self._slots.get(key)

    @property
    def resident(self) -> list[Hashable]:
        return list(self._slots)

    @property
    def host_resident(self) -> list[Hashable]:
        """Adapters loaded on the host: a slot load away, with no disk read."""
        with self._lock:
            return list(self._host)

    def _take_slot(self, needed: set) -> int:
        if self._free_slots:
            return self._free_slots.pop()
        victim = next(k for k in self._slots if k not in needed)
        self.num_evictions += 1
        return self._slots.pop(victim)

    def _load_into_slot(self, key: Hashable, slot: int) -> None:
        with self._lock:
            weights = self._host.get(key)
            if weights is not None:
                self._host.move_to_end(key)
        if weights is None:
            self._free_slots.append(slot)
            raise AdapterLoadError(f"adapter {key!r} is not loaded on the host")
        t0 = time.perf_counter()
        R = self.rank
        for (layer, _name), stack in self.stacks.items():
            stack.lora_a[slot].zero_()
            for i, module in enumerate(stack.modules):
                stack.lora_b[i][slot].zero_()
                pair = weights.modules.get((layer, module))
                if pair is None:
                    continue
                a, b = pair
                r = a.shape[0]
                stack.lora_a[slot, i * R : i * R + r].copy_(a)
                stack.lora_b[i][slot, :, :r].copy_(b)
        self._slots[key] = slot
        self.recent_load_seconds.append(time.perf_counter() - t0)
        self.num_loads += 1
        self._step_loads.append(AdapterLoad(key, round(self.recent_load_seconds[-1] * 1_000_000)))

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)
