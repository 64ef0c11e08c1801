"""Wires an engine together from an EngineConfig: the one place that does."""

from __future__ import annotations

import dataclasses
import importlib
import logging
import os

import torch

import native
from engine.adapter_slots import AdapterSlotPolicy
from engine.attention import get_attention_backend
from engine.config import DEFAULT_CPU_KV_BYTES, EngineConfig
from engine.engine_core import EngineCore
from engine.errors import ValidationError
from engine.host_cpu import engine_threads, has_native_bfloat16
from engine.kv_cache_manager import KVCacheManager
from engine.llm_engine import LLMEngine
from engine.model.loader import allocate_kv_caches, kv_cache_bytes_per_block, load_model
from engine.runner import ModelRunner
from engine.sampler import Sampler
from engine.scheduler import Scheduler
from engine.spec_decode.policy import SpeculationPolicy

log = logging.getLogger(__name__)

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def resolve_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(name)


def resolve_dtype(name: str, device: torch.device, *, native_bfloat16: bool | None = None) -> torch.dtype:
    """`auto`: bfloat16 on a GPU and on a CPU that computes in it natively
    (engine/host_cpu.py), else float32."""
    if name != "auto":
        return _DTYPES[name]
    if device.type == "cuda":
        return torch.bfloat16
    if native_bfloat16 is None:
        native_bfloat16 = has_native_bfloat16()
    return torch.bfloat16 if native_bfloat16 else torch.float32


# "0" makes `auto` keep the model's dtype: the test suite sets it, so that
# its exactness tests against HF read a float32 cache, as LORAGW_CPU_BFLOAT16
# keeps them computing in float32 (engine/host_cpu.py).
AUTO_FLOAT16_CACHE_ENV = "LORAGW_AUTO_FLOAT16_KV_CACHE"


def resolve_kv_cache_dtype(name: str, dtype: torch.dtype, device: torch.device,
                           attention_backend: str = "torch") -> torch.dtype:
    """The cache's element type for a model computing in `dtype` on `device`
    (CacheConfig.kv_cache_dtype): `auto` is float16 for a float32 model on
    the CPU under the torch attention backend, which widens it as it reads
    (the Triton kernels read the query's dtype), else the model's."""
    widened = device.type == "cpu" and dtype == torch.float32 and attention_backend == "torch"
    auto_float16 = widened and os.environ.get(AUTO_FLOAT16_CACHE_ENV, "1") != "0"
    if name == "model" or (name == "auto" and not auto_float16):
        return dtype
    if not widened:
        raise ValidationError("kv_cache_dtype", f"float16 is for a float32 model on the CPU with the torch "
                                                f"attention backend, not {dtype} on {device.type} with "
                                                f"{attention_backend}")
    return torch.float16


def num_kv_blocks(config: EngineConfig, bytes_per_block: int, device: torch.device,
                  max_model_len: int) -> int:
    cache = config.cache
    if cache.num_kv_blocks is not None:
        return cache.num_kv_blocks
    if cache.kv_cache_memory is not None:
        return _blocks_in(cache.kv_cache_memory, bytes_per_block)
    if device.type == "cuda":
        free, _total = torch.cuda.mem_get_info(device)
        budget = int(free * cache.kv_cache_fraction)
    else:
        budget = DEFAULT_CPU_KV_BYTES
    # A default budget never exceeds what max_num_seqs full-length sequences
    # could hold: a small model would otherwise zero gigabytes it never uses.
    blocks_per_seq = -(-max_model_len // cache.block_size)
    return min(_blocks_in(budget, bytes_per_block), config.scheduler.max_num_seqs * blocks_per_seq)


def _blocks_in(budget: int, bytes_per_block: int) -> int:
    blocks = budget // bytes_per_block
    if blocks < 1:
        raise ValidationError("kv_cache_memory", f"{budget} bytes hold no {bytes_per_block}-byte KV block")
    return blocks


# The modules that make the C++ CPU kernels (native.Kernel), each on import;
# tests/test_native.py checks that every kernel source has one here.
CPU_KERNEL_MODULES = (
    "engine.model.cpu_elementwise", "engine.model.cpu_linear", "engine.model.quant_linear",
    "engine.attention.cpu_decode", "engine.attention.cpu_prefill", "adapters.ops.cpu_ops",
)


def load_cpu_kernels() -> None:
    """Builds (or finds built) every C++ CPU kernel now, a build per engine
    thread at a time, where the model's first calls would build them one
    after another: a new checkout's first start waits about half as long."""
    for name in CPU_KERNEL_MODULES:
        importlib.import_module(name)
    native.load_all(torch.get_num_threads())


def build_llm_engine(config: EngineConfig) -> LLMEngine:
    device = resolve_device(config.device)
    dtype = resolve_dtype(config.dtype, device)
    threads = engine_threads(config.num_threads, device.type)
    if threads:
        torch.set_num_threads(threads)
    if device.type == "cpu":
        load_cpu_kernels()
    attn = get_attention_backend(config.attention_backend, device)
    loaded = load_model(config.model, dtype=dtype, device=device, attn_backend=attn,
                        quantization=config.quantization, activation_quantization=config.activation_quantization)

    cache = config.cache
    kv_dtype = resolve_kv_cache_dtype(cache.kv_cache_dtype, dtype, device, attn.name)
    bytes_per_block = kv_cache_bytes_per_block(loaded.hf_config, cache.block_size, kv_dtype)
    max_model_len = min(config.scheduler.max_model_len or loaded.max_model_len, loaded.max_model_len)
    sched_config = dataclasses.replace(config.scheduler, max_model_len=max_model_len)
    num_blocks = num_kv_blocks(config, bytes_per_block, device, max_model_len)
    kv_caches = allocate_kv_caches(loaded.hf_config, num_blocks, cache.block_size, kv_dtype, device)
    reserved = config.premium_reserved_blocks(num_blocks)
    log.info("KV cache: %d blocks of %d tokens (%.1f MiB, %s), %d reserved for premium",
             num_blocks, cache.block_size, num_blocks * bytes_per_block / 2**20, str(kv_dtype).removeprefix("torch."),
             reserved)

    kv = KVCacheManager(num_blocks, cache.block_size, premium_reserved_blocks=reserved,
                        enable_prefix_caching=cache.enable_prefix_caching)
    slot_policy = AdapterSlotPolicy(config.lora.max_loras, config.lora.max_slot_wait_steps)
    speculation = SpeculationPolicy(config.speculative_config) if config.speculative_config.enabled else None
    scheduler = Scheduler(sched_config, kv, slot_policy, speculation)
    lora, registry = _build_lora(config, loaded, dtype, device)
    if lora is not None:
        scheduler.adapters.is_ready = lora.slots.is_ready
    runner = ModelRunner(loaded.model, kv_caches, attn, Sampler(device),
                         block_size=cache.block_size, device=device,
                         eos_token_ids=loaded.eos_token_ids, lora=lora)
    engine = LLMEngine(EngineCore(scheduler, runner), loaded.tokenizer,
                       eos_token_ids=loaded.eos_token_ids,
                       max_model_len=scheduler.config.max_model_len,
                       adapters=registry, lora_slots=lora.slots if lora else None,
                       vocab_size=loaded.hf_config.vocab_size)
    engine.model_dir = loaded.model_dir
    return engine


def build_adapter_registry(config: EngineConfig, hf_config):
    """The registry of adapters validated against this base model, in the
    data directory; None with LoRA off. The gateway opens the same one as
    its engines (it needs the model's config, not its weights)."""
    if config.lora.max_loras == 0:
        return None
    from pathlib import Path

    from adapters.registry import AdapterRegistry

    return AdapterRegistry(Path(config.data_dir) / "adapters" if config.data_dir else None,
                           base_config=hf_config, max_lora_rank=config.lora.max_lora_rank)


def _build_lora(config: EngineConfig, loaded, dtype: torch.dtype, device: torch.device):
    """The adapter registry and the device-side LoRA runtime, or (None, None)."""
    lora_config = config.lora
    if lora_config.max_loras == 0:
        return None, None
    from adapters.ops import get_lora_ops
    from adapters.runtime import LoraRuntime
    from adapters.slots import LoraSlotManager

    registry = build_adapter_registry(config, loaded.hf_config)
    packed = loaded.model.packed_linears()
    ops = get_lora_ops(lora_config.lora_backend, device)
    slots = LoraSlotManager(packed, max_loras=lora_config.max_loras, max_lora_rank=lora_config.max_lora_rank,
                            max_cpu_loras=lora_config.max_cpu_loras, load_fn=registry.load_key,
                            dtype=dtype, device=device, rank_major_b=ops.rank_major_b)
    runtime = LoraRuntime(slots, ops, device)
    runtime.attach(packed)
    return runtime, registry
