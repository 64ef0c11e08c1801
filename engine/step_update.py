"""The second half of the scheduler: taking a step's samples back.

`StepUpdates.update` advances every request of a finished step by what the
runner sampled for it (a token, a verified run of drafts, or the first
tokens of n > 1 forks) and builds the step's usage record; `interrupted`
undoes a step the runner dropped part way. Scheduler inherits both, and
they work on its state: its requests, KV cache manager, tiers' step
counters and speculation policy. Pure Python, as the scheduler is.
"""

from __future__ import annotations

from engine.request import Request, RequestStatus, fork_request_id
from engine.step_io import RequestStepUsage, RequestUpdate, RunnerOutput, SchedulerOutput, StepResult, StepUsage


class StepUpdates:
    def interrupted(self, sched: SchedulerOutput, runner: RunnerOutput) -> StepResult:
        """The runner dropped the step part way: its requests stay where they
        were, to be scheduled again, and the blocks it was to fill lose their
        hashes. Its usage names no request, so the meter books its busy time
        as platform overhead: the requests it held back did not ask for it,
        and which premium request it made way for is not known yet."""
        self.tier_steps.dropped(sched.step_id, runner.share_done)
        self.num_steps_dropped += 1
        for item in sched.requests:
            req = self.requests.get(item.request_id)
            if req is not None:
                self.kv.forget_uncomputed(req)
        return StepResult(updates=[], usage=StepUsage(
            step_id=sched.step_id, busy_time_us=runner.busy_time_us, requests=(),
            preemptions=tuple(sched.preemptions), adapter_loads=runner.adapter_loads))

    def update(self, sched: SchedulerOutput, runner: RunnerOutput) -> StepResult:
        updates: list[RequestUpdate] = []
        usage: list[RequestStepUsage] = []
        for item in sched.requests:
            # Billed from the slice alone: a request aborted after scheduling
            # still consumed this step.
            usage.append(RequestStepUsage.from_slice(item))
            req = self.requests.get(item.request_id)
            if req is None:
                continue
            req.cached_reported = True
            samples = runner.sampled.get(item.request_id, [])
            # A rejected draft's KV is garbage: it stays past num_computed_tokens,
            # to be overwritten, and is never hashed or billed as recompute.
            num_rejected = len(item.draft_token_ids) - (len(samples) - 1) if item.draft_token_ids else 0
            req.num_computed_tokens = item.start_pos + item.num_tokens - num_rejected
            req.computed_high_water = max(req.computed_high_water, req.num_computed_tokens)
            if not item.sample:
                continue
            if item.draft_token_ids:
                updates.append(self._append_run(req, item.draft_token_ids, samples))
                continue
            if item.num_samples > 1:
                updates.extend(self._fork(req, samples[1:]))
            updates.append(self._append_token(req, samples[0]))
        return StepResult(
            updates=updates,
            usage=StepUsage(
                step_id=sched.step_id,
                busy_time_us=runner.busy_time_us,
                requests=tuple(usage),
                preemptions=tuple(sched.preemptions),
                adapter_loads=runner.adapter_loads,
            ),
        )

    def _fork(self, parent: Request, samples) -> list[RequestUpdate]:
        parent.forked = True
        updates = []
        for index, sample in enumerate(samples, start=1):
            child = Request(
                request_id=fork_request_id(parent.request_id, index),
                prompt_token_ids=parent.prompt_token_ids,
                sampling_params=parent.sampling_params,
                arrival_seq=parent.arrival_seq,
                tier=parent.tier,
                adapter_key=parent.adapter_key,
                cache_salt=parent.cache_salt,
                eos_token_ids=parent.eos_token_ids,
                max_model_len=parent.max_model_len,
                parent_id=parent.request_id,
                index=index,
                num_computed_tokens=parent.num_computed_tokens,
                status=RequestStatus.RUNNING,
                computed_high_water=parent.computed_high_water,
                forked=True,
                cached_reported=True,
            )
            self.kv.fork(parent, child)
            self.requests[child.request_id] = child
            self._insert_running(child)
            self.adapters.on_running(child)
            updates.append(self._append_token(child, sample))
        return updates

    def _append_run(self, req: Request, drafts: list[int], run) -> RequestUpdate:
        """Append a verified run (accepted drafts and one more token), cut at
        the first token that finishes the request."""
        num_accepted = len(run) - 1
        assert 0 <= num_accepted <= len(drafts)
        assert [t.token_id for t in run[:num_accepted]] == drafts[:num_accepted], "a rejected draft was emitted"
        self.speculation.stats.observe(len(drafts), num_accepted)
        emitted, reason = [], None
        for sample in run:
            emitted.append(sample)
            req.output_token_ids.append(sample.token_id)
            reason = req.stop_reason(sample.token_id)
            if reason is not None:
                self._finish(req, reason)
                break
        return RequestUpdate(req.request_id, req.group_id, req.index, emitted, reason)

    def _append_token(self, req: Request, sample) -> RequestUpdate:
        req.output_token_ids.append(sample.token_id)
        reason = req.stop_reason(sample.token_id)
        if reason is not None:
            self._finish(req, reason)
        return RequestUpdate(req.request_id, req.group_id, req.index, [sample], reason)
