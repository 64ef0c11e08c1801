"""Shared fixtures: the real SmolLM2 checkpoint and a tiny random Llama."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

# Finds PostgreSQL and Redis for the session and reports the tests that
# skipped for want of them (tests/stores.py).
pytest_plugins = ["tests.stores"]

# Triton reads this when a kernel is decorated: set it before any test module
# imports a kernel, so a CPU-only machine runs every kernel in the interpreter.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

# `--dtype auto` is bfloat16 on a CPU with native bfloat16; the exactness
# tests compare with HF in float32, so the suite (and every worker process it
# starts) keeps auto at float32 on every host (engine/host_cpu.py).
os.environ["LORAGW_CPU_BFLOAT16"] = "0"
os.environ["LORAGW_AUTO_FLOAT16_KV_CACHE"] = "0"  # and a float32 cache: engine/builder.py
# The suite shares its cores with the workers it starts: their OpenMP
# threads sleep when idle, rather than spin as serving's default
# (engine/host_cpu.py) has them, which would stall both.
os.environ["OMP_WAIT_POLICY"] = "PASSIVE"
# Each process times its own kernel calibrations, as the calibration tests
# expect, rather than read what an earlier run kept for the host
# (engine/model/calibration_cache.py; its own tests switch it on).
os.environ["LORAGW_CPU_CALIBRATION_CACHE"] = "0"


@pytest.fixture
def no_compiler(monkeypatch):
    """A machine where C++ kernels cannot be built (no compiler, no ninja):
    torch's cpp_extension.load raises, as it does there."""
    import torch.utils.cpp_extension

    def fail(**kwargs):
        raise RuntimeError("Ninja is required to load C++ extensions")

    monkeypatch.setattr(torch.utils.cpp_extension, "load", fail)


@pytest.fixture(scope="session")
def smollm_dir() -> Path:
    """The bundled SmolLM2-135M-Instruct as a safetensors checkpoint
    (converted from the GGUF on first use, then cached)."""
    from engine.model.loader import resolve_model_dir

    return resolve_model_dir(None)


@pytest.fixture(scope="session")
def tiny_llama_dir(tmp_path_factory, smollm_dir) -> Path:
    """A 2-layer random-weight Llama with SmolLM2's tokenizer and chat template.

    The weights are drawn wide (initializer_range 0.3) so greedy choices are
    decisive: exactness tests must not hinge on near-ties in the logits."""
    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

    tokenizer = AutoTokenizer.from_pretrained(smollm_dir)
    config = LlamaConfig(
        vocab_size=len(tokenizer), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=2048,
        rope_theta=10000.0, initializer_range=0.3, tie_word_embeddings=True,
        bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id,
    )
    torch.manual_seed(1234)
    model = LlamaForCausalLM(config).to(torch.float32)
    path = tmp_path_factory.mktemp("tiny-llama")
    model.save_pretrained(path, safe_serialization=True)
    tokenizer.save_pretrained(path)
    return path
