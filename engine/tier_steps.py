"""When standard work gives way to premium inside a step, by step count:
the cap on standard prefill and the window it holds in, the standard
decodes a premium prefill step leaves out, and how far into a standard
step a premium arrival may drop it. Bookkeeping over step ids only;
the Scheduler asks it while it builds a step (docs/engine.md, "Scheduling")."""

from __future__ import annotations

from engine.config import SchedulerConfig
from engine.request import Tier


# Standard decodes wait out at most this many premium prefill steps in a
# row. With one, a premium request that came in while another's prompt step
# ran had its own first step carry every standard decode; on a 2-core CPU
# that step took 130-320 ms against ~125 alone under a standard flood
# (docs/benchmarks.md, "Zen 4, premium requests two at a time"). With two,
# standard decodes still run in at least one step of every three.
MAX_DEFERRED_IN_A_ROW = 2

# Premium arrivals may drop standard steps, at any layer, while the work
# thrown away, in steps, stays within a credit: each standard step that
# completes earns DROP_CREDIT_EARNED, up to DROP_CREDIT_MAX, and a drop
# spends the share of the step's layers that had run (DROP_COST_MIN at
# least). So the steps that carry standard work lose at most half of what
# they complete to drops (a third of all they compute), plus the step's
# worth the credit starts with: the bound of the older rule (no two
# standard steps dropped in a row, each in its first half). But a burst of
# premium arrivals may now drop the step that redoes a dropped one, and an
# arrival past a step's middle no longer waits out the rest. On a 2-core
# CPU under tiers.py's overload that cut the premium TTFT median by 9-19%,
# and the engine time thrown away grew from 1.3-1.9% to 2.7-4.8%
# (docs/benchmarks.md, "Zen 4, a credit for dropped steps").
DROP_CREDIT_MAX = 1.0
DROP_CREDIT_EARNED = 0.5
# A drop costs at least this, or premium arrivals timed just after each
# step starts could drop every standard step for nothing: so at most four
# drops in a row, and over any stretch of steps at most four plus two for
# each standard step that completes.
DROP_COST_MIN = 0.25


class TierSteps:
    def __init__(self, config: SchedulerConfig):
        self.config = config
        self._premium_arrival_step: int | None = None  # the step of the latest premium arrival
        self._decodes_deferred_step: int | None = None  # the latest step that left standard decodes out
        self._deferred_in_a_row = 0  # steps up to that one that left them out, back to back
        self._standard_step = -1  # the latest step that carried standard work
        self._dropped_step: int | None = None  # the latest step dropped part way
        self._drop_credit = DROP_CREDIT_MAX  # in steps' worth of work

    def premium_arrived(self, step_id: int) -> None:
        self._premium_arrival_step = step_id

    def held_back(self, budget: int, tier: Tier, step_id: int) -> int:
        """Budget that `tier`'s prefill may not use in step `step_id`: all
        past `max_standard_prefill_tokens` for standard work while the cap
        holds, else none."""
        cap = self.config.max_standard_prefill_tokens
        if cap is None or tier is not Tier.STANDARD or not self.config.enable_tiers or not self._premium_recent(step_id):
            return 0
        return max(0, budget - cap)

    def _premium_recent(self, step_id: int) -> bool:
        """Whether a premium request arrived within the cap's window of steps."""
        window = self.config.standard_prefill_cap_steps
        if window == 0:
            return True
        return self._premium_arrival_step is not None and step_id - self._premium_arrival_step <= window

    def defer_standard_decodes(self, step_id: int, premium_prefill_due: bool) -> bool:
        """Whether step `step_id`, which has standard decodes, leaves them
        out: with premium prefill alone, when premium prefill is due and
        fewer than MAX_DEFERRED_IN_A_ROW steps just before it left them out
        (recorded when it answers yes)."""
        cfg = self.config
        if not (cfg.enable_tiers and cfg.premium_prefill_alone and cfg.premium_prefill_defers_decodes):
            return False
        in_a_row = self._deferred_in_a_row if self._decodes_deferred_step == step_id - 1 else 0
        if not premium_prefill_due or in_a_row >= MAX_DEFERRED_IN_A_ROW:
            return False
        self._decodes_deferred_step, self._deferred_in_a_row = step_id, in_a_row + 1
        return True

    def droppable_share(self, step_id: int, premium_prefill: bool, standard: bool) -> float:
        """The share of its layers within which step `step_id` may be
        dropped for a premium arrival (0: not at all): with
        `premium_interrupts_steps`, a step that carries standard work and no
        premium prefill, as far as the drop credit goes. Asked once per
        step, as it also credits the standard step before, if completed."""
        if not standard:
            return 0.0
        previous, self._standard_step = self._standard_step, step_id
        if previous >= 0 and previous != self._dropped_step:
            self._drop_credit = min(DROP_CREDIT_MAX, self._drop_credit + DROP_CREDIT_EARNED)
        cfg = self.config
        if not (cfg.enable_tiers and cfg.premium_interrupts_steps) or premium_prefill:
            return 0.0
        # Float sums of layer shares can leave a crumb where none is left.
        return min(1.0, self._drop_credit) if self._drop_credit > 1e-9 else 0.0

    def dropped(self, step_id: int, share_done: float) -> None:
        """Step `step_id` was dropped with `share_done` of its layers run."""
        self._dropped_step = step_id
        self._drop_credit = max(0.0, self._drop_credit - max(DROP_COST_MIN, share_done))
