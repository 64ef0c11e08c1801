"""Engine configuration. Every field has a default that works on the CPU, and
nothing here reads model files: tests build configs freely."""

from __future__ import annotations

from dataclasses import dataclass

from engine.errors import ValidationError

_DTYPES = ("auto", "float32", "bfloat16", "float16")


@dataclass
class SchedulerConfig:
    max_num_batched_tokens: int = 1024
    max_num_seqs: int = 128
    max_model_len: int = 8192
    # Premium is admitted first; this turns tier ordering off (every request
    # is treated as standard), which the SLO tests use to starve premium.
    enable_tiers: bool = True
    # With tiers on, a step that prefills premium work carries no standard
    # prefill: premium TTFT then costs one short step, not a full one.
    premium_prefill_alone: bool = True
    # With tiers on, the most prompt tokens standard requests may prefill in
    # one step (None: the whole budget). A premium request that arrives
    # mid-step waits for that step, so this bounds its TTFT under a
    # standard flood; on a CPU, step time grows with every token.
    max_standard_prefill_tokens: int | None = None
    # Distinct LoRA adapters that may run in one step (0 disables LoRA), and
    # the steps a request may be passed while it waits for an adapter slot.
    max_loras: int = 4
    max_slot_wait_steps: int = 32

    def __post_init__(self) -> None:
        for name in ("max_num_batched_tokens", "max_num_seqs", "max_model_len"):
            if getattr(self, name) < 1:
                raise ValidationError(name, "must be >= 1")
        if self.max_loras < 0 or self.max_slot_wait_steps < 0:
            raise ValidationError("max_loras", "max_loras and max_slot_wait_steps must be >= 0")


@dataclass
class CacheConfig:
    block_size: int = 16
    # KV budget in bytes; None means `kv_cache_fraction` of free device
    # memory on a GPU, or DEFAULT_CPU_KV_BYTES on the CPU.
    kv_cache_memory: int | None = None
    kv_cache_fraction: float = 0.9
    # Exact block count, overriding the memory budget (tests, benchmarks).
    num_blocks: int | None = None
    enable_prefix_caching: bool = True
    # Fraction of all blocks that only premium requests may allocate.
    premium_reserved_fraction: float = 0.0

    def __post_init__(self) -> None:
        if self.block_size < 1 or self.block_size & (self.block_size - 1):
            raise ValidationError("block_size", "must be a power of two")
        if not 0.0 < self.kv_cache_fraction <= 1.0:
            raise ValidationError("kv_cache_fraction", "must be in (0, 1]")
        if not 0.0 <= self.premium_reserved_fraction < 1.0:
            raise ValidationError("premium_reserved_fraction", "must be in [0, 1)")
        if self.num_blocks is not None and self.num_blocks < 1:
            raise ValidationError("num_blocks", "must be >= 1")


DEFAULT_CPU_KV_BYTES = 4 * 1024**3


@dataclass
class EngineConfig:
    """Everything `LLM(...)` and `loragw serve` accept, flattened."""

    model: str | None = None  # None: the bundled SmolLM2-135M-Instruct
    dtype: str = "auto"  # float32 on the CPU, bfloat16 on a GPU
    device: str = "auto"
    attention_backend: str = "auto"  # "torch", "triton" or "auto"
    max_num_batched_tokens: int = 1024
    max_num_seqs: int = 128
    max_model_len: int | None = None  # None: the model's own limit
    block_size: int = 16
    kv_cache_memory: int | None = None
    kv_cache_fraction: float = 0.9
    num_kv_blocks: int | None = None
    enable_prefix_caching: bool = True
    premium_reserved_fraction: float = 0.0
    enable_tiers: bool = True
    premium_prefill_alone: bool = True
    max_standard_prefill_tokens: int | None = None
    num_threads: int | None = None  # torch intra-op threads on the CPU
    # LoRA: adapters resident in device slots at once (0 turns LoRA off), the
    # rank every slot is padded to, adapters kept loaded on the host, the SGMV
    # backend ("torch", "triton" or "auto"), and where the registry lives
    # (None: $LORAGW_DATA_DIR or the user data dir).
    max_loras: int = 4
    max_lora_rank: int = 16
    max_cpu_loras: int = 16
    lora_backend: str = "auto"
    max_slot_wait_steps: int = 32
    data_dir: str | None = None

    def __post_init__(self) -> None:
        if self.dtype not in _DTYPES:
            raise ValidationError("dtype", f"must be one of {_DTYPES}")
        if self.max_lora_rank < 1 or self.max_cpu_loras < 0:
            raise ValidationError("max_lora_rank", "max_lora_rank must be >= 1 and max_cpu_loras >= 0")

    def cache_config(self) -> CacheConfig:
        return CacheConfig(
            block_size=self.block_size,
            kv_cache_memory=self.kv_cache_memory,
            kv_cache_fraction=self.kv_cache_fraction,
            num_blocks=self.num_kv_blocks,
            enable_prefix_caching=self.enable_prefix_caching,
            premium_reserved_fraction=self.premium_reserved_fraction,
        )

    def scheduler_config(self, model_max_len: int) -> SchedulerConfig:
        max_len = min(self.max_model_len or model_max_len, model_max_len)
        return SchedulerConfig(
            max_num_batched_tokens=self.max_num_batched_tokens,
            max_num_seqs=self.max_num_seqs,
            max_model_len=max_len,
            enable_tiers=self.enable_tiers,
            premium_prefill_alone=self.premium_prefill_alone,
            max_standard_prefill_tokens=self.max_standard_prefill_tokens,
            max_loras=self.max_loras,
            max_slot_wait_steps=self.max_slot_wait_steps,
        )
