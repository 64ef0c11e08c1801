"""The model runner: the only code that touches tensors.

`execute()` turns a SchedulerOutput into one flattened forward pass over all
scheduled slices, samples the requests whose slice ends at their last known
token, and measures the step's busy time.
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING

import torch

from engine.attention.base import AttentionBackend, AttentionMetadata
from engine.sampler import Sampler
from engine.step_io import CopyOp, RunnerOutput, ScheduledRequest, SchedulerOutput

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
    def execute(self, sched: SchedulerOutput) -> RunnerOutput:
        timer = _StepTimer(self.device)
        self.drop(sched.finished_ids)
        if sched.copies:
            self._copy_blocks(sched.copies)
        sampled = {}
        if sched.requests:
            # With LoRA the batch is reordered so each adapter's tokens are contiguous.
            reqs = self.lora.begin_step(sched.requests) if self.lora else sched.requests
            try:
                input_ids, positions, meta = self._prepare_inputs(reqs)
                hidden = self.model(input_ids, positions, self.kv_caches, meta)
            finally:
                if self.lora:
                    self.lora.end_step()
            to_sample = [r for r in reqs if r.sample]
            if to_sample:
                # Only the last position of each sampling slice reaches the LM head.
                last = meta.query_start_loc[1:].to(torch.int64) - 1
                rows = torch.tensor([i for i, r in enumerate(reqs) if r.sample],
                                    dtype=torch.int64, device=self.device)
                logits = self.model.compute_logits(hidden[last[rows]])
                grammar = self.grammar if self.grammar is not None and len(self.grammar) else None
                if grammar is not None:
                    grammar.apply(logits, to_sample)
                sampled = self.sampler.sample(logits, to_sample, self.eos_token_ids)
                if grammar is not None:
                    grammar.advance(to_sample, sampled)
        loads = self.lora.slots.take_loads() if self.lora else ()
        return RunnerOutput(sampled=sampled, busy_time_us=timer.elapsed_us(), adapter_loads=loads)

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
