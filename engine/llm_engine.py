"""The synchronous engine: tokenize, step, detokenize.

`LLM` (offline) drives it in a loop; `AsyncEngine` drives it from a thread.
"""

from __future__ import annotations

import itertools
import time
from concurrent.futures import FIRST_COMPLETED, Future, wait
from dataclasses import dataclass
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

# How long a request may wait for its grammar to compile before it ends with
# an error. llguidance's fuel bounds the work well below this; the deadline
# is the backstop that keeps a request from waiting forever.
GRAMMAR_COMPILE_TIMEOUT_S = 10.0


@dataclass
class _GrammarWait:
    """A request held outside the scheduler until its grammar compiles."""

    request: Request
    matcher: Future
    since: float


class LLMEngine:
    def __init__(self, core: EngineCore, tokenizer, *, eos_token_ids: frozenset[int],
                 max_model_len: int, clock: Callable[[], float] = time.monotonic,
                 adapters=None, lora_slots=None, vocab_size: int | None = None):
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
        # The logits' width, which a grammar's token mask must cover.
        self.vocab_size = vocab_size or len(tokenizer)
        self._grammars = None  # GrammarCompiler, built with the first structured request
        self._grammar_waits: dict[str, _GrammarWait] = {}
        self.grammar_compile_timeout_s = GRAMMAR_COMPILE_TIMEOUT_S

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
        if params.structured is None:
            self.core.scheduler.add_request(req)  # validates; raises before any state is kept
        else:
            # The scheduler sees it once its grammar has compiled (off this
            # thread), so a compile never holds up a step.
            self.core.scheduler.check_request(req)
            matcher = self.grammar_compiler().submit(params.structured, owner=cache_salt)
            self._grammar_waits[request_id] = _GrammarWait(req, matcher, self.clock())
        if adapter_key is not None and self.lora_slots is not None:
            self.lora_slots.prefetch(adapter_key)
        self.output_processor.add_request(
            request_id, prompt if isinstance(prompt, str) else None, prompt_ids, params, self.clock())
        return request_id

    def resolve_adapter(self, ref: str) -> Hashable:
        if self.adapters is None:
            raise ValidationError("adapter", "LoRA adapters are disabled on this engine (max_loras=0)")
        return self.adapters.resolve(ref).key

    def grammar_compiler(self):
        """The engine's GrammarCompiler, and the runner's grammar stage, built
        on first use: llguidance's tokenizer takes about half a second."""
        if self._grammars is None:
            from engine.structured.grammar import GrammarCompiler, make_tokenizer
            from engine.structured.runtime import GrammarRuntime

            ll_tokenizer = make_tokenizer(self.tokenizer, self.vocab_size, self.eos_token_ids)
            self._grammars = GrammarCompiler(ll_tokenizer)
            self.core.runner.grammar = GrammarRuntime(self.vocab_size)
        return self._grammars

    def abort(self, request_id: str) -> RequestOutput | None:
        self._grammar_waits.pop(request_id, None)
        self.core.scheduler.abort(request_id)
        return self.output_processor.finish(request_id, FinishReason.ABORT, self.clock())

    def fail_all(self, message: str) -> list[RequestOutput]:
        """End every in-flight request with an error (the step loop broke)."""
        outs = []
        self._grammar_waits.clear()
        for request_id in self.output_processor.request_ids():
            self.core.scheduler.abort(request_id)
            out = self.output_processor.finish(request_id, FinishReason.ERROR, self.clock(), message)
            if out is not None:
                outs.append(out)
        return outs

    def has_unfinished(self) -> bool:
        return self.core.scheduler.has_unfinished() or bool(self._grammar_waits)

    def step(self, *, final_only: bool = False, interrupt: Callable[[], bool] | None = None) -> list[RequestOutput]:
        """Run one engine step; the outputs of the requests it changed, each
        the delta since that request's previous output (with `final_only`,
        only of those it finished, each whole, as `LLM.generate` needs).
        `interrupt`: EngineCore.step's."""
        failed = self._fail_unloadable_adapters() + self._schedule_compiled()
        result = self.core.step(interrupt)
        if result is None:
            if self._grammar_waits and not failed:
                # Nothing could run: whatever waits, waits for its grammar.
                wait([w.matcher for w in self._grammar_waits.values()], timeout=0.05,
                     return_when=FIRST_COMPLETED)
            elif self.lora_slots is not None and not failed:
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

    def _schedule_compiled(self) -> list[RequestOutput]:
        """Hand the requests whose grammar is ready to the scheduler; end
        those whose grammar failed or is overdue with an error."""
        outs = []
        now = self.clock()
        for request_id, waiting in list(self._grammar_waits.items()):
            future = waiting.matcher
            error = None
            if future.done():
                try:
                    matcher = future.result()
                    self.core.runner.grammar.register(request_id, matcher)
                    self.core.scheduler.add_request(waiting.request)
                except Exception as exc:  # noqa: BLE001 - one bad grammar ends one request
                    error = f"structured output: {exc}"
                    self.core.runner.grammar.drop([request_id])
            elif now - waiting.since > self.grammar_compile_timeout_s:
                future.cancel()
                error = (f"structured output: the grammar did not compile within "
                         f"{self.grammar_compile_timeout_s:g} s")
            else:
                continue
            del self._grammar_waits[request_id]
            if error is not None:
                out = self.output_processor.finish(request_id, FinishReason.ERROR, now, error)
                if out is not None:
                    outs.append(out)
        return outs

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
