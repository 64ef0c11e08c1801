"""The fleet simulation (benchmarks/fleet_sim.py) on a tiny fleet: every
request it lets in is accounted for, and the real scheduler each simulated
worker runs keeps its invariants after every step."""

from __future__ import annotations

import random
import sys
from collections import Counter
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))

from fleet_sim import make_fleet  # noqa: E402
from sim_fleet import Workload, WorkloadShape  # noqa: E402
from sim_worker import SimWorker, WorkerShape  # noqa: E402
from step_time import FEATURES, StepFeatures, StepTimeModel, fit  # noqa: E402

from engine.request import RequestStatus, Tier  # noqa: E402

# GPU-like step times: ~10 ms a step, so a few simulated seconds are a few
# hundred steps per worker.
MODEL = StepTimeModel(intercept_s=0.008, coefficients_s={"tokens": 2e-5, "decode_rows": 5e-5,
                                                          "distinct_adapters": 5e-4, "adapter_loads": 2e-3},
                      r2=1.0, num_samples=0, measured_on={"note": "test"})
SHAPE = WorkerShape(num_kv_blocks=96, max_num_seqs=16, max_loras=2, max_cpu_loras=4)
WORKLOAD = WorkloadShape(num_adapters=20, num_tenants=5, system_prompt=(16, 96), user_prompt=(8, 64),
                         mean_output=12, max_output=40)


def check_scheduler(worker: SimWorker) -> None:
    sched = worker.scheduler
    waiting = [r for q in sched.waiting.values() for r in q]
    assert {r.request_id for r in waiting}.isdisjoint(r.request_id for r in sched.running)
    assert {r.request_id for r in waiting + sched.running} == set(sched.requests)
    assert all(r.status in (RequestStatus.WAITING, RequestStatus.PREEMPTED) for r in waiting)
    assert all(r.status is RequestStatus.RUNNING for r in sched.running)
    priorities = [(r.tier.rank, r.arrival_seq, r.index) for r in sched.running]
    assert priorities == sorted(priorities)
    assert sum(r.num_seqs for r in sched.running) <= sched.config.max_num_seqs
    for req in sched.running:
        assert req.num_computed_tokens <= len(sched.kv.block_table(req.request_id)) * sched.block_size
    adapters = Counter(r.adapter_key for r in sched.running if r.adapter_key is not None)
    assert adapters == sched.adapters.running
    assert len(adapters) <= sched.adapters.max_loras
    sched.kv.check_invariants()


def run_tiny(rates: dict[Tier, float], seed: int = 0):
    workload = Workload(WORKLOAD, seed)
    fleet = make_fleet("affinity", 4, SHAPE, MODEL, workload)
    fleet.after_step = check_scheduler
    arrivals = workload.arrivals(rates, duration_s=3.0)
    # Long enough to drain: nothing is left to abort.
    return fleet, fleet.run(arrivals, end_s=120.0)


@pytest.mark.parametrize("rates", [{Tier.PREMIUM: 5.0, Tier.STANDARD: 30.0},
                                   {Tier.PREMIUM: 5.0, Tier.STANDARD: 600.0}], ids=["light", "overload"])
def test_every_request_finishes_or_is_refused_and_the_kv_cache_empties(rates):
    fleet, run = run_tiny(rates)
    statuses = Counter(r.status for r in run.records)
    assert set(statuses) <= {"finished", "refused"}, statuses
    assert statuses["finished"] + statuses["refused"] == len(run.records) > 0
    assert run.sim_end_s < 120.0  # drained before the deadline
    for rec in run.records:
        if rec.status == "finished":
            # Forced lengths: exactly the drawn output, first token no earlier than arrival.
            assert len(rec.request.output_token_ids) == rec.arrival.output_len
            assert rec.arrival.t <= rec.first_token_t <= rec.finish_t
    for worker in fleet.workers:
        assert not worker.scheduler.has_unfinished()
        assert worker.scheduler.kv.usage().num_used == 0
        assert not worker.scheduler.adapters.running
        worker.scheduler.kv.check_invariants()
    assert fleet.in_flight == [0] * 4
    assert all(t["waiting"] == 0 and t["queued_tokens"] == 0 for t in fleet.admission.snapshot().values())


def test_overload_refuses_standard_and_never_premium():
    _, run = run_tiny({Tier.PREMIUM: 5.0, Tier.STANDARD: 600.0})
    refused = Counter(r.arrival.tier for r in run.records if r.status == "refused")
    assert refused[Tier.STANDARD] > 0
    assert refused[Tier.PREMIUM] == 0


def test_requests_of_an_adapter_share_its_system_prompt_in_the_kv_cache():
    _, run = run_tiny({Tier.PREMIUM: 5.0, Tier.STANDARD: 30.0})
    cached = sum(r.request.num_cached_prompt_tokens for r in run.records if r.status == "finished")
    assert cached > 0
    for rec in run.records:
        if rec.status == "finished":
            # A hit never covers the user's own tokens: they are random per request.
            system_prompt_len = rec.request.num_prompt_tokens - len(rec.arrival.user_prompt)
            assert rec.request.num_cached_prompt_tokens <= system_prompt_len


def test_the_fit_recovers_the_coefficients_that_made_the_samples():
    rng = random.Random(1)
    true = {"tokens": 3e-5, "decode_rows": 1e-4, "distinct_adapters": 4e-4, "adapter_loads": 3e-3}
    samples = []
    for _ in range(400):
        f = StepFeatures(rng.randint(1, 2048), rng.randint(0, 64), rng.randint(0, 8), rng.randint(0, 3))
        busy = 0.005 + sum(true[name] * getattr(f, name) for name in FEATURES)
        samples.append((f, busy * rng.uniform(0.98, 1.02)))
    model = fit(samples, {"note": "synthetic"})
    assert model.num_samples == 400 and model.r2 > 0.99
    assert model.intercept_s == pytest.approx(0.005, rel=0.2)
    for name, value in true.items():
        assert model.coefficients_s[name] == pytest.approx(value, rel=0.1), name
