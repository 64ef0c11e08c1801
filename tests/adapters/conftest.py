"""Real PEFT adapters on the tiny random Llama, and ways to spoil them."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save

ALL_MODULES = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def build_peft_adapter(base_dir: Path, out_dir: Path, seed: int = 0, **lora_kwargs):
    """Save a randomly initialized (non-zero B) LoRA adapter; returns the peft model."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    base = AutoModelForCausalLM.from_pretrained(base_dir, dtype=torch.float32)
    model = get_peft_model(base, LoraConfig(init_lora_weights=False, **lora_kwargs))
    model.save_pretrained(out_dir)
    return model


def peft_greedy(model_dir, adapter_dirs: dict, requests, new_tokens: int) -> list[list[int]]:
    """The reference: HF transformers + peft, each (prompt, adapter name or
    None) request generated greedily on its own, exactly `new_tokens` tokens."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model_dir)
    models = {None: AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()}
    for name, path in adapter_dirs.items():
        fresh = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
        models[name] = PeftModel.from_pretrained(fresh, path).eval()
    outs = []
    with torch.inference_mode():
        for prompt, adapter in requests:
            ids = tok(prompt, return_tensors="pt").input_ids
            gen = models[adapter].generate(input_ids=ids, attention_mask=torch.ones_like(ids), do_sample=False,
                                           max_new_tokens=new_tokens, min_new_tokens=new_tokens,
                                           pad_token_id=tok.eos_token_id)
            outs.append(gen[0, ids.shape[1]:].tolist())
    return outs


@pytest.fixture(scope="session")
def tiny_config(tiny_llama_dir):
    from transformers import AutoConfig

    return AutoConfig.from_pretrained(tiny_llama_dir)


@pytest.fixture(scope="session")
def valid_adapter_dir(tiny_llama_dir, tmp_path_factory) -> Path:
    """r=4, alpha=8 on all seven projections of both layers."""
    out = tmp_path_factory.mktemp("valid-adapter")
    build_peft_adapter(tiny_llama_dir, out, r=4, lora_alpha=8, target_modules=ALL_MODULES)
    return out


@pytest.fixture
def valid_files(valid_adapter_dir):
    """(config dict, tensors dict) of the valid adapter, fresh copies to spoil."""
    cfg = json.loads((valid_adapter_dir / "adapter_config.json").read_text())
    tensors = load_file(valid_adapter_dir / "adapter_model.safetensors")
    return cfg, tensors


def as_upload(cfg: dict, tensors: dict[str, torch.Tensor]) -> tuple[bytes, bytes]:
    """What the admin upload hands to AdapterRegistry.put."""
    return json.dumps(cfg).encode(), save({k: v.contiguous() for k, v in tensors.items()})
