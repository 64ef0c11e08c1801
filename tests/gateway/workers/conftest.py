"""Fixtures of the worker tests: adapters, and a module-scoped live fleet
(worker processes take seconds to start, so a module shares one server).
The server itself is built by `live_fleet.start_fleet_server`."""

from __future__ import annotations

from pathlib import Path

import pytest

from gateway.tenancy import Tier
from tests.gateway.workers.live_fleet import start_fleet_server

# Distinct adapters for the worker tests: (name, seed). Different seeds give
# different weights, so each one changes the output in its own way.
LORAS = [("lora-a", 11), ("lora-b", 12), ("lora-c", 13), ("lora-d", 14)]


@pytest.fixture(scope="session")
def lora_dirs(tiny_llama_dir, tmp_path_factory) -> dict[str, Path]:
    """The LORAS as PEFT adapters on the tiny Llama (r=4 on q, v and o)."""
    from tests.adapters.conftest import build_peft_adapter

    dirs = {}
    for name, seed in LORAS:
        out = dirs[name] = tmp_path_factory.mktemp(name)
        build_peft_adapter(tiny_llama_dir, out, seed=seed, r=4, lora_alpha=8,
                           target_modules=["q_proj", "v_proj", "o_proj"])
    return dirs


@pytest.fixture(scope="module")
def fleet_server(tiny_llama_dir, lora_dirs, tmp_path_factory):
    """Two workers on the tiny Llama behind one gateway (affinity routing),
    tenant `acme` (standard) and `gold` (premium), every LORAS adapter
    imported and shared."""
    server = start_fleet_server(
        tmp_path_factory.mktemp("fleet"), tiny_llama_dir, tenants={"acme": Tier.STANDARD, "gold": Tier.PREMIUM},
        grants=[(name, None, True) for name, _ in LORAS], adapter_dirs=lora_dirs,
        max_num_seqs=8, num_kv_blocks=256, max_loras=4)
    yield server
    server.stop()
