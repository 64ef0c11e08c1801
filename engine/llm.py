"""The offline API, in vLLM's shape:

    from engine import LLM, SamplingParams
    llm = LLM()                       # the bundled SmolLM2-135M-Instruct
    outs = llm.generate(["Hello"], SamplingParams(max_tokens=32))
"""

from __future__ import annotations

from typing import Sequence

from engine.builder import build_llm_engine
from engine.config import EngineConfig
from engine.errors import ValidationError
from engine.outputs import RequestOutput
from engine.request import Tier
from engine.sampling_params import SamplingParams

Prompt = str | list[int]


class LLM:
    def __init__(self, model: str | None = None, **engine_args):
        """`engine_args`: any EngineConfig setting by its own name, whatever
        its section (`LLM(max_num_seqs=8, num_kv_blocks=64, max_loras=2)`)."""
        self.config = EngineConfig.from_flat(model=model, **engine_args)
        self.engine = build_llm_engine(self.config)

    @property
    def tokenizer(self):
        return self.engine.tokenizer

    @property
    def adapters(self):
        """The adapter registry this engine serves from (import with
        `llm.adapters.import_dir(name, path)`), or None without LoRA."""
        return self.engine.adapters

    def generate(
        self,
        prompts: Prompt | Sequence[Prompt],
        params: SamplingParams | Sequence[SamplingParams] | None = None,
        *,
        tier: Tier | str | Sequence[Tier | str] = Tier.STANDARD,
        adapter: str | None = None,
        adapters: Sequence[str | None] | None = None,
    ) -> list[RequestOutput]:
        """`adapter` applies one registered LoRA adapter ("name" or
        "name@version") to every prompt; `adapters` gives one per prompt
        (None for the base model)."""
        prompts = _as_prompt_list(prompts)
        params_list = _broadcast("params", params if params is not None else SamplingParams(), len(prompts))
        tiers = _broadcast("tier", tier, len(prompts))
        if adapter is not None and adapters is not None:
            raise ValidationError("adapters", "give adapter or adapters, not both")
        per_prompt = _broadcast("adapters", list(adapters) if adapters is not None else adapter, len(prompts))
        ids = []
        try:
            for prompt, p, t, a in zip(prompts, params_list, tiers, per_prompt):
                ids.append(self.engine.add_request(prompt, p, tier=t, adapter=a))
            return self._run(ids)
        except BaseException:
            for request_id in ids:
                self.engine.abort(request_id)
            raise

    def chat(
        self,
        messages: list[dict] | Sequence[list[dict]],
        params: SamplingParams | Sequence[SamplingParams] | None = None,
        **kwargs,
    ) -> list[RequestOutput]:
        conversations = [messages] if messages and isinstance(messages[0], dict) else list(messages)
        prompts = [self.engine.apply_chat_template(conv) for conv in conversations]
        return self.generate(prompts, params, **kwargs)

    def _run(self, ids: list[str]) -> list[RequestOutput]:
        pending = set(ids)
        done: dict[str, RequestOutput] = {}
        while pending:
            if not self.engine.has_unfinished():
                raise RuntimeError(f"engine went idle with {len(pending)} requests unfinished")
            for out in self.engine.step(final_only=True):
                if out.finished and out.request_id in pending:
                    pending.discard(out.request_id)
                    done[out.request_id] = out
        return [done[i] for i in ids]


def _as_prompt_list(prompts) -> list[Prompt]:
    if isinstance(prompts, str):
        return [prompts]
    prompts = list(prompts)
    if prompts and all(isinstance(t, int) for t in prompts):
        return [prompts]
    if not prompts:
        raise ValidationError("prompts", "no prompts given")
    return prompts


def _broadcast(name: str, value, n: int) -> list:
    if isinstance(value, (list, tuple)):
        if len(value) != n:
            raise ValidationError(name, f"got {len(value)} values for {n} prompts")
        return list(value)
    return [value] * n
