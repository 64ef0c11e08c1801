"""/metrics: every named series is there after a small workload on a live
gateway, and the values are what the workload did (requests by tier and
finish reason, 429s by limit, a preemption); bounded labels; billing
counters; the engine collector's adapter series; and who may read them
(the admin token on the public port, anyone on the --metrics-port listener)."""

from __future__ import annotations

import asyncio
import time

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families
from starlette.testclient import TestClient

from engine.config import EngineConfig
from gateway.app import Gateway, create_app
from gateway.config import GatewayConfig, TierLimits
import dataclasses

from gateway.metrics import GatewayMetrics
from gateway.routes.observability import metrics_app
from gateway.tenancy import TenantLimits, Tier
from gateway.tenant_limits import LimiterHealth
from tests.gateway.fakes import FakeEngineClient
from tests.gateway.live import build_in_process_gateway, ADMIN_TOKEN, seed_tenants, start_live_server

ADMIN = {"Authorization": f"Bearer {ADMIN_TOKEN}"}


def scrape(text: str) -> dict[tuple[str, tuple], float]:
    """{(sample name, sorted labels): value} of an exposition."""
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for family in text_string_to_metric_families(text) for s in family.samples}


def value(samples: dict, name: str, **labels) -> float:
    return samples[(name, tuple(sorted(labels.items())))]


class FakeAdmission:
    def snapshot(self):
        return {"premium": {"waiting": 0, "queued_tokens": 0, "rejected": {}},
                "standard": {"waiting": 2, "queued_tokens": 30, "rejected": {"max_waiting": 3}}}

    def limiter_health(self):
        return LimiterHealth(backend="memory", shared=False)


def fake_metrics(engine=None, **kwargs) -> GatewayMetrics:
    return GatewayMetrics(engine=engine or FakeEngineClient(registry=None), admission=FakeAdmission(), **kwargs)


def test_billing_counts_by_tenant_up_to_the_label_limit_then_other():
    metrics = fake_metrics(max_tenant_labels=2)
    for tenant in ("acme", "globex", "initech", "umbrella", "acme"):
        metrics.count_usage(tenant, gpu_us=1_500_000, prompt_tokens=10, completion_tokens=5)
    samples = scrape(metrics.render().decode())
    assert value(samples, "loragw:tenant_gpu_seconds_total", tenant="acme") == 3.0
    assert value(samples, "loragw:tenant_gpu_seconds_total", tenant="globex") == 1.5
    assert value(samples, "loragw:tenant_gpu_seconds_total", tenant="other") == 3.0
    assert value(samples, "loragw:tenant_prompt_tokens_total", tenant="other") == 20
    assert value(samples, "loragw:tenant_generation_tokens_total", tenant="acme") == 10
    assert not any(dict(labels).get("tenant") == "initech" for _, labels in samples)


def test_engine_collector_gives_one_series_per_resident_adapter_and_observes_each_load_once():
    engine = FakeEngineClient(registry=None)
    base = engine.engine_stats
    metrics = fake_metrics(engine)
    pirate, terse = ("pirate", 1, "d1"), ("terse-json", 3, "d3")
    engine.engine_stats = dataclasses.replace(base, resident_adapters=(pirate, terse), adapter_loads=2,
                                              adapter_evictions=0, recent_adapter_load_seconds=(0.002, 0.3))
    first = scrape(metrics.render().decode())
    engine.engine_stats = dataclasses.replace(engine.engine_stats, resident_adapters=(terse,), adapter_loads=3,
                                              adapter_evictions=1, recent_adapter_load_seconds=(0.002, 0.3, 0.004))
    second = scrape(metrics.render().decode())
    w = {"worker": "0"}
    assert value(first, "loragw:lora_adapter_resident", adapter="pirate", version="1", **w) == 1
    assert value(first, "loragw:lora_adapter_resident", adapter="terse-json", version="3", **w) == 1
    assert ("loragw:lora_adapter_resident", (("adapter", "pirate"), ("version", "1"), ("worker", "0"))) not in second
    assert value(second, "loragw:lora_adapter_loads_total", **w) == 3
    assert value(second, "loragw:lora_adapter_evictions_total", **w) == 1
    assert value(first, "loragw:lora_adapter_load_seconds_count", **w) == 2
    assert value(second, "loragw:lora_adapter_load_seconds_count", **w) == 3  # not 5: each load counted once
    assert value(second, "loragw:lora_adapter_load_seconds_bucket", le="0.005", **w) == 2
    assert value(second, "loragw:rejected_requests_total", tier="standard", reason="max_waiting") == 3
    assert value(second, "loragw:kv_cache_blocks", tier="standard", state="free", **w) == 256 - 64


# ---- who may read them ----------------------------------------------------------------


def gateway_with_usage(tmp_path, **config) -> Gateway:
    """A gateway (no model, a store never touched) whose metrics bill `acme`
    and serve a request to its adapter `acme-secret-lora`."""
    gateway = Gateway(config=GatewayConfig(**config), store=_UnusedStore(), engine=FakeEngineClient(registry=None),
                      admission=FakeAdmission())
    gateway.metrics = fake_metrics(gateway.engine)
    gateway.metrics.count_usage("acme", gpu_us=2_000_000, prompt_tokens=10, completion_tokens=5)
    gateway.metrics.ttft.labels("standard", "acme-secret-lora").observe(0.1)
    return gateway


class _UnusedStore:
    async def close(self) -> None:
        pass


@pytest.mark.parametrize("config", [{"admin_token": ADMIN_TOKEN}, {}], ids=["admin-token", "no-admin-token"])
@pytest.mark.parametrize("auth", [None, "Bearer lgw-a-tenant-key", "Bearer " + ADMIN_TOKEN[:-1]])
def test_metrics_on_the_public_port_need_the_admin_token(tmp_path, config, auth):
    """Defect 8: any caller read every tenant's name, usage and adapters."""
    with TestClient(create_app(gateway_with_usage(tmp_path, **config))) as client:
        r = client.get("/metrics", headers={"Authorization": auth} if auth else {})
    assert r.status_code == 401
    assert r.json()["error"]["type"] == "authentication_error" and r.json()["error"]["code"]
    assert "acme" not in r.text and "loragw:" not in r.text


def test_metrics_on_the_public_port_with_the_admin_token(tmp_path):
    with TestClient(create_app(gateway_with_usage(tmp_path, admin_token=ADMIN_TOKEN))) as client:
        r = client.get("/metrics", headers=ADMIN)
    assert r.status_code == 200
    samples = scrape(r.text)
    assert value(samples, "loragw:tenant_gpu_seconds_total", tenant="acme") == 2.0
    assert value(samples, "loragw:time_to_first_token_seconds_count", tier="standard", adapter="acme-secret-lora") == 1


def test_metrics_listener_serves_metrics_without_auth_and_nothing_else(tmp_path):
    gateway = gateway_with_usage(tmp_path, admin_token=ADMIN_TOKEN)
    with TestClient(metrics_app(gateway)) as client:
        r = client.get("/metrics")
        assert r.status_code == 200
        assert value(scrape(r.text), "loragw:tenant_gpu_seconds_total", tenant="acme") == 2.0
        for path in ("/v1/models", "/admin/tenants", "/admin/alerts", "/health", "/openapi.json"):
            assert client.get(path, headers=ADMIN).status_code == 404, path


# ---- the live gateway ----------------------------------------------------------------

SERIES = [
    "loragw:time_to_first_token_seconds", "loragw:time_per_output_token_seconds",
    "loragw:e2e_request_latency_seconds", "loragw:request_queue_time_seconds",
    "loragw:request_success", "loragw:prompt_tokens", "loragw:generation_tokens",
    "loragw:num_requests_running", "loragw:num_requests_waiting", "loragw:num_preemptions",
    "loragw:num_steps_dropped",
    "loragw:kv_cache_usage_perc", "loragw:kv_cache_tier_usage_perc", "loragw:kv_cache_blocks",
    "loragw:prefix_cache_queries", "loragw:prefix_cache_hits", "loragw:rejected_requests",
    "loragw:admission_waiting_requests", "loragw:admission_queued_prompt_tokens",
    "loragw:lora_adapter_resident", "loragw:lora_adapter_loads", "loragw:lora_adapter_evictions",
    "loragw:lora_adapter_load_seconds",
    "loragw:tenant_gpu_seconds", "loragw:tenant_prompt_tokens", "loragw:tenant_generation_tokens",
]


@pytest.fixture(scope="module")
def live(tiny_llama_dir, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("live-metrics")
    db_url = f"sqlite+aiosqlite:///{tmp / 'loragw.db'}"
    keys = seed_tenants(db_url, {"vip": Tier.PREMIUM, "crowd": Tier.STANDARD,
                                 "capped": (Tier.STANDARD, TenantLimits(requests_per_minute=1))})
    # One seat: a premium request arriving while a standard one runs takes
    # its seat, which preempts the standard one (the premium seat rule).
    engine = EngineConfig.from_flat(model=str(tiny_llama_dir), max_num_seqs=1, num_kv_blocks=256,
                                    premium_reserved_fraction=0.2, data_dir=str(tmp / "data"))
    gw = build_in_process_gateway(GatewayConfig(db_url=db_url, engine=engine, data_dir=tmp / "data", admin_token=ADMIN_TOKEN,
                                     metrics_port=0, standard=TierLimits(max_waiting=8),
                                     premium=TierLimits(max_waiting=8)))
    server = start_live_server(gw)
    server.keys = keys
    server.model = gw.served_model_name
    yield server
    server.stop()


async def complete(client: httpx.AsyncClient, key: str, model: str, tokens: int, *, stream: bool = False) -> int:
    body = {"model": model, "prompt": "Once upon a time", "max_tokens": tokens, "min_tokens": tokens,
            "temperature": 0.0, "stream": stream}
    async with client.stream("POST", "/v1/completions", json=body, headers={"Authorization": f"Bearer {key}"}) as r:
        await r.aread()
        return r.status_code


def test_metrics_after_a_small_workload(live):
    gw = live.gateway

    async def workload():
        async with httpx.AsyncClient(base_url=live.url, timeout=120) as client:
            long = asyncio.create_task(complete(client, live.keys["crowd"], live.model, 300, stream=True))
            deadline = time.monotonic() + 30
            while gw.engine.stats().num_running[Tier.STANDARD] == 0:  # the standard one holds the seat
                assert time.monotonic() < deadline
                await asyncio.sleep(0.01)
            premium = [await complete(client, live.keys["vip"], live.model, 4) for _ in range(2)]
            capped = [await complete(client, live.keys["capped"], live.model, 2) for _ in range(3)]
            return premium, capped, await long

    premium, capped, long = asyncio.run(workload())
    assert premium == [200, 200] and capped == [200, 429, 429] and long == 200
    gpu_s = "loragw:tenant_gpu_seconds_total", (("tenant", "vip"),)
    billed = scrape(gw.metrics.render().decode()).get(gpu_s, 0.0)  # what billing counted, if it is wired
    gw.metrics.count_usage("vip", gpu_us=250_000, prompt_tokens=10, completion_tokens=8)

    # The public port keeps them from tenants; the metrics listener needs no token.
    public = httpx.get(f"{live.url}/metrics", headers={"Authorization": f"Bearer {live.keys['vip']}"})
    assert public.status_code == 401 and "vip" not in public.text and "crowd" not in public.text
    assert httpx.get(f"{live.url}/metrics", headers=ADMIN).status_code == 200
    response = httpx.get(f"{live.metrics_url}/metrics")
    assert response.status_code == 200 and response.headers["content-type"].startswith("text/plain")
    families = {f.name for f in text_string_to_metric_families(response.text)}
    assert set(SERIES) <= families, set(SERIES) - families
    samples = scrape(response.text)
    success = "loragw:request_success_total"
    assert value(samples, success, tier="premium", finished_reason="length") == 2
    assert value(samples, success, tier="standard", finished_reason="length") == 2  # the long one and capped's
    assert value(samples, success, tier="standard", finished_reason="error") == 0
    assert value(samples, "loragw:time_to_first_token_seconds_count", tier="premium", adapter="base") == 2
    assert value(samples, "loragw:time_per_output_token_seconds_count", tier="standard", adapter="base") == 2
    assert value(samples, "loragw:generation_tokens_total", tier="premium") == 8
    assert value(samples, "loragw:generation_tokens_total", tier="standard") == 302
    assert value(samples, "loragw:rejected_requests_total", tier="standard", reason="requests_per_minute") == 2
    assert value(samples, "loragw:rejected_requests_total", tier="premium", reason="requests_per_minute") == 0
    # Each premium arrival took the running standard request's only seat.
    w = {"worker": "0"}  # the in-process engine is the one worker
    assert value(samples, "loragw:num_preemptions_total", tier="standard", **w) >= 1
    assert value(samples, "loragw:num_preemptions_total", tier="premium", **w) == 0
    assert value(samples, "loragw:num_preemptions_total", tier="standard", **w) == \
        gw.engine.stats().num_preemptions[Tier.STANDARD]
    assert value(samples, "loragw:num_steps_dropped_total", **w) == gw.engine.stats().steps_dropped
    assert value(samples, "loragw:num_requests_running", tier="standard", **w) == 0
    assert value(samples, "loragw:kv_cache_blocks", tier="premium", state="reserved", **w) == \
        gw.engine.stats().kv_premium_reserved_blocks > 0
    assert value(samples, "loragw:prefix_cache_queries_total", **w) > 0
    assert samples[gpu_s] == pytest.approx(billed + 0.25)
    assert "request_id" not in response.text
