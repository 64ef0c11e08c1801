"""Iteration-level scheduler with two SLO tiers.

Pure Python: no torch, no I/O, no clock. Each `schedule()` picks the token
slices of one step under `max_num_batched_tokens` and `max_num_seqs`;
`update()` takes the runner's samples back, advances every request and
yields the step's usage record (engine/step_update.py, the second half).

Order of a step:
  0. If the waiting premium requests cannot fit, preempt running standard
     requests (newest first) until they can: the head, and those behind it
     as far as the step's tokens reach (engine/premium_room.py).
  1. Running requests, decodes before prefill chunks, each in priority order
     (premium, then arrival). A request that cannot get a block preempts the
     lowest-priority running request below it, or itself if there is none,
     so a standard request never preempts a premium one.
  2. If step 1 preempted nothing, admit waiting requests, premium first,
     FCFS within a tier, with prefix-cache hits. Only a request waiting for
     an adapter slot may be passed, and only for a bounded number of steps
     (engine/adapter_slots.py).
"""

from __future__ import annotations

import bisect
from collections import deque
from dataclasses import dataclass, field

from engine.adapter_slots import AdapterSlotPolicy, SlotVerdict
from engine.config import SchedulerConfig
from engine.errors import ValidationError
from engine.kv_cache_manager import KVCacheManager
from engine.premium_room import PremiumRoom
from engine.request import AdapterKey, FinishReason, Request, RequestStatus, Tier
from engine.spec_decode.policy import SpeculationPolicy
from engine.step_io import CopyOp, Preemption, ScheduledRequest, SchedulerOutput
from engine.step_update import StepUpdates
from engine.tier_steps import TierSteps


@dataclass
class _Slice:
    request: Request
    num_new: int  # drafts included
    copies: list[CopyOp]
    drafts: list[int] = field(default_factory=list)


@dataclass
class _StepPlan:
    """The step being built; preemption may take a slice back out of it."""

    budget: int
    slices: dict[str, _Slice] = field(default_factory=dict)
    preemptions: list[Preemption] = field(default_factory=list)
    prefix_hits: list[int] = field(default_factory=list)  # blocks admissions took from the prefix cache


class Scheduler(PremiumRoom, StepUpdates):
    def __init__(self, config: SchedulerConfig, kv: KVCacheManager, adapters: AdapterSlotPolicy,
                 speculation: SpeculationPolicy | None = None):
        if config.max_model_len is None:
            raise ValidationError("max_model_len", "the scheduler needs a concrete limit (the builder "
                                                   "resolves None to the model's)")
        self.config = config
        self.kv = kv
        self.adapters = adapters
        self.speculation = speculation  # None: no speculative decoding
        self.block_size = kv.block_size
        self.waiting: dict[Tier, deque[Request]] = {Tier.PREMIUM: deque(), Tier.STANDARD: deque()}
        self.running: list[Request] = []  # kept sorted by _priority
        self.requests: dict[str, Request] = {}  # every live sequence, by id
        self.num_preemptions: dict[Tier, int] = {Tier.PREMIUM: 0, Tier.STANDARD: 0}
        self.num_steps_dropped = 0  # steps the runner dropped part way for a premium arrival
        self._finished_ids: list[str] = []
        self._step_id = 0
        self.tier_steps = TierSteps(config)

    # ---- requests in and out -------------------------------------------------

    def add_request(self, req: Request) -> None:
        req.max_model_len = self.check_request(req)
        req.status = RequestStatus.WAITING
        self.requests[req.request_id] = req
        self.waiting[self._tier(req)].append(req)
        if self._tier(req) is Tier.PREMIUM:
            self.tier_steps.premium_arrived(self._step_id)

    def check_request(self, req: Request) -> int:
        """Raise ValidationError unless `req` could be added; its token limit
        (prompt + output) if it can. Keeps no state."""
        if req.request_id in self.requests:
            raise ValidationError("request_id", f"duplicate request id {req.request_id!r}")
        if not req.prompt_token_ids:
            raise ValidationError("prompt", "the prompt is empty")
        if req.adapter_key is not None and self.adapters.max_loras < 1:
            raise ValidationError("adapter", "LoRA adapters are disabled on this engine (max_loras=0)")
        # A sequence can never hold more KV than its tier may allocate.
        usable_tokens = self.kv.usable_blocks(self._tier(req)) * self.block_size
        limit = min(req.max_model_len or self.config.max_model_len,
                    self.config.max_model_len, usable_tokens)
        if req.num_prompt_tokens >= limit:
            raise ValidationError(
                "prompt",
                f"the prompt has {req.num_prompt_tokens} tokens; this engine accepts at most "
                f"{limit - 1} so that one token can be generated",
            )
        return limit

    def abort(self, request_id: str) -> list[Request]:
        """End a request (and its forked children) in whatever state it is.
        Returns the sequences that were ended; unknown ids end nothing."""
        ended = [r for r in self.requests.values()
                 if r.request_id == request_id or r.parent_id == request_id]
        for req in ended:
            self._finish(req, FinishReason.ABORT)
        return ended

    def finish_request(self, request_id: str, reason: FinishReason) -> None:
        """End one sequence from outside (a stop string matched in the text)."""
        req = self.requests.get(request_id)
        if req is not None:
            self._finish(req, reason)

    def has_unfinished(self) -> bool:
        return bool(self.requests)

    @property
    def num_waiting(self) -> dict[Tier, int]:
        return {tier: len(q) for tier, q in self.waiting.items()}

    @property
    def waiting_adapters(self) -> tuple[AdapterKey, ...]:
        """The distinct adapters of the waiting requests, in queue order."""
        keys = (req.adapter_key for q in self.waiting.values() for req in q if req.adapter_key is not None)
        return tuple(dict.fromkeys(tuple(key) for key in keys))

    @property
    def num_running(self) -> dict[Tier, int]:
        counts = {Tier.PREMIUM: 0, Tier.STANDARD: 0}
        for req in self.running:
            counts[req.tier] += 1
        return counts

    # ---- one step --------------------------------------------------------------

    def schedule(self) -> SchedulerOutput:
        self._step_id += 1
        plan = _StepPlan(budget=self.config.max_num_batched_tokens)
        premium_head_fits = self._make_room_for_premium(plan)
        num_admission_preemptions = len(plan.preemptions)

        # Decodes first (one token each, at most one new block), then tier by
        # tier the prefill chunks and admissions: premium prefill never waits
        # behind standard prefill, which keeps premium TTFT near an idle
        # server's. Standard decodes still go before premium prefill so that
        # they grow in the shared pool and premium can use its reserve, unless
        # they wait this step out (TierSteps.defer_standard_decodes).
        decodes = [r for r in self.running if r.num_remaining_tokens == 1]
        premium_decodes = [r for r in decodes if self._tier(r) is Tier.PREMIUM]
        if len(premium_decodes) < len(decodes) and self.tier_steps.defer_standard_decodes(
                self._step_id, premium_head_fits or self._premium_prompt_in_progress()):
            decodes = premium_decodes
        speculate = self.speculation is not None and self.speculation.speculates_this_step(len(decodes))
        self._schedule_running_all(decodes, plan, speculate)
        for tier in self._tier_order():
            budget_before = plan.budget
            held_back = self.tier_steps.held_back(plan.budget, tier, self._step_id)
            plan.budget -= held_back
            self._schedule_running_all([r for r in self.running if r.num_remaining_tokens > 1
                                        and self._tier(r) is tier], plan)
            # Under memory pressure, admitting more would only preempt again.
            if len(plan.preemptions) == num_admission_preemptions:
                self._admit_waiting(plan, tier)
            plan.budget += held_back
            if (tier is Tier.PREMIUM and plan.budget < budget_before
                    and self.config.premium_prefill_alone):
                break  # premium prefill runs without standard prefill beside it

        finished, self._finished_ids = self._finished_ids, []
        return SchedulerOutput(
            step_id=self._step_id,
            requests=[self._scheduled(s) for s in plan.slices.values()],
            copies=[c for s in plan.slices.values() for c in s.copies],
            preemptions=plan.preemptions,
            finished_ids=finished,
            droppable_share=self._droppable_share(plan),
        )

    def _droppable_share(self, plan: _StepPlan) -> float:
        slices = plan.slices.values()
        premium_prefill = any(s.request.tier is Tier.PREMIUM and s.request.num_remaining_tokens > 1 for s in slices)
        standard = any(s.request.tier is Tier.STANDARD for s in slices)
        share = self.tier_steps.droppable_share(self._step_id, premium_prefill, standard)
        if not share or not plan.prefix_hits:
            return share
        # A request admitted on blocks that this very step fills would keep
        # them as computed if the step were dropped.
        fresh = {b for s in slices for b in self.kv.fresh_hashed_blocks(s.request)}
        return share if fresh.isdisjoint(plan.prefix_hits) else 0.0

    # ---- scheduling helpers ----------------------------------------------------------

    def _schedule_running_all(self, reqs: list[Request], plan: _StepPlan, speculate: bool = False) -> None:
        for req in reqs:
            if plan.budget == 0:
                return
            if req.status is not RequestStatus.RUNNING:  # preempted earlier in this step
                continue
            if not (speculate and self._schedule_with_drafts(req, plan)):
                self._schedule_running(req, plan)

    def _schedule_with_drafts(self, req: Request, plan: _StepPlan) -> bool:
        """A decode slice of [last token] + drafts, if the request drafts and
        their slots are free: drafts never preempt anyone (False: decode it
        plainly). Draft slots hold no known token, so they are not hashed."""
        drafts = self.speculation.drafts(req, plan.budget)
        if not drafts:
            return False
        alloc = self.kv.allocate_slots(req, 1 + len(drafts))
        if alloc is None:
            return False
        plan.slices[req.request_id] = _Slice(req, 1 + len(drafts), alloc.copies, drafts)
        plan.budget -= 1 + len(drafts)
        return True

    def _schedule_running(self, req: Request, plan: _StepPlan) -> None:
        num_new = min(req.num_remaining_tokens, plan.budget)
        while True:
            alloc = self.kv.allocate_slots(req, num_new)
            if alloc is not None:
                plan.slices[req.request_id] = _Slice(req, num_new, alloc.copies)
                plan.budget -= num_new
                return
            victim = self._lowest_priority_below(req)
            if victim is None:
                self._preempt(req, plan, caused_by=None)
                return
            self._preempt(victim, plan, caused_by=req.request_id)

    def _premium_prompt_in_progress(self) -> bool:
        return any(r.tier is Tier.PREMIUM and r.num_remaining_tokens > 1 for r in self.running)

    def _tier_order(self) -> tuple[Tier, ...]:
        return (Tier.PREMIUM, Tier.STANDARD) if self.config.enable_tiers else (Tier.STANDARD,)

    def _admit_waiting(self, plan: _StepPlan, tier: Tier) -> None:
        """FCFS within the tier. Only a request held back by its adapter (no
        free slot, weights still loading) may be passed; one that does not
        fit in the KV cache stops admission, so nothing jumps it."""
        queue, i = self.waiting[tier], 0
        while i < len(queue):
            if plan.budget == 0:
                return
            req = queue[i]
            if self.running and self._num_running_seqs() + req.num_seqs > self.config.max_num_seqs:
                return
            if self.adapters.verdict(req, self._step_id) is not SlotVerdict.ADMIT:
                i += 1
                continue
            if not self._admit(req, plan):
                return
            del queue[i]

    def _num_running_seqs(self) -> int:
        return sum(r.num_seqs for r in self.running)

    def _admit(self, req: Request, plan: _StepPlan) -> bool:
        prefix = self.kv.get_computed_blocks(req)
        num_new = min(req.num_tokens - prefix.num_tokens, plan.budget)
        alloc = self.kv.allocate_slots(req, num_new, prefix)
        if alloc is None:
            return False
        if req.num_preemptions == 0:
            req.num_cached_prompt_tokens = prefix.num_tokens
        plan.prefix_hits += prefix.blocks
        req.num_computed_tokens = prefix.num_tokens
        req.status = RequestStatus.RUNNING
        self._insert_running(req)
        self.adapters.on_running(req)
        plan.slices[req.request_id] = _Slice(req, num_new, alloc.copies)
        plan.budget -= num_new
        return True

    def _blocks_to_grow(self, req: Request) -> int:
        have = len(self.kv.block_table(req.request_id))
        return max(0, -(-(req.num_computed_tokens + 1) // self.block_size) - have)

    def _lowest_priority_below(self, req: Request) -> Request | None:
        """The preemption victim for `req`: the last running request that ranks
        below it. Premium ranks above standard, so standard never picks premium."""
        if self.running and self.running[-1] is not req:
            victim = self.running[-1]
            if self._priority(victim) > self._priority(req):
                return victim
        return None

    def _preempt(self, req: Request, plan: _StepPlan, caused_by: str | None) -> None:
        taken = plan.slices.pop(req.request_id, None)
        if taken is not None:
            plan.budget += taken.num_new
        self.kv.free(req)
        self.running.remove(req)
        self.adapters.on_stopped_running(req)
        req.status = RequestStatus.PREEMPTED
        req.num_computed_tokens = 0
        req.num_preemptions += 1
        self.waiting[self._tier(req)].appendleft(req)
        self.num_preemptions[req.tier] += 1
        plan.preemptions.append(Preemption(req.request_id, req.tier, caused_by))

    def _scheduled(self, s: _Slice) -> ScheduledRequest:
        req = s.request
        start = req.num_computed_tokens
        end = start + s.num_new - len(s.drafts)  # of the known tokens
        sample = end == req.num_tokens
        return ScheduledRequest(
            request_id=req.request_id,
            group_id=req.group_id,
            token_ids=req.token_slice(start, end) + s.drafts,
            start_pos=start,
            block_table=self.kv.block_table(req.request_id),
            sample=sample,
            num_samples=req.num_seqs if sample else 1,
            sampling_params=req.sampling_params,
            prompt_token_ids=req.prompt_token_ids,
            output_token_ids=req.output_token_ids,
            adapter_key=req.adapter_key,
            tier=req.tier,
            prompt_len=req.num_prompt_tokens,
            computed_high_water=req.computed_high_water,
            cached_prompt_tokens=0 if req.cached_reported else req.num_cached_prompt_tokens,
            draft_token_ids=s.drafts,
        )

    def _finish(self, req: Request, reason: FinishReason) -> None:
        if req.status is RequestStatus.RUNNING:
            self.running.remove(req)
            self.adapters.on_stopped_running(req)
        elif req.status in (RequestStatus.WAITING, RequestStatus.PREEMPTED):
            self.waiting[self._tier(req)].remove(req)
        self.kv.free(req)
        self.adapters.forget(req)
        req.status = RequestStatus.FINISHED
        req.finish_reason = reason
        del self.requests[req.request_id]
        self._finished_ids.append(req.request_id)

    # ---- ordering ------------------------------------------------------------------

    def _tier(self, req: Request) -> Tier:
        """The queue a request waits in; with tiers off everyone is standard."""
        return req.tier if self.config.enable_tiers else Tier.STANDARD

    def _priority(self, req: Request) -> tuple[int, int, int]:
        return (self._tier(req).rank, req.arrival_seq, req.index)

    def _insert_running(self, req: Request) -> None:
        keys = [self._priority(r) for r in self.running]
        self.running.insert(bisect.bisect(keys, self._priority(req)), req)
