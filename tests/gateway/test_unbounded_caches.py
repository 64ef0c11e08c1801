"""Robustness test 6: no state keyed by client input grows without bound.

Thousands of distinct tenants (most of them never seen again, as a deleted
tenant is not) go through each map keyed by tenant, key, adapter or
request id; each stays within its stated bound, and dropping state never
forgives a tenant its limits. (The auth cache's bound is tested in
test_auth_cache.py.)"""

from __future__ import annotations

import pytest
from prometheus_client.parser import text_string_to_metric_families

from billing.meter import Account, Meter
from engine.step_io import Preemption, RequestStepUsage, StepUsage
from gateway.admission import AdmissionController
from gateway.config import TierLimits
from gateway.engine_client import KVCapacity
from gateway.errors import RateLimited
from gateway.metrics import OTHER, GatewayMetrics
from gateway.tenancy import Principal, Tenant, TenantLimits, Tier
from gateway.tenant_limits import _MIN_SWEEP_AT
from tests.gateway.fakes import ManualClock


def _principal(name: str, **limits) -> Principal:
    return Principal(Tenant(id=f"id-{name}", name=name, tier=Tier.STANDARD, limits=TenantLimits(**limits)),
                     key_id=f"key-{name}")


def _controller(clock) -> AdmissionController:
    big = TierLimits(max_waiting=100_000, max_queued_tokens=10**9)
    return AdmissionController({Tier.PREMIUM: big, Tier.STANDARD: big},
                               lambda: KVCapacity(total_tokens=10**6, premium_reserved_tokens=0), clock=clock)


@pytest.mark.anyio
async def test_unbounded_caches_admission_forgets_idle_and_deleted_tenants():
    clock = ManualClock()
    ctl = _controller(clock)
    for batch in range(20):  # 10,000 tenants, 500 a minute, none seen twice
        for i in range(500):
            limits = {"requests_per_minute": 5, "tokens_per_minute": 1000} if i % 2 else {}
            (await ctl.admit(_principal(f"t{batch}-{i}", **limits), prompt_tokens=5, max_tokens=5)).release(
                completion_tokens=5)
            assert ctl.tenant_limiter.tracked_tenants() <= _MIN_SWEEP_AT
        clock.now += 61  # every bucket of this batch is full again
    # A tenant that comes back after being forgotten starts as it would have: a full budget.
    back = _principal("t0-1", requests_per_minute=5, tokens_per_minute=1000)
    tickets = [await ctl.admit(back, prompt_tokens=5, max_tokens=5) for _ in range(5)]
    with pytest.raises(RateLimited):
        await ctl.admit(back, prompt_tokens=5, max_tokens=5)
    for t in tickets:
        t.release()


@pytest.mark.anyio
async def test_unbounded_caches_forgetting_idle_tenants_never_forgives_a_limited_one():
    clock = ManualClock()
    ctl = _controller(clock)
    hog = _principal("hog", requests_per_minute=1)
    busy = _principal("busy", max_concurrent=1)
    (await ctl.admit(hog, prompt_tokens=1, max_tokens=1)).release()
    held = await ctl.admit(busy, prompt_tokens=1, max_tokens=1)
    for i in range(3 * _MIN_SWEEP_AT):  # sweeps run; the flood's own states are idle at once
        (await ctl.admit(_principal(f"flood-{i}"), prompt_tokens=1, max_tokens=1)).release()
    assert ctl.tenant_limiter.tracked_tenants() <= _MIN_SWEEP_AT
    with pytest.raises(RateLimited, match="requests per minute"):
        await ctl.admit(hog, prompt_tokens=1, max_tokens=1)
    with pytest.raises(RateLimited, match="concurrent"):
        await ctl.admit(busy, prompt_tokens=1, max_tokens=1)
    held.release()
    (await ctl.admit(busy, prompt_tokens=1, max_tokens=1)).release()


def _usage(request_id: str) -> RequestStepUsage:
    return RequestStepUsage(request_id=request_id, tier=Tier.STANDARD, adapter_key=None, prompt_tokens_computed=0,
                            prompt_tokens_cached=0, recomputed_tokens=0, decode_tokens=1)


def test_unbounded_caches_meter_keeps_nothing_for_settled_or_unknown_requests():
    meter = Meter()
    account = Account("id-a", "a", "key-a", "standard")
    for i in range(2000):
        rid = f"req-{i}"
        meter.register(rid, account)
        meter.on_step(StepUsage(2 * i, 100, (_usage(rid),)))
        meter.settle(rid)
        # A late step of the settled request, and a preemption of it and of an unknown one.
        meter.on_step(StepUsage(2 * i + 1, 100, (_usage(rid),),
                                preemptions=(Preemption(rid, Tier.STANDARD, caused_by=None),
                                             Preemption(f"ghost-{i}", Tier.STANDARD, caused_by=rid))))
    assert (len(meter._open), len(meter._seq_group), len(meter._payer)) == (0, 0, 0)


def test_unbounded_caches_adapter_owners_keep_the_versions_seen_last():
    from gateway.metering import MAX_KNOWN_OWNERS, AdapterOwners

    owners = AdapterOwners()
    account = Account("id-a", "a", None, "standard")
    owners.saw("kept", 1, account)
    for i in range(MAX_KNOWN_OWNERS + 500):  # a tenant uploading new versions without end
        owners.saw(f"lora-{i}", 1, account)
        if i % 1000 == 0:
            owners.saw("kept", 1, account)  # in use again: not the oldest
    assert len(owners) == MAX_KNOWN_OWNERS
    assert owners.get("kept", 1) == account and owners.get(f"lora-{MAX_KNOWN_OWNERS + 499}", 1) == account
    assert owners.get("lora-0", 1) is None and owners.get("kept", 2) is None


class _NoEngine:
    def snapshots(self):
        return {}  # no engine is up


def test_unbounded_caches_metrics_tenant_labels_stay_within_their_limit():
    ctl = _controller(ManualClock())
    metrics = GatewayMetrics(engine=_NoEngine(), admission=ctl, max_tenant_labels=8)
    for i in range(2000):
        metrics.count_usage(tenant=f"tenant-{i}", gpu_us=10, prompt_tokens=1, completion_tokens=1)
    tenants = {s.labels["tenant"] for f in text_string_to_metric_families(metrics.render().decode())
               for s in f.samples if "tenant" in s.labels}
    assert len(tenants) == 9 and OTHER in tenants
