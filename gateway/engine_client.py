"""The gateway's only view of the engine.

`EngineClient` is the seam the architecture names: the gateway prepares an
`EngineRequest` (tokens, sampling, tier, adapter, cache salt) and reads back
`RequestOutput`s. `gateway.workers.fleet.WorkerFleet` serves them from
engine worker processes over the worker protocol; `InProcessEngineClient`
runs one engine in this process, on a thread (tests, offline tools). The
gateway never reaches past this seam into an engine.
"""

from __future__ import annotations

import abc
import asyncio
import enum
import logging
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import AsyncIterator

from engine.chat_template import ChatFeatures
from engine.config import EngineConfig
from engine.outputs import RequestOutput
from engine.request import Tier
from engine.prompts import PromptEncoder
from engine.sampling_params import SamplingParams
from engine.snapshot import EngineSnapshot, combine_snapshots
from engine.structured.spec import StructuredSpec

log = logging.getLogger(__name__)


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

    @classmethod
    def of(cls, snapshots: list[EngineSnapshot]) -> KVCapacity:
        """The capacity of the engines behind these snapshots, together."""
        return cls(total_tokens=sum(s.kv_num_blocks * s.block_size for s in snapshots),
                   premium_reserved_tokens=sum(s.kv_premium_reserved_blocks * s.block_size for s in snapshots))


class Health(str, enum.Enum):
    """What /health and /ready report: every engine up, some down, none up."""

    OK = "ok"
    DEGRADED = "degraded"
    UNAVAILABLE = "unavailable"


@dataclass(frozen=True)
class FleetHealth:
    status: Health
    # worker id -> "ready", "loading", "down" or "failed: <why>"
    workers: dict[str, str]


class EngineNotReady(Exception):
    """The model is still loading (or failed to load)."""


class EngineClient(abc.ABC):
    """Contract: `start()` begins loading and returns at once; `ready` turns
    true when requests can be served. Every other method except `shutdown`
    and `health` raises EngineNotReady before that. `generate` yields
    incremental outputs and aborts the request if the caller stops
    iterating early.

    Prompts are tokenized here, in the gateway's process (`prompts`, a
    PromptEncoder); engines receive token ids. What the gateway knows of an
    engine's state comes from the snapshots it publishes, never from its
    live objects."""

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
    def prompts(self) -> PromptEncoder: ...

    @property
    @abc.abstractmethod
    def model_dir(self) -> Path: ...

    @property
    @abc.abstractmethod
    def max_model_len(self) -> int: ...

    @abc.abstractmethod
    def snapshots(self) -> dict[str, EngineSnapshot]:
        """The latest snapshot of each engine that is up, by worker id."""

    @abc.abstractmethod
    def health(self) -> FleetHealth: ...

    @abc.abstractmethod
    def generate(self, request: EngineRequest) -> AsyncIterator[RequestOutput]: ...

    @abc.abstractmethod
    def abort(self, request_id: str) -> None: ...

    @property
    @abc.abstractmethod
    def adapter_registry(self):
        """The `adapters.registry.AdapterRegistry` the engines load from,
        validated against this base model; None with LoRA off."""

    @abc.abstractmethod
    def add_usage_sink(self, sink) -> None:
        """`sink(StepUsage)` is called after every step of every engine, in
        each engine's step order, before that step's outputs are delivered."""

    @abc.abstractmethod
    def step_mark(self, request_id: str) -> object:
        """Where the engine that ran `request_id` is now; see `stepped_since`."""

    @abc.abstractmethod
    def stepped_since(self, mark: object) -> bool:
        """True once that engine completed a step after `mark` was taken, or
        can step no more (it was lost). Billing settles an aborted request
        then: the step it may have been part of was reported by that time."""

    # ---- derived from the above ------------------------------------------------

    def stats(self) -> EngineSnapshot:
        """All engines together, for metrics and admission; cheap and safe
        to call from the event loop. Raises EngineNotReady when none is up."""
        snaps = list(self.snapshots().values())
        if not snaps:
            raise EngineNotReady(self.load_error or "no engine is up")
        return combine_snapshots(snaps)

    @property
    def kv_capacity(self) -> KVCapacity:
        """The KV cache of every engine that is up: admission judges the fleet."""
        snaps = list(self.snapshots().values())
        if not snaps:
            raise EngineNotReady(self.load_error or "no engine is up")
        return KVCapacity.of(snaps)

    def tokenize(self, prompt: str | list[int]) -> list[int]:
        """Token ids of a text prompt; a token-id prompt comes back checked
        against the vocabulary (ValidationError otherwise)."""
        return self.prompts.tokenize(prompt)

    def apply_chat_template(self, messages: list[dict], tools: list[dict] | None = None) -> list[int]:
        return self.prompts.apply_chat_template(messages, tools)

    def chat_features(self) -> ChatFeatures:
        """Whether the chat template renders tools and tool results itself."""
        return self.prompts.chat_features()

    def check_structured(self, spec: StructuredSpec) -> None:
        """ValidationError naming `spec.param` unless the engine can enforce
        the spec; a compile check bounded by llguidance's fuel."""
        self.prompts.check_structured(spec)

    def decode(self, token_ids: list[int]) -> str:
        return self.prompts.decode(token_ids)

    def token_floor(self, text: str) -> int:
        """The fewest tokens `text` can tokenize to, known without tokenizing
        it (engine/token_floor.py); 0 when the tokenizer gives no such bound."""
        return self.prompts.token_floor(text)

    def chat_token_floor(self, messages: list[dict], tools: list[dict] | None = None) -> int:
        """The same for a chat prompt: the floor of its rendered template."""
        return self.prompts.chat_token_floor(messages, tools)


class InProcessEngineClient(EngineClient):
    """The engine in this process, its step loop on a thread: for tests and
    the offline tools (the gateway proper runs engines in worker processes).
    The model loads on a thread so the server answers /health and /ready
    while it loads."""

    WORKER_ID = "0"

    def __init__(self, config: EngineConfig):
        self.config = config
        self._engine = None  # engine.async_engine.AsyncEngine once loaded
        self._loaded = threading.Event()
        self._load_error: str | None = None
        self._sinks: list = []

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

        try:
            llm_engine = build_llm_engine(self.config)
            llm_engine.usage_sinks.extend(self._sinks)
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
    def prompts(self) -> PromptEncoder:
        return self._llm.prompts

    @property
    def model_dir(self) -> Path:
        return Path(self._llm.model_dir)

    @property
    def max_model_len(self) -> int:
        return self._llm.max_model_len

    def snapshots(self) -> dict[str, EngineSnapshot]:
        if not self.ready:
            return {}
        return {self.WORKER_ID: self._engine.snapshot}

    def health(self) -> FleetHealth:
        if self.ready:
            return FleetHealth(Health.OK, {self.WORKER_ID: "ready"})
        state = f"failed: {self._load_error}" if self._load_error else ("down" if self._engine else "loading")
        status = Health.OK if state == "loading" else Health.UNAVAILABLE
        return FleetHealth(status, {self.WORKER_ID: state})

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

    def add_usage_sink(self, sink) -> None:
        if self._engine is not None:
            self._engine.engine.usage_sinks.append(sink)
        else:
            self._sinks.append(sink)

    def step_mark(self, request_id: str) -> object:
        return self._engine.snapshot.steps if self.ready else None

    def stepped_since(self, mark: object) -> bool:
        # The snapshot is taken after the step's usage went to the sinks.
        return mark is None or not self.ready or self._engine.snapshot.steps > mark
