"""When standard work gives way to premium inside a step, by step count:
the cap on standard prefill and the window it holds in, the standard
decodes a premium prefill step leaves out, and which standard steps a
premium arrival may drop part way. Bookkeeping over step ids only;
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


class TierSteps:
    def __init__(self, config: SchedulerConfig):
        self.config = config
        self._premium_arrival_step: int | None = None  # the step of the latest premium arrival
        self._decodes_deferred_step: int | None = None  # the latest step that left standard decodes out
        self._deferred_in_a_row = 0  # steps up to that one that left them out, back to back
        self._standard_step = -1  # the latest step that carried standard work
        self._dropped_step: int | None = None  # the latest step dropped part way

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

    def interruptible(self, step_id: int, premium_prefill: bool, standard: bool) -> bool:
        """Whether step `step_id` may be dropped part way for a premium
        arrival: with `premium_interrupts_steps`, a step that carries
        standard work and no premium prefill, unless the step that carried
        standard work before it was dropped. So standard work completes at
        least every other step it is in, whatever premium sends."""
        if not standard:
            return False
        previous, self._standard_step = self._standard_step, step_id
        cfg = self.config
        return (cfg.enable_tiers and cfg.premium_interrupts_steps and not premium_prefill
                and (self._dropped_step is None or previous > self._dropped_step))

    def dropped(self, step_id: int) -> None:
        self._dropped_step = step_id
