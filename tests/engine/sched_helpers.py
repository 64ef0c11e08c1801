"""Drive a Scheduler with hand-built runner outputs: no torch, no model."""

from __future__ import annotations

import itertools

from engine.adapter_slots import AdapterSlotPolicy
from engine.config import SchedulerConfig
from engine.kv_cache_manager import KVCacheManager
from engine.request import Request, Tier
from engine.sampling_params import SamplingParams
from engine.scheduler import Scheduler
from engine.step_io import RunnerOutput, SampledToken, SchedulerOutput, StepResult

EOS = 0


def make_scheduler(num_blocks=64, block_size=4, *, budget=64, max_seqs=16, reserved=0,
                   max_model_len=4096, prefix_caching=True, tiers=True, max_loras=4,
                   max_slot_wait_steps=32, adapter_policy=None, premium_prefill_alone=False) -> Scheduler:
    """`premium_prefill_alone` is off by default here so that tests can build
    mixed-tier states in one step; tests of that rule turn it on."""
    kv = KVCacheManager(num_blocks, block_size, premium_reserved_blocks=reserved,
                        enable_prefix_caching=prefix_caching)
    cfg = SchedulerConfig(max_num_batched_tokens=budget, max_num_seqs=max_seqs, max_model_len=max_model_len,
                          enable_tiers=tiers, premium_prefill_alone=premium_prefill_alone)
    return Scheduler(cfg, kv, adapter_policy or AdapterSlotPolicy(max_loras, max_slot_wait_steps))


_arrivals = itertools.count()


def make_request(rid: str, prompt_len: int = 8, *, tier=Tier.STANDARD, max_tokens=4, n=1,
                 first_token=None, adapter=None, **params) -> Request:
    """Requests get distinct tokens (no accidental prefix hits) unless
    `first_token` is given."""
    arrival = next(_arrivals)
    base = first_token if first_token is not None else 100 + 100 * arrival
    prompt = [base + (i % 50) for i in range(prompt_len)]
    return Request(request_id=rid, prompt_token_ids=prompt,
                   sampling_params=SamplingParams(max_tokens=max_tokens, n=n, temperature=0.0, **params),
                   arrival_seq=arrival, tier=tier, eos_token_ids=frozenset({EOS}), adapter_key=adapter)


def run_output(sched: SchedulerOutput, token: int = 7) -> RunnerOutput:
    """The runner's side of a step: every sampling slice draws `token` (sample j draws token + j)."""
    sampled = {r.request_id: [SampledToken(token + j) for j in range(r.num_samples)]
               for r in sched.requests if r.sample}
    return RunnerOutput(sampled=sampled, busy_time_us=1000)


def step(s: Scheduler, token: int = 7) -> tuple[SchedulerOutput, StepResult]:
    out = s.schedule()
    return out, s.update(out, run_output(out, token))


def slices(out: SchedulerOutput) -> dict[str, int]:
    return {r.request_id: r.num_tokens for r in out.requests}
