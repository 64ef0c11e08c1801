"""The model runner: the only code that touches tensors.

`execute()` turns a SchedulerOutput into one flattened forward pass over all
scheduled slices, samples the requests whose slice ends at their last known
token, and measures the step's busy time.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable
from functools import partial
from typing import TYPE_CHECKING

import torch

from engine.attention.base import AttentionBackend, AttentionMetadata
from engine.sampler import Sampler
from engine.spec_decode.verify import accepted_run
from engine.step_io import CopyOp, RunnerOutput, SampledToken, ScheduledRequest, SchedulerOutput

if TYPE_CHECKING:
    from adapters.runtime import LoraRuntime
    from engine.structured.runtime import GrammarRuntime


class ModelRunner:
    def __init__(
        self,
        model: torch.nn.Module,
        kv_caches: list[tuple[torch.Tensor, torch.Tensor]],
        attn_backend: AttentionBackend,
        sampler: Sampler,
        *,
        block_size: int,
        device: torch.device,
        eos_token_ids: frozenset[int] = frozenset(),
        lora: LoraRuntime | None = None,
    ):
        self.model = model
        self.kv_caches = kv_caches
        self.attn_backend = attn_backend
        self.sampler = sampler
        self.block_size = block_size
        self.device = device
        self.eos_token_ids = eos_token_ids
        self.lora = lora
        # Set by the engine when its first structured request arrives.
        self.grammar: GrammarRuntime | None = None

    def drop(self, finished_ids: list[str]) -> None:
        """Forget the per-sequence state (generators, grammars) of ended sequences."""
        self.sampler.drop(finished_ids)
        if self.grammar is not None:
            self.grammar.drop(finished_ids)

    @torch.inference_mode()
    def execute(self, sched: SchedulerOutput, interrupt: Callable[[], bool] | None = None) -> RunnerOutput:
        """Run the step. Within its droppable share of the layers,
        `interrupt()` is asked before each layer; when it says yes the step
        stops there, having written only K/V that its requests' positions
        will be written again with, and samples nothing."""
        timer = _StepTimer(self.device)
        self.drop(sched.finished_ids)
        if sched.copies:
            self._copy_blocks(sched.copies)
        sampled, interrupted, share_done = {}, False, 0.0
        if sched.requests:
            # With LoRA the batch is reordered so each adapter's tokens are contiguous.
            reqs = self.lora.begin_step(sched.requests) if self.lora else sched.requests
            hook = {}
            if interrupt is not None and sched.droppable_share > 0:
                hook["before_layer"] = partial(_stop_if, interrupt, sched.droppable_share * self.model.num_layers)
            try:
                input_ids, positions, meta = self._prepare_inputs(reqs)
                hidden = self.model(input_ids, positions, self.kv_caches, meta, **hook)
            except _Interrupted as stop:
                interrupted, share_done = True, stop.layer / self.model.num_layers
            finally:
                if self.lora:
                    self.lora.end_step()
            if not interrupted and any(r.sample for r in reqs):
                sampled = self._sample(hidden, reqs)
        loads = self.lora.slots.take_loads() if self.lora else ()
        return RunnerOutput(sampled=sampled, busy_time_us=timer.elapsed_us(), adapter_loads=loads,
                            interrupted=interrupted, share_done=share_done)

    def _sample(self, hidden: torch.Tensor, reqs: list[ScheduledRequest]) -> dict[str, list[SampledToken]]:
        """Sample every slice with sample=True. Only the rows sampled reach
        the LM head: a slice's last position, or every position of a slice
        with drafts, whose run is then verified (engine/spec_decode/verify.py)."""
        hidden_rows, rows = sampling_rows(reqs)
        logits = self.model.compute_logits(hidden[torch.tensor(hidden_rows, dtype=torch.int64, device=self.device)])
        grammar = self.grammar if self.grammar is not None and len(self.grammar) else None
        if grammar is not None:
            grammar.apply(logits, rows)  # drafting slices have no grammar
        to_sample = [r for r in reqs if r.sample]
        seeded = {r.request_id: self.sampler.seeded_state(r) for r in to_sample if r.draft_token_ids}
        per_row = iter(self.sampler.sample_rows(logits, rows, self.eos_token_ids))
        sampled = {}
        for r in to_sample:
            if not r.draft_token_ids:
                sampled[r.request_id] = next(per_row)
                continue
            positions = [next(per_row)[0] for _ in range(len(r.draft_token_ids) + 1)]
            sampled[r.request_id] = run = accepted_run(r.draft_token_ids, positions)
            if seeded[r.request_id] is not None:
                self.sampler.replay_seeded(r, seeded[r.request_id], len(run))
        if grammar is not None:
            grammar.advance(to_sample, sampled)
        return sampled

    def _copy_blocks(self, copies: list[CopyOp]) -> None:
        src = torch.tensor([c.src for c in copies], dtype=torch.int64, device=self.device)
        dst = torch.tensor([c.dst for c in copies], dtype=torch.int64, device=self.device)
        for k_cache, v_cache in self.kv_caches:
            k_cache[dst] = k_cache[src]
            v_cache[dst] = v_cache[src]

    def _prepare_inputs(self, reqs: list[ScheduledRequest]):
        bs = self.block_size
        query_lens = [r.num_tokens for r in reqs]
        seq_lens = [r.start_pos + r.num_tokens for r in reqs]
        max_blocks = max(len(r.block_table) for r in reqs)
        tables = [r.block_table + [0] * (max_blocks - len(r.block_table)) for r in reqs]

        input_ids = torch.tensor([t for r in reqs for t in r.token_ids], dtype=torch.int64)
        q_lens = torch.tensor(query_lens, dtype=torch.int64)
        starts = torch.tensor([r.start_pos for r in reqs], dtype=torch.int64)
        query_start_loc = torch.zeros(len(reqs) + 1, dtype=torch.int64)
        torch.cumsum(q_lens, 0, out=query_start_loc[1:])
        seq_index = torch.repeat_interleave(torch.arange(len(reqs)), q_lens)
        offsets = torch.arange(int(query_start_loc[-1])) - query_start_loc[:-1][seq_index]
        positions = starts[seq_index] + offsets
        block_tables = torch.tensor(tables, dtype=torch.int32)
        slot_mapping = (block_tables[seq_index, positions // bs].to(torch.int64) * bs
                        + positions % bs)

        dev = self.device
        meta = AttentionMetadata(
            slot_mapping=slot_mapping.to(dev),
            query_start_loc=query_start_loc.to(torch.int32).to(dev),
            seq_lens=torch.tensor(seq_lens, dtype=torch.int32, device=dev),
            block_tables=block_tables.to(dev),
            query_lens_host=query_lens,
            seq_lens_host=seq_lens,
            block_size=bs,
        )
        return input_ids.to(dev), positions.to(dev), meta


def sampling_rows(reqs: list[ScheduledRequest]) -> tuple[list[int], list[ScheduledRequest]]:
    """The flattened positions whose logits are sampled, and the request
    each row samples for. A slice with drafts samples at every position,
    position i as if drafts[:i] were already output, so min_tokens and
    the seeded stream see what plain decoding would."""
    hidden_rows: list[int] = []
    rows: list[ScheduledRequest] = []
    end = 0
    for r in reqs:
        end += r.num_tokens
        if not r.sample:
            continue
        drafts = r.draft_token_ids
        for i in range(len(drafts) + 1):
            hidden_rows.append(end - 1 - len(drafts) + i)
            rows.append(dataclasses.replace(r, output_token_ids=r.output_token_ids + drafts[:i], num_samples=1,
                                            draft_token_ids=[]) if drafts else r)
    return hidden_rows, rows


class _Interrupted(Exception):
    """Raised between layers to drop the step in flight."""

    def __init__(self, layer: int):
        super().__init__(layer)
        self.layer = layer  # the layers run before it


def _stop_if(interrupt: Callable[[], bool], most_layers_run: float, layer: int) -> None:
    # Past the share the scheduler allows, the drop would spend more of the
    # standard work's credit than it has (engine/tier_steps.py).
    if layer <= most_layers_run and interrupt():
        raise _Interrupted(layer)


class _StepTimer:
    """Busy time of one step: CUDA events on a GPU (device time, not the
    host's launch time), the wall clock on the CPU."""

    def __init__(self, device: torch.device):
        self._cuda = device.type == "cuda"
        if self._cuda:
            self._start = torch.cuda.Event(enable_timing=True)
            self._end = torch.cuda.Event(enable_timing=True)
            self._start.record()
        else:
            self._t0 = time.perf_counter_ns()

    def elapsed_us(self) -> int:
        if self._cuda:
            self._end.record()
            self._end.synchronize()
            return round(self._start.elapsed_time(self._end) * 1000)
        return (time.perf_counter_ns() - self._t0) // 1000
