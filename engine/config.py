"""Engine configuration, in sections: scheduler, KV cache, LoRA, speculative decoding.

Every field has a default that works on the CPU, and nothing here reads
model files: tests build configs freely. Each field is declared once, with
its help text; `loragw serve` and `loragw worker` generate their flags from
these fields (engine/config_flags.py), and `LLM(**kwargs)` takes the same
names flat (`EngineConfig.from_flat`), so every field name is unique across
the sections.
"""

from __future__ import annotations

import dataclasses
import difflib
import typing
from dataclasses import dataclass

from adapters.peft_config import DEFAULT_MAX_LORA_RANK
from engine.config_flags import is_section, section, setting
from engine.errors import ValidationError

_DTYPES = ("auto", "float32", "bfloat16", "float16")
# Weight-only quantization of the linears and LM head (engine/model/quant_linear.py).
_QUANTIZATIONS = ("auto", "none", "int8", "int4")
# Activations rounded to int8 in the blocked kernels' calls (engine/model/quant_linear.py).
_ACTIVATION_QUANTIZATIONS = ("none", "int8")
DEFAULT_CPU_KV_BYTES = 4 * 1024**3


@dataclass
class SchedulerConfig:
    max_num_batched_tokens: int = setting(1024, help="tokens per engine step")
    max_num_seqs: int = setting(128, help="sequences running at once")
    # The builder resolves None to the model's limit before the scheduler sees it.
    max_model_len: int | None = setting(None, help="context length; default: the model's")
    # Off: every request is treated as standard; the SLO tests use it to starve premium.
    enable_tiers: bool = setting(True, help="plain FCFS: no tier ordering, no premium reserve (and in "
                                            "`loragw serve`, no tier admission limits)")
    # A step that prefills premium work carries no standard prefill: premium
    # TTFT then costs one short step, not a full one.
    premium_prefill_alone: bool = setting(True, help="let standard prefill share a step with premium prefill")
    # ... and no standard decodes either, two steps in a row at most (so a
    # stream of premium arrivals slows standard decodes, never stops them):
    # they would add a row each to the premium request's first step.
    premium_prefill_defers_decodes: bool = setting(
        True, help="let standard decodes share a step with premium prefill (otherwise they wait out up to "
                   "two such steps in a row)")
    # A premium request that arrives mid-step waits for that step, so this
    # bounds its TTFT under a standard flood; on a CPU, step time grows with
    # every token.
    max_standard_prefill_tokens: int | None = setting(
        None, flag="--standard-prefill-tokens", zero_is_none=True,
        help="most standard prompt tokens prefilled per step with tiers on, which bounds how long a premium "
             "arrival waits for the step in flight (0: no cap; raise it on a GPU)")
    # The cap costs standard throughput (on a 2-core CPU, 64 tokens cost 29%
    # at 16 concurrent requests), which buys nothing while no premium
    # request comes: so it holds only for this many steps after one arrives.
    standard_prefill_cap_steps: int = setting(
        4096, help="steps after a premium request arrives for which --standard-prefill-tokens holds (0: always, "
                   "premium or not)")
    # The cap shortens the step in flight; this drops it: its work is done
    # again in a later step, so a premium arrival costs standard work up to
    # a step, and its own wait falls from up to a step to a layer. Only
    # engines told of premium arrivals drop steps (the worker, AsyncEngine;
    # not the offline LLM), and only while the work thrown away stays
    # within a credit that completed standard steps earn, which keeps the
    # loss to a third of the standard steps' work, plus a step's worth
    # (engine/tier_steps.py).
    premium_interrupts_steps: bool = setting(
        True, help="let a premium arrival wait out the whole standard step in flight (else the step is "
                   "dropped, within a credit of work thrown away, and done again after the premium request's)")

    def __post_init__(self) -> None:
        for name in ("max_num_batched_tokens", "max_num_seqs"):
            if getattr(self, name) < 1:
                raise ValidationError(name, "must be >= 1")
        if self.max_model_len is not None and self.max_model_len < 1:
            raise ValidationError("max_model_len", "must be >= 1")
        if self.max_standard_prefill_tokens is not None and self.max_standard_prefill_tokens < 1:
            raise ValidationError("max_standard_prefill_tokens", "must be >= 1 (None: no cap)")
        if self.standard_prefill_cap_steps < 0:
            raise ValidationError("standard_prefill_cap_steps", "must be >= 0 (0: always)")


KV_CACHE_DTYPES = ("auto", "model", "float16")


@dataclass
class CacheConfig:
    block_size: int = setting(16, help="tokens per KV block (a power of two)")
    kv_cache_memory: int | None = setting(
        None, help="KV cache budget in bytes; default: --kv-cache-fraction of free GPU memory, or 4 GiB on the CPU")
    kv_cache_fraction: float = setting(0.9, help="share of free GPU memory the KV cache takes")
    # Exact count, for tests and benchmarks.
    num_kv_blocks: int | None = setting(None, help="KV blocks, overriding the memory budget")
    enable_prefix_caching: bool = setting(True, help="turn prefix caching off")
    premium_reserved_fraction: float = setting(0.0, help="share of the KV cache only premium requests may use")
    # Decode attention reads every cached byte of every running sequence each
    # step, so a float32 model's cache in float16 (llama.cpp's default cache
    # type) halves what it reads and doubles the blocks a budget holds. What
    # it costs in agreement with a float32 cache is measured in
    # docs/engine.md, "A 16-bit cache for float32 models". vLLM's "auto" is
    # our "model".
    kv_cache_dtype: str = setting("auto", choices=KV_CACHE_DTYPES,
                                  help="KV cache element type: auto (float16 for a float32 model on the CPU with "
                                       "the torch attention backend, else the model's), model (the model's dtype) or "
                                       "float16 (only where auto would pick it)")

    def __post_init__(self) -> None:
        if self.kv_cache_dtype not in KV_CACHE_DTYPES:
            raise ValidationError("kv_cache_dtype", f"must be one of {KV_CACHE_DTYPES}")
        if self.block_size < 1 or self.block_size & (self.block_size - 1):
            raise ValidationError("block_size", "must be a power of two")
        if not 0.0 < self.kv_cache_fraction <= 1.0:
            raise ValidationError("kv_cache_fraction", "must be in (0, 1]")
        if not 0.0 <= self.premium_reserved_fraction < 1.0:
            raise ValidationError("premium_reserved_fraction", "must be in [0, 1)")
        if self.num_kv_blocks is not None and self.num_kv_blocks < 1:
            raise ValidationError("num_kv_blocks", "must be >= 1")


@dataclass
class LoraConfig:
    max_loras: int = setting(4, help="adapters resident on the device at once, and distinct adapters per "
                                     "step (0: LoRA off)")
    max_lora_rank: int = setting(DEFAULT_MAX_LORA_RANK,
                                 help="the rank every adapter slot is padded to; larger adapters are refused")
    max_cpu_loras: int = setting(16, help="adapters kept loaded in host memory")
    lora_backend: str = setting("auto", help="SGMV kernels: triton, cpu, torch or auto")
    max_slot_wait_steps: int = setting(32, help="steps a request may be passed over while it waits for an "
                                                "adapter slot")

    def __post_init__(self) -> None:
        if self.max_loras < 0 or self.max_slot_wait_steps < 0:
            raise ValidationError("max_loras", "max_loras and max_slot_wait_steps must be >= 0")
        if self.max_lora_rank < 1 or self.max_cpu_loras < 0:
            raise ValidationError("max_lora_rank", "max_lora_rank must be >= 1 and max_cpu_loras >= 0")


# ---- speculative decoding (engine/spec_decode/) ----------------------------------

_SPECULATIVE_METHODS = ("off", "ngram")


@dataclass
class SpeculativeConfig:
    """Draft tokens proposed by n-gram prompt lookup and verified in one
    forward pass; greedy output is the same as without speculation."""

    # On by default: at one or two decoding sequences, measured on a 2-core
    # AVX-512 host (benchmarks/spec_decode.py, docs/benchmarks.md), answers
    # that copy their prompt ran 2.1x, random prompts 1.6-2.6x, and open
    # answers that copy little 0.98-1.05x; greedy output is unchanged.
    speculative: str = setting("ngram", choices=_SPECULATIVE_METHODS,
                               help="speculative decoding: ngram drafts tokens by prompt lookup; off: none")
    # 7: a verifying sequence is 8 rows, the most the Q4_1 decode kernel took
    # on the AVX-512 host (quantization auto). Against 4 there, copying
    # answers ran 2.65-2.71x plain decoding (4: 1.96-2.24x), random prompts
    # 1.67-2.61x (1.56-2.50x) and open answers 0.97-1.03x (0.94-1.06x).
    num_speculative_tokens: int = setting(7, help="draft tokens per speculating sequence and step")
    # vLLM's names. Longer n-grams draft less often but are accepted more.
    # Measured (benchmarks/spec_decode.py, docs/benchmarks.md): with a
    # 1-token minimum, answers that copy little drafted on most steps and
    # accepted 2-9%, running at half the plain speed; with 3, they drafted
    # rarely (0.88-1.07x) while copying answers still accepted 94-100%.
    prompt_lookup_max: int = setting(4, help="longest n-gram prompt lookup matches")
    prompt_lookup_min: int = setting(3, help="shortest n-gram prompt lookup matches")
    # Drafts cost compute that a big batch has no spare of: on the CPU a
    # step's time grows with its tokens. Measured on the 2-core AVX-512 host:
    # at 4 decoding sequences open answers lost 20% (copying ones still
    # gained 1.5x); at 8, on an AVX2 host, every workload lost (0.55-0.85x).
    speculative_disable_batch_size: int = setting(
        2, help="no speculation in a step with more running decode sequences than this")

    def __post_init__(self) -> None:
        if self.speculative not in _SPECULATIVE_METHODS:
            raise ValidationError("speculative", f"must be one of {_SPECULATIVE_METHODS}")
        if self.num_speculative_tokens < 1:
            raise ValidationError("num_speculative_tokens", "must be >= 1")
        if not 1 <= self.prompt_lookup_min <= self.prompt_lookup_max:
            raise ValidationError("prompt_lookup_min", "need 1 <= prompt_lookup_min <= prompt_lookup_max")
        if self.speculative_disable_batch_size < 1:
            raise ValidationError("speculative_disable_batch_size", "must be >= 1")

    @property
    def enabled(self) -> bool:
        return self.speculative != "off"


@dataclass
class EngineConfig:
    """Everything `LLM(...)`, `loragw serve` and `loragw worker` accept."""

    model: str | None = setting(None, help="local HF-format Llama checkpoint; default: bundled SmolLM2-135M-Instruct")
    dtype: str = setting("auto", choices=_DTYPES, help="weights and compute dtype (the KV cache's: see "
                                                       "--kv-cache-dtype); auto: bfloat16 on a GPU and "
                                                       "on a CPU with native bfloat16 (AVX512-BF16, AMX, Arm BF16), "
                                                       "else float32")
    device: str = setting("auto", help="cpu, cuda, cuda:N or auto")
    attention_backend: str = setting("auto", help="torch, triton or auto")
    num_threads: int | None = setting(None, help="torch intra-op threads of the engine; unset: torch's default, "
                                                 "one per core, on the CPU, and 1 beside a GPU (docs/engine.md, "
                                                 "\"Defaults\")")
    # ---- weight-only quantization (engine/model/quant_linear.py) ----
    quantization: str = setting("auto", choices=_QUANTIZATIONS,
                                help="store the linear and LM-head weights in int8 (per channel) or int4 "
                                     "(GGUF Q4_1, group 32); activations keep --dtype. Faster small-batch "
                                     "decode on the CPU, at a small cost in accuracy. auto: where the "
                                     "linears' weights are exactly Q4_1 values (a Q4_1 GGUF, as the bundled "
                                     "model) small-batch decode on the CPU reads them as Q4_1 and the rest "
                                     "stays float; the model's values do not change (docs/engine.md)")
    # Opt-in: it changes the model's values more than bfloat16 does
    # (docs/engine.md, "Int8 activations").
    activation_quantization: str = setting(
        "none", choices=_ACTIVATION_QUANTIZATIONS,
        help="int8: round float32 activations to int8 per block of 32 in the Q4_1/Q8_0 kernels' calls (small-"
             "batch decode on a CPU with AVX2), as llama.cpp computes: faster, and less exact than float32 or "
             "bfloat16; needs --dtype float32 and Q4_1 weights (--quantization auto on a Q4_1 GGUF, or int4)")
    # The adapter registry; $LORAGW_DATA_DIR is read where the registry opens.
    data_dir: str | None = setting(None, flag=None, help="None: $LORAGW_DATA_DIR or the user data dir")
    scheduler: SchedulerConfig = section(SchedulerConfig, title="scheduler")
    cache: CacheConfig = section(CacheConfig, title="KV cache")
    lora: LoraConfig = section(LoraConfig, title="LoRA")
    speculative_config: SpeculativeConfig = section(SpeculativeConfig, title="speculative decoding")

    def __post_init__(self) -> None:
        if self.dtype not in _DTYPES:
            raise ValidationError("dtype", f"must be one of {_DTYPES}")
        if self.quantization not in _QUANTIZATIONS:
            raise ValidationError("quantization", f"must be one of {_QUANTIZATIONS}")
        if self.activation_quantization not in _ACTIVATION_QUANTIZATIONS:
            raise ValidationError("activation_quantization", f"must be one of {_ACTIVATION_QUANTIZATIONS}")
        if self.num_threads is not None and self.num_threads < 1:
            raise ValidationError("num_threads", "must be >= 1 (None: torch's default)")

    @classmethod
    def from_flat(cls, **kwargs) -> EngineConfig:
        """`from_flat(max_num_seqs=8, num_kv_blocks=64, max_loras=2)`: each
        name goes to the section that declares it (the `LLM(...)` style)."""
        owners = flat_names()
        sections: dict[str, dict] = {name: {} for name in set(owners.values()) if name}
        top = {}
        for name, value in kwargs.items():
            if name not in owners:
                close = difflib.get_close_matches(name, owners, n=1)
                hint = f"; did you mean {close[0]!r}?" if close else ""
                raise TypeError(f"{name!r} is not an engine setting{hint}")
            (sections[owners[name]] if owners[name] else top)[name] = value
        hints = typing.get_type_hints(cls)
        return cls(**top, **{name: hints[name](**values) for name, values in sections.items()})

    def to_flat(self) -> dict:
        """Every setting by its flat name, as `from_flat` takes them."""
        flat = {}
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            flat.update(dataclasses.asdict(value) if is_section(f) else {f.name: value})
        return flat

    def premium_reserved_blocks(self, num_blocks: int) -> int:
        """KV blocks only premium may allocate: none with tiers off."""
        if not self.scheduler.enable_tiers:
            return 0
        return int(num_blocks * self.cache.premium_reserved_fraction)


def flat_names() -> dict[str, str | None]:
    """Each flat setting name -> its section (None: a top-level field).
    A name declared in two places would make `from_flat` ambiguous."""
    owners: dict[str, str | None] = {}
    hints = typing.get_type_hints(EngineConfig)
    for f in dataclasses.fields(EngineConfig):
        names = [g.name for g in dataclasses.fields(hints[f.name])] if is_section(f) else [f.name]
        for name in names:
            if name in owners:
                raise TypeError(f"engine setting {name!r} is declared twice")
            owners[name] = f.name if is_section(f) else None
    return owners
