"""Routing over real workers: two workers with two adapter slots each and
four adapters. Adapter-affine routing loads each adapter into a slot once;
round-robin routing of the same traffic makes the workers load them over
and over (each worker cycles through all four adapters with two slots)."""

from __future__ import annotations

import httpx
import pytest

from gateway.tenancy import Tier
from tests.gateway.workers.conftest import LORAS
from tests.gateway.workers.live_fleet import start_fleet_server

ROUNDS = 4
ADAPTERS = [name for name, _ in LORAS]
# A round: every adapter, then the base model. Five requests a round, so
# round-robin over two workers sends each adapter to the other worker the
# next round: each worker sees all four adapters, two a round, through two
# slots, and with LRU eviction every one of those 16 requests is a load.
TRAFFIC = [adapter for _ in range(ROUNDS) for adapter in ADAPTERS + [None]]
PROMPTS = {adapter: [(31 * i + 17) % 400 + 3 + 50 * k for i in range(20)]
           for k, adapter in enumerate(ADAPTERS + [None])}


def _serve(tmp_path, tiny_llama_dir, lora_dirs, policy: str):
    server = start_fleet_server(tmp_path, tiny_llama_dir, policy=policy, tenants={"acme": Tier.STANDARD},
                                grants=[(name, None, True) for name in ADAPTERS], adapter_dirs=lora_dirs,
                                max_num_seqs=4, num_kv_blocks=64, max_loras=2)
    try:
        with httpx.Client(base_url=server.url, timeout=120) as client:
            for adapter in TRAFFIC:  # one at a time: each sees the snapshots of the last
                body = {"model": adapter or server.model, "prompt": PROMPTS[adapter], "max_tokens": 2,
                        "temperature": 0.0}
                r = client.post("/v1/completions", json=body, headers=server.headers("acme"))
                assert r.status_code == 200, r.text
        return server.snapshots()
    finally:
        server.stop()


@pytest.mark.parametrize("policy, loads", [("affinity", len(ADAPTERS)), ("round-robin", ROUNDS * len(ADAPTERS))])
def test_adapter_loads_by_routing_policy(tmp_path, tiny_llama_dir, lora_dirs, policy, loads):
    snapshots = _serve(tmp_path, tiny_llama_dir, lora_dirs, policy)
    assert set(snapshots) == {"0", "1"}
    assert sum(s.adapter_loads for s in snapshots.values()) == loads
    assert all(s.steps > 0 for s in snapshots.values())  # both workers served
    resident = [{key[0] for key in s.resident_adapters} for s in snapshots.values()]
    if policy == "affinity":
        # Two adapters stayed on each worker, and no adapter on both.
        assert [len(r) for r in resident] == [2, 2] and resident[0] | resident[1] == set(ADAPTERS)
