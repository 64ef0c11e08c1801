"""loragw's inference engine: scheduler, paged KV cache, model runner.

`from engine import LLM, SamplingParams` is the offline API. The heavy names
are resolved lazily so that the pure-Python parts (scheduler, KV manager)
import without torch.
"""

from engine.sampling_params import SamplingParams

__all__ = ["LLM", "AsyncEngine", "SamplingParams", "RequestOutput", "CompletionOutput"]


def __getattr__(name: str):
    if name == "LLM":
        from engine.llm import LLM

        return LLM
    if name == "AsyncEngine":
        from engine.async_engine import AsyncEngine

        return AsyncEngine
    if name in ("RequestOutput", "CompletionOutput"):
        from engine import outputs

        return getattr(outputs, name)
    raise AttributeError(f"module 'engine' has no attribute {name!r}")
