"""The canonical stored form of a validated adapter: one safetensors file.

Tensors are named `layers.{i}.{module}.lora_A` / `.lora_B` and keep the dtype
they were uploaded in; B is stored WITHOUT the scaling. The only metadata
entry, `loragw`, is sorted-key JSON holding the format version and each
module's scaling. safetensors writes tensors in a fixed order, so equal
adapters give equal bytes, and the sha256 of those bytes is the adapter's
digest: what the store is addressed by, and what the engine's adapter key and
the prefix-cache hash carry. Config fields that change nothing (peft_version,
base_model_name_or_path, ...) do not reach the digest.
"""

from __future__ import annotations

import hashlib
import json
import struct

import torch
from safetensors.torch import load as load_safetensors
from safetensors.torch import save as save_safetensors

from adapters.errors import AdapterError
from adapters.peft_config import LORA_MODULES
from adapters.peft_format import LoraModule

FORMAT_VERSION = 1
_METADATA_KEY = "loragw"


def digest_of(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def encode(modules: dict[tuple[int, str], LoraModule]) -> bytes:
    tensors: dict[str, torch.Tensor] = {}
    scaling: dict[str, float] = {}
    for (layer, module), m in modules.items():
        tensors[f"layers.{layer}.{module}.lora_A"] = m.lora_a.contiguous()
        tensors[f"layers.{layer}.{module}.lora_B"] = m.lora_b.contiguous()
        scaling[f"{layer}.{module}"] = float(m.scaling)
    meta = json.dumps({"format": FORMAT_VERSION, "scaling": scaling}, sort_keys=True)
    return save_safetensors(tensors, metadata={_METADATA_KEY: meta})


def decode(data: bytes) -> dict[tuple[int, str], LoraModule]:
    """Inverse of `encode`. The caller has checked the digest already."""
    (header_len,) = struct.unpack("<Q", data[:8])
    header = json.loads(data[8 : 8 + header_len])
    meta = json.loads(header["__metadata__"][_METADATA_KEY])
    if meta.get("format") != FORMAT_VERSION:
        raise AdapterError(f"stored adapter has format {meta.get('format')!r}; this loragw reads {FORMAT_VERSION}")
    tensors = load_safetensors(data)
    modules = {}
    for key, scaling in meta["scaling"].items():
        layer, module = key.split(".", 1)
        assert module in LORA_MODULES, key
        a = tensors[f"layers.{key}.lora_A"]
        b = tensors[f"layers.{key}.lora_B"]
        modules[(int(layer), module)] = LoraModule(a, b, scaling)
    return modules
