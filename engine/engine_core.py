"""One engine step: schedule, execute, update. No tokenizer, no clock."""

from __future__ import annotations

from collections.abc import Callable

from engine.runner import ModelRunner
from engine.scheduler import Scheduler
from engine.step_io import SchedulerOutput, StepResult


class EngineCore:
    def __init__(self, scheduler: Scheduler, runner: ModelRunner):
        self.scheduler = scheduler
        self.runner = runner
        self.last_schedule: SchedulerOutput | None = None

    def step(self, interrupt: Callable[[], bool] | None = None) -> StepResult | None:
        """Run one step; None when there was nothing to compute. `interrupt`
        says whether a premium request is waiting to be scheduled; a step
        within its droppable share is then dropped (a StepResult with usage
        and no updates)."""
        sched = self.scheduler.schedule()
        self.last_schedule = sched
        if sched.is_empty and not sched.copies:
            if sched.finished_ids:
                self.runner.drop(sched.finished_ids)
            return None
        runner_out = self.runner.execute(sched, interrupt)
        if runner_out.interrupted:
            return self.scheduler.interrupted(sched, runner_out)
        return self.scheduler.update(sched, runner_out)
