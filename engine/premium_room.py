"""The premium tier's room in a step, made before anything is scheduled.

`PremiumRoom._make_room_for_premium` preempts running standard requests,
newest first, until the premium request at the head of the queue fits, and
those behind it as far as the step's tokens reach, so that a burst of
premium arrivals is seated together rather than one a step; where the head
waits for an adapter slot, it first preempts the sequences of an adapter
that only standard work uses. It counts blocks, seats, adapter slots and
tokens as admission will take them, so that nobody is preempted for a
request behind the head that the step has no tokens or adapter slot for.
Scheduler inherits it, as it inherits StepUpdates, and it works on the
scheduler's state: its queues and running list, KV cache manager, adapter
slots and speculation policy. Pure Python, as the scheduler is.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import TYPE_CHECKING

from engine.adapter_slots import SlotVerdict, standard_only_adapter
from engine.request import Request, Tier

if TYPE_CHECKING:
    from engine.scheduler import _StepPlan


class PremiumRoom:
    def _make_room_for_premium(self, plan: _StepPlan) -> bool:
        """Preempt standard work so that the premium requests waiting now can
        be admitted this step: the head, then those behind it as far as the
        tokens left reach; whether the head now fits.

        Not only the head: with every seat taken, a burst of premium
        arrivals would otherwise be admitted one a step, each prompt step
        after the last, where an idle server prefills them together.
        Done before anything is scheduled, so the victims give back blocks that
        hold only computed KV and no slice has to be unwound."""
        queue = self.waiting[Tier.PREMIUM]
        if not self.config.enable_tiers or not queue:
            return False
        head = queue[0]
        verdict = self.adapters.verdict(head, self._step_id)
        if verdict is SlotVerdict.WAIT_SLOT:
            # Every slot holds another adapter: free one that only standard work uses.
            key = standard_only_adapter(self.running)
            for victim in [r for r in self.running if key is not None and r.adapter_key == key]:
                self._preempt(victim, plan, caused_by=head.request_id)
            verdict = self.adapters.verdict(head, self._step_id)
        if verdict is not SlotVerdict.ADMIT:
            return False  # it could not run this step anyway
        # Blocks the running requests will take this step come first.
        needed = sum(self._blocks_to_grow(r) for r in self.running)
        # Seats too: with max_num_seqs standard requests running, premium
        # would otherwise wait for one of them to finish.
        seats = self._num_running_seqs() - self.config.max_num_seqs
        # What admission will have left, so that nobody is preempted for a
        # request the step then has no tokens for.
        left = plan.budget - self._tokens_before_premium_admission()
        for req in self._premium_burst(list(queue)):
            if req is not head and left <= 0:
                break
            chunk = min(req.num_tokens, plan.budget if req is head else left)
            left -= chunk
            needed += -(-chunk // self.block_size)
            seats += req.num_seqs
            while self.kv.num_free_blocks() < needed or seats > 0:
                victim = next((r for r in reversed(self.running) if r.tier is Tier.STANDARD), None)
                if victim is None:
                    return req is not head
                needed -= self._blocks_to_grow(victim)
                seats -= victim.num_seqs
                self._preempt(victim, plan, caused_by=req.request_id)
        return True

    def _tokens_before_premium_admission(self) -> int:
        """Tokens that running requests take in this step before waiting
        premium requests are admitted: every decode (standard ones may yet
        wait the step out), with as many drafts as each may carry, and the
        running premium prompts' chunks."""
        per_decode = 1 + (self.speculation.config.num_speculative_tokens if self.speculation is not None else 0)
        return sum(per_decode if r.num_remaining_tokens == 1 else
                   r.num_remaining_tokens if r.tier is Tier.PREMIUM else 0 for r in self.running)

    def _premium_burst(self, queue: list[Request]) -> Iterator[Request]:
        """The head (already admissible), then the requests behind it up to
        the first whose adapter cannot run this step, with the adapter slots
        that the ones before it take counted. `_admit_waiting` stops at that
        one too when the seats are full, so nobody after it is seated in
        vain. It reads the slots itself: `verdict` would start a
        slot-starvation clock for a request that admission does not reach."""
        keys = set()
        for req in queue:
            key = req.adapter_key
            if key is not None and req is not queue[0] and not (
                    self.adapters.is_ready(key) and self.adapters.has_slot(key, keys)):
                return
            if key is not None:
                keys.add(key)
            yield req
