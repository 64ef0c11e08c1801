"""The gateway's only view of the engine.

`EngineClient` is the seam the architecture names: the gateway prepares an
`EngineRequest` (tokens, sampling, tier, adapter, cache salt) and reads back
`RequestOutput`s. `InProcessEngineClient` runs the engine in this process,
its step loop on a thread. The gateway never reaches past it into the
scheduler.
"""

from __future__ import annotations

import abc
import asyncio
import logging
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import AsyncIterator

from engine.config import EngineConfig
from engine.outputs import RequestOutput
from engine.request import Tier
from engine.sampling_params import SamplingParams

log = logging.getLogger(__name__)

_STATS_RETRIES = 5


@dataclass(frozen=True)
class EngineRequest:
    request_id: str
    tenant_id: str
    tier: Tier
    prompt_ids: list[int]
    params: SamplingParams
    # The adapter's registry key (name, version, digest), resolved by the
    # gateway so the engine serves exactly the version that was authorized.
    adapter_key: tuple[str, int, str] | None
    cache_salt: str


@dataclass(frozen=True)
class KVCapacity:
    """The engine's KV cache in tokens, for admission control."""

    total_tokens: int
    premium_reserved_tokens: int

    def usable_tokens(self, tier: Tier) -> int:
        reserved = self.premium_reserved_tokens if tier is Tier.STANDARD else 0
        return self.total_tokens - reserved


@dataclass(frozen=True)
class EngineStats:
    """A point-in-time snapshot of the engine for metrics: plain values,
    counters cumulative since the engine started. Dicts are keyed by tier."""

    num_running: dict[Tier, int]
    num_waiting: dict[Tier, int]
    num_preemptions: dict[Tier, int]  # cumulative, by the victim's tier
    kv_num_blocks: int
    kv_used_blocks: int
    kv_free_blocks: int  # cached (evictable) blocks included
    kv_premium_reserved_blocks: int
    kv_used_by_tier: dict[Tier, int]  # distinct blocks held by the tier's requests
    prefix_cache_queries: int  # tokens looked up, cumulative
    prefix_cache_hits: int  # tokens found, cumulative
    resident_adapters: tuple[tuple[str, int], ...] = ()  # (name, version) in a device slot now
    adapter_loads: int = 0  # host -> device slot loads, cumulative
    adapter_evictions: int = 0
    # Seconds of the most recent slot loads, oldest first (at most the last
    # 1024); the last `min(len, adapter_loads - seen)` are new to a reader.
    recent_adapter_load_seconds: tuple[float, ...] = ()

    def kv_free_blocks_for(self, tier: Tier) -> int:
        """Blocks a new allocation of `tier` could take now: standard may not
        dip into the part of the premium reserve premium is not using."""
        if tier is Tier.PREMIUM:
            return self.kv_free_blocks
        return max(0, self.kv_free_blocks - self.kv_premium_reserved_blocks)


class EngineNotReady(Exception):
    """The model is still loading (or failed to load)."""


class EngineClient(abc.ABC):
    """Contract: `start()` begins loading and returns at once; `ready` turns
    true when requests can be served. Every other method except `shutdown`
    raises EngineNotReady before that. `generate` yields incremental outputs
    and aborts the request if the caller stops iterating early."""

    @property
    @abc.abstractmethod
    def ready(self) -> bool: ...

    @property
    @abc.abstractmethod
    def load_error(self) -> str | None:
        """Why loading failed, if it did."""

    @abc.abstractmethod
    async def start(self) -> None: ...

    @abc.abstractmethod
    async def shutdown(self) -> None: ...

    @property
    @abc.abstractmethod
    def model_dir(self) -> Path: ...

    @property
    @abc.abstractmethod
    def max_model_len(self) -> int: ...

    @property
    @abc.abstractmethod
    def kv_capacity(self) -> KVCapacity: ...

    @abc.abstractmethod
    def tokenize(self, prompt: str | list[int]) -> list[int]:
        """Token ids of a text prompt; a token-id prompt comes back checked
        against the vocabulary (ValidationError otherwise)."""

    @abc.abstractmethod
    def apply_chat_template(self, messages: list[dict]) -> list[int]: ...

    @abc.abstractmethod
    def decode(self, token_ids: list[int]) -> str: ...

    def token_floor(self, text: str) -> int:
        """The fewest tokens `text` can tokenize to, known without tokenizing
        it (engine/token_floor.py); 0 when the tokenizer gives no such bound."""
        return 0

    def chat_token_floor(self, messages: list[dict]) -> int:
        """The same for a chat prompt: the floor of its rendered template."""
        return 0

    @abc.abstractmethod
    def generate(self, request: EngineRequest) -> AsyncIterator[RequestOutput]: ...

    @abc.abstractmethod
    def abort(self, request_id: str) -> None: ...

    @property
    @abc.abstractmethod
    def adapter_registry(self):
        """The `adapters.registry.AdapterRegistry` the engine loads from,
        validated against this base model; None with LoRA off."""

    def stats(self) -> EngineStats:
        """A snapshot for metrics; cheap enough to call on every scrape and
        safe to call from the event loop while the engine steps. Raises
        EngineNotReady before the model is loaded."""
        raise NotImplementedError(f"{type(self).__name__} does not report engine stats")

    def add_usage_sink(self, sink) -> None:
        """`sink(StepUsage)` is called, on the engine's thread, after every step."""
        raise NotImplementedError(f"{type(self).__name__} does not report step usage")


class InProcessEngineClient(EngineClient):
    """The engine in this process. The model loads on a thread so the server
    answers /health and /ready while it loads."""

    def __init__(self, config: EngineConfig):
        self.config = config
        self._engine = None  # engine.async_engine.AsyncEngine once loaded
        self._loaded = threading.Event()
        self._load_error: str | None = None
        self._sinks: list = []
        self._max_chars_per_token: int | None = None

    @property
    def ready(self) -> bool:
        return self._engine is not None and not self._engine.is_dead

    @property
    def load_error(self) -> str | None:
        return self._load_error

    async def start(self) -> None:
        threading.Thread(target=self._load, name="loragw-model-load", daemon=True).start()

    def _load(self) -> None:
        from engine.async_engine import AsyncEngine
        from engine.builder import build_llm_engine
        from engine.token_floor import max_chars_per_token

        try:
            llm_engine = build_llm_engine(self.config)
            llm_engine.usage_sinks.extend(self._sinks)
            self._max_chars_per_token = max_chars_per_token(llm_engine.tokenizer)
            self._engine = AsyncEngine(llm_engine)
            log.info("model ready: %s", llm_engine.model_dir)
        except Exception as exc:  # noqa: BLE001 - reported through /ready and load_error
            log.exception("model failed to load")
            self._load_error = f"{type(exc).__name__}: {exc}"
        finally:
            self._loaded.set()

    async def wait_ready(self, timeout: float | None = None) -> bool:
        """True once loaded; False if loading failed or timed out."""
        await asyncio.to_thread(self._loaded.wait, timeout)
        return self.ready

    async def shutdown(self) -> None:
        if self._engine is not None:
            await asyncio.to_thread(self._engine.shutdown)

    @property
    def _llm(self):
        if self._engine is None:
            raise EngineNotReady(self._load_error or "the model is still loading")
        return self._engine.engine

    @property
    def model_dir(self) -> Path:
        return Path(self._llm.model_dir)

    @property
    def max_model_len(self) -> int:
        return self._llm.max_model_len

    @property
    def kv_capacity(self) -> KVCapacity:
        kv = self._llm.scheduler.kv
        return KVCapacity(total_tokens=kv.block_pool.num_blocks * kv.block_size,
                          premium_reserved_tokens=kv.premium_reserved_blocks * kv.block_size)

    def tokenize(self, prompt: str | list[int]) -> list[int]:
        return self._llm.tokenize(prompt)

    def apply_chat_template(self, messages: list[dict]) -> list[int]:
        return self._llm.apply_chat_template(messages)

    def decode(self, token_ids: list[int]) -> str:
        return self._llm.tokenizer.decode(token_ids, skip_special_tokens=False)

    def token_floor(self, text: str) -> int:
        per_token = self._max_chars_per_token
        return -(-len(text) // per_token) if per_token else 0

    def chat_token_floor(self, messages: list[dict]) -> int:
        tokenizer = self._llm.tokenizer
        if not self._max_chars_per_token or not getattr(tokenizer, "chat_template", None):
            return 0
        # Rendering is string work; tokenizing the result is what costs.
        return self.token_floor(tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False))

    @property
    def adapter_registry(self):
        return self._llm.adapters

    def generate(self, request: EngineRequest) -> AsyncIterator[RequestOutput]:
        if self._engine is None:
            raise EngineNotReady(self._load_error or "the model is still loading")
        return self._engine.generate(
            request.prompt_ids, request.params, request_id=request.request_id, tier=request.tier,
            adapter_key=request.adapter_key, cache_salt=request.cache_salt)

    def abort(self, request_id: str) -> None:
        if self._engine is not None:
            self._engine.abort(request_id)

    def stats(self) -> EngineStats:
        # The engine thread mutates these objects while we read them. Each
        # read is of ints, or a copy made under the GIL; the one walk over
        # live requests (KV usage by tier) can meet a dict resized under it,
        # so it is retried.
        llm = self._llm
        sched, kv = llm.scheduler, llm.scheduler.kv
        for attempt in range(_STATS_RETRIES):
            try:
                usage = kv.usage()
                break
            except RuntimeError:  # "dictionary changed size during iteration"
                if attempt == _STATS_RETRIES - 1:
                    raise
        slots = llm.lora_slots
        return EngineStats(
            num_running=sched.num_running, num_waiting=sched.num_waiting,
            num_preemptions=dict(sched.num_preemptions),
            kv_num_blocks=usage.num_blocks, kv_used_blocks=usage.num_used, kv_free_blocks=usage.num_free,
            kv_premium_reserved_blocks=usage.num_reserved_premium, kv_used_by_tier=dict(usage.used_by_tier),
            prefix_cache_queries=kv.prefix_queries, prefix_cache_hits=kv.prefix_hits,
            resident_adapters=tuple((key[0], key[1]) for key in slots.resident) if slots else (),
            adapter_loads=slots.num_loads if slots else 0,
            adapter_evictions=slots.num_evictions if slots else 0,
            recent_adapter_load_seconds=tuple(slots.recent_load_seconds) if slots else ())

    def add_usage_sink(self, sink) -> None:
        if self._engine is not None:
            self._engine.engine.usage_sinks.append(sink)
        else:
            self._sinks.append(sink)

