"""The Llama-family model, its RoPE, and the checkpoint loader."""

from engine.model.llama import LlamaForCausalLM
from engine.model.loader import (
    LoadedModel,
    allocate_kv_caches,
    kv_cache_bytes_per_block,
    load_model,
    resolve_model_dir,
)

__all__ = [
    "LlamaForCausalLM",
    "LoadedModel",
    "allocate_kv_caches",
    "kv_cache_bytes_per_block",
    "load_model",
    "resolve_model_dir",
]
