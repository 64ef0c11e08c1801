"""The synchronous engine: tokenize, step, detokenize.

`LLM` (offline) drives it in a loop; `AsyncEngine` drives it from a thread.
"""

from __future__ import annotations

import itertools
import time
from typing import Callable, Hashable

from engine.engine_core import EngineCore
from engine.errors import ValidationError
from engine.prompts import PromptEncoder
from engine.output_processor import OutputProcessor
from engine.outputs import RequestOutput
from engine.request import FinishReason, Request, Tier
from engine.sampling_params import SamplingParams
from engine.step_io import StepUsage

UsageSink = Callable[[StepUsage], None]


class LLMEngine:
    def __init__(self, core: EngineCore, tokenizer, *, eos_token_ids: frozenset[int],
                 max_model_len: int, clock: Callable[[], float] = time.monotonic,
                 adapters=None, lora_slots=None):
        self.core = core
        # The adapter registry (resolves "name" / "name@version" to a key) and
        # the LoRA slot manager (loads weights off the step loop); None without LoRA.
        self.adapters = adapters
        self.lora_slots = lora_slots
        self.tokenizer = tokenizer
        self.eos_token_ids = eos_token_ids
        self.max_model_len = max_model_len
        self.clock = clock
        self.output_processor = OutputProcessor(tokenizer)
        self.prompts = PromptEncoder(tokenizer)
        self.usage_sinks: list[UsageSink] = []
        self._arrival = itertools.count()
        self._ids = itertools.count()

    @property
    def scheduler(self):
        return self.core.scheduler

    def tokenize(self, prompt: str | list[int]) -> list[int]:
        return self.prompts.tokenize(prompt)

    def apply_chat_template(self, messages: list[dict]) -> list[int]:
        return self.prompts.apply_chat_template(messages)

    def add_request(
        self,
        prompt: str | list[int],
        params: SamplingParams,
        *,
        request_id: str | None = None,
        tier: Tier | str = Tier.STANDARD,
        adapter: str | None = None,
        adapter_key: Hashable | None = None,
        cache_salt: str | None = None,
    ) -> str:
        """`adapter` names a registered adapter ("name" or "name@version");
        `adapter_key` passes an already resolved key instead."""
        request_id = request_id or f"req-{next(self._ids)}"
        if adapter is not None:
            adapter_key = self.resolve_adapter(adapter)
        if request_id in self.output_processor:
            raise ValidationError("request_id", f"duplicate request id {request_id!r}")
        prompt_ids = self.tokenize(prompt)
        req = Request(
            request_id=request_id,
            prompt_token_ids=prompt_ids,
            sampling_params=params,
            arrival_seq=next(self._arrival),
            tier=Tier(tier),
            adapter_key=adapter_key,
            cache_salt=cache_salt,
            eos_token_ids=self.eos_token_ids,
            max_model_len=self.max_model_len,
        )
        self.core.scheduler.add_request(req)  # validates; raises before any state is kept
        if adapter_key is not None and self.lora_slots is not None:
            self.lora_slots.prefetch(adapter_key)
        self.output_processor.add_request(
            request_id, prompt if isinstance(prompt, str) else None, prompt_ids, params, self.clock())
        return request_id

    def resolve_adapter(self, ref: str) -> Hashable:
        if self.adapters is None:
            raise ValidationError("adapter", "LoRA adapters are disabled on this engine (max_loras=0)")
        return self.adapters.resolve(ref).key

    def abort(self, request_id: str) -> RequestOutput | None:
        self.core.scheduler.abort(request_id)
        return self.output_processor.finish(request_id, FinishReason.ABORT, self.clock())

    def fail_all(self, message: str) -> list[RequestOutput]:
        """End every in-flight request with an error (the step loop broke)."""
        outs = []
        for request_id in self.output_processor.request_ids():
            self.core.scheduler.abort(request_id)
            out = self.output_processor.finish(request_id, FinishReason.ERROR, self.clock(), message)
            if out is not None:
                outs.append(out)
        return outs

    def has_unfinished(self) -> bool:
        return self.core.scheduler.has_unfinished()

    def step(self, *, final_only: bool = False) -> list[RequestOutput]:
        """Run one engine step; the outputs of the requests it changed, each
        the delta since that request's previous output (with `final_only`,
        only of those it finished, each whole, as `LLM.generate` needs)."""
        failed = self._fail_unloadable_adapters()
        result = self.core.step()
        if result is None:
            if self.lora_slots is not None and not failed:
                # Nothing could run: whatever waits, waits for adapter weights.
                self.lora_slots.wait_for_loads(timeout=0.05)
            return failed
        now = self.clock()
        for item in self.core.last_schedule.requests:
            self.output_processor.mark_scheduled(item.group_id, now, item.cached_prompt_tokens)
        for sink in self.usage_sinks:
            sink(result.usage)
        processed = self.output_processor.process(result.updates, now, final_only=final_only)
        for seq_id in processed.stopped:
            self.core.scheduler.finish_request(seq_id, FinishReason.STOP)
        return failed + processed.outputs

    def _fail_unloadable_adapters(self) -> list[RequestOutput]:
        """End, with an error, every request whose adapter could not be loaded."""
        if self.lora_slots is None:
            return []
        outs = []
        for key, exc in self.lora_slots.pop_failures().items():
            groups = {r.group_id for r in self.core.scheduler.requests.values() if r.adapter_key == key}
            for group_id in groups:
                self.core.scheduler.abort(group_id)
                out = self.output_processor.finish(
                    group_id, FinishReason.ERROR, self.clock(), f"adapter {key[0]}@{key[1]} could not be loaded: {exc}")
                if out is not None:
                    outs.append(out)
        return outs
