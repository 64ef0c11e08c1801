"""A model-free `EngineClient` for tests that need the gateway, not the engine."""

from __future__ import annotations

from pathlib import Path

from adapters.registry import AdapterRegistry
from engine.chat_template import ChatFeatures
from engine.snapshot import EngineSnapshot
from gateway.engine_client import EngineClient, FleetHealth, Health
from gateway.tenancy import Tier


class FakeEngineClient(EngineClient):
    """Ready at once, with a real adapter registry (so uploads are validated
    against the base model's shapes) and no model: generating raises."""

    def __init__(self, registry: AdapterRegistry, model_dir: Path = Path("tiny-llama")):
        self._registry = registry
        self._model_dir = Path(model_dir)
        self.started = False

    @property
    def ready(self) -> bool:
        return True

    @property
    def load_error(self) -> str | None:
        return None

    async def start(self) -> None:
        self.started = True

    async def shutdown(self) -> None:
        self.started = False

    @property
    def model_dir(self) -> Path:
        return self._model_dir

    @property
    def max_model_len(self) -> int:
        return 2048

    @property
    def prompts(self):
        raise NotImplementedError("FakeEngineClient tokenizes one token per character, with no tokenizer")

    def health(self) -> FleetHealth:
        return FleetHealth(Health.OK, {"0": "ready"})

    def tokenize(self, text: str) -> list[int]:
        return [ord(c) for c in text]

    def apply_chat_template(self, messages: list[dict], tools: list[dict] | None = None) -> list[int]:
        return self.tokenize("".join(m.get("content", "") for m in messages))

    def chat_features(self) -> ChatFeatures:
        return ChatFeatures(tools=False, tool_role=True)

    def decode(self, token_ids: list[int]) -> str:
        return "".join(chr(t) for t in token_ids)

    def generate(self, request):
        raise NotImplementedError("FakeEngineClient has no model")

    def abort(self, request_id: str) -> None:
        pass

    def add_usage_sink(self, sink) -> None:
        pass  # no engine, so no steps to report

    def step_mark(self, request_id: str) -> object:
        return None

    def stepped_since(self, mark: object) -> bool:
        return True

    def snapshots(self) -> dict[str, EngineSnapshot]:
        return {"0": self.engine_stats}

    # 256 blocks of 16 tokens: 4096 tokens, 1024 of them reserved for premium.
    engine_stats = EngineSnapshot(
        num_running={Tier.PREMIUM: 0, Tier.STANDARD: 0}, num_waiting={Tier.PREMIUM: 0, Tier.STANDARD: 0},
        num_preemptions={Tier.PREMIUM: 0, Tier.STANDARD: 0}, kv_num_blocks=256, kv_used_blocks=0,
        kv_free_blocks=256, kv_premium_reserved_blocks=64, kv_used_by_tier={Tier.PREMIUM: 0, Tier.STANDARD: 0},
        block_size=16)

    @property
    def adapter_registry(self) -> AdapterRegistry:
        return self._registry


class ManualClock:
    """A monotonic clock that moves only when a test sets `now`."""

    def __init__(self, now: float = 1000.0):
        self.now = now

    def __call__(self) -> float:
        return self.now
