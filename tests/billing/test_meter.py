"""The meter on hand-built StepUsages: exact splits, forks, recompute
attribution, adapter loads and overhead."""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

from adapters.slot_load import AdapterLoad
from billing.meter import PLATFORM_OVERHEAD, Account, Meter, split_exact
from engine.request import Tier
from engine.step_io import Preemption, RequestStepUsage, StepUsage

ALICE = Account("t-alice", "alice", "k1", "premium")
BOB = Account("t-bob", "bob", "k2", "standard")


def usage(request_id, *, prompt=0, cached=0, recomputed=0, decode=0, group_id=""):
    return RequestStepUsage(request_id=request_id, tier=Tier.STANDARD, adapter_key=None,
                            prompt_tokens_computed=prompt, prompt_tokens_cached=cached,
                            recomputed_tokens=recomputed, decode_tokens=decode, group_id=group_id or request_id)


@given(st.integers(0, 10**9), st.lists(st.integers(0, 5000), min_size=1, max_size=40))
def test_split_exact_sums_to_the_total_and_stays_proportional(total, weights):
    shares = split_exact(total, weights)
    if sum(weights) == 0:
        assert shares == [0] * len(weights)
        return
    assert sum(shares) == total
    for share, weight in zip(shares, weights):
        exact = total * weight / sum(weights)
        assert exact - 1 < share < exact + 1


def test_busy_time_is_split_by_computed_tokens():
    meter = Meter()
    meter.register("a", ALICE)
    meter.register("b", BOB)
    meter.on_step(StepUsage(1, 1000, (usage("a", prompt=3, cached=16), usage("b", decode=1))))
    a, b = meter.settle("a"), meter.settle("b")
    assert (a.gpu_us, b.gpu_us) == (750, 250)
    assert a.cached_prompt_tokens == 16


def test_forks_are_summed_into_their_request():
    meter = Meter()
    meter.register("r", ALICE)
    meter.on_step(StepUsage(1, 900, (usage("r", decode=1), usage("r#1", decode=1, group_id="r"),
                                     usage("r#2", decode=1, group_id="r"))))
    assert meter.settle("r").gpu_us == 900


def test_recompute_is_owed_by_the_request_that_preempted():
    meter = Meter()
    meter.register("victim", BOB)
    meter.register("premium", ALICE)
    meter.on_step(StepUsage(1, 100, (usage("victim", prompt=10),)))
    meter.on_step(StepUsage(2, 200, (usage("premium", prompt=10),),
                            preemptions=(Preemption("victim", Tier.STANDARD, caused_by="premium"),)))
    assert meter.settle("premium").gpu_us == 200  # the premium request ends before the victim resumes
    meter.on_step(StepUsage(3, 300, (usage("victim", recomputed=10, decode=5),)))
    victim = meter.settle("victim")
    assert victim.gpu_us == 100 + 100
    [charge] = victim.recompute_charges
    assert (charge.payer, charge.payer_request_id, charge.recompute_us) == (ALICE, "premium", 200)


def test_self_preemption_recompute_goes_to_the_platform():
    meter = Meter()
    meter.register("r", BOB)
    meter.on_step(StepUsage(1, 10, (usage("r", prompt=4),), preemptions=(Preemption("r", Tier.STANDARD, None),)))
    meter.on_step(StepUsage(2, 10, (usage("r", recomputed=4),)))
    [charge] = meter.settle("r").recompute_charges
    assert (charge.payer, charge.payer_request_id, charge.recompute_us) == (PLATFORM_OVERHEAD, None, 10)


def test_adapter_loads_come_out_of_the_step_first():
    meter = Meter()
    meter.register("r", BOB)
    key = ("pirate", 1, "d" * 64)
    meter.on_step(StepUsage(1, 1000, (usage("r", prompt=8),), adapter_loads=(AdapterLoad(key, 300),)))
    [load] = meter.take_adapter_loads()
    assert (load.adapter_key, load.load_us) == (key, 300)
    assert meter.settle("r").gpu_us == 700
    # A load longer than the step's measured time is capped by it.
    meter.on_step(StepUsage(2, 50, (), adapter_loads=(AdapterLoad(key, 80),)))
    assert meter.take_adapter_loads()[0].load_us == 50


def test_unknown_and_late_usage_is_overhead():
    meter = Meter()
    meter.register("r", BOB)
    meter.on_step(StepUsage(1, 40, (usage("r", prompt=1), usage("stranger", prompt=1))))
    assert meter.settle("r").gpu_us == 20
    meter.on_step(StepUsage(2, 30, (usage("r", decode=1),)))  # an abort racing the running step
    assert meter.take_overhead_us() == 20 + 30
    assert meter.overhead_total_us == 50 and meter.busy_total_us == 70
    assert meter.settle("r") is None


def test_a_step_that_names_no_request_is_overhead():
    """What Scheduler.interrupted reports for a step dropped for a premium arrival."""
    meter = Meter()
    meter.register("r", BOB)
    meter.on_step(StepUsage(1, 70, ()))
    meter.on_step(StepUsage(2, 30, (usage("r", prompt=4),)))
    assert meter.settle("r").gpu_us == 30
    assert meter.take_overhead_us() == 70 and meter.busy_total_us == 100
