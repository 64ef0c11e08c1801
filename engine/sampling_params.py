"""Per-request sampling parameters, validated at construction."""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from engine.errors import ValidationError
from engine.structured.spec import StructuredSpec

MAX_N = 16
MAX_LOGPROBS = 20
# Below this a temperature means greedy (vLLM's _SAMPLING_EPS): dividing
# float32 logits by a tiny (let alone subnormal) temperature overflows them to
# +-inf, and the softmax of those is NaN.
SAMPLING_EPS = 1e-5


@dataclass
class SamplingParams:
    """How to sample one request's completions.

    A temperature below `SAMPLING_EPS` (0 included) means greedy. `top_k <= 0` disables top-k. `logprobs`
    is the number of top alternatives to return per token (0 returns only the
    sampled token's logprob, None returns nothing). `structured` constrains
    the output to a grammar (engine/structured/).
    """

    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int | None = None
    max_tokens: int = 16
    min_tokens: int = 0
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logprobs: int | None = None
    skip_special_tokens: bool = True
    structured: StructuredSpec | None = None

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        self.stop = list(self.stop)
        self.stop_token_ids = list(self.stop_token_ids)
        self._validate()

    @property
    def greedy(self) -> bool:
        return self.temperature < SAMPLING_EPS

    @property
    def has_penalties(self) -> bool:
        return (self.presence_penalty != 0.0 or self.frequency_penalty != 0.0
                or self.repetition_penalty != 1.0)

    def _validate(self) -> None:
        _int_in("n", self.n, 1, MAX_N)
        _number_in("temperature", self.temperature, 0.0, None)
        _number_in("top_p", self.top_p, 0.0, 1.0)
        if self.top_p == 0.0:
            raise ValidationError("top_p", "must be in (0, 1], got 0")
        _int_in("top_k", self.top_k, -1, None)
        if self.seed is not None:
            _int_in("seed", self.seed, -(2**63), 2**63 - 1)
        _int_in("max_tokens", self.max_tokens, 1, None)
        _int_in("min_tokens", self.min_tokens, 0, self.max_tokens)
        for s in self.stop:
            if not isinstance(s, str) or not s:
                raise ValidationError("stop", "stop strings must be non-empty strings")
        for t in self.stop_token_ids:
            _int_in("stop_token_ids", t, 0, None)
        _number_in("presence_penalty", self.presence_penalty, -2.0, 2.0)
        _number_in("frequency_penalty", self.frequency_penalty, -2.0, 2.0)
        _number_in("repetition_penalty", self.repetition_penalty, 0.0, None)
        if self.repetition_penalty == 0.0:
            raise ValidationError("repetition_penalty", "must be > 0, got 0")
        if self.logprobs is not None:
            _int_in("logprobs", self.logprobs, 0, MAX_LOGPROBS)
        if self.structured is not None:
            if not isinstance(self.structured, StructuredSpec):
                raise ValidationError("structured",
                                      f"must be a StructuredSpec, got {type(self.structured).__name__}")
            if self.min_tokens:
                # A finished grammar allows only EOS, which min_tokens forbids:
                # no token would be left to sample.
                raise ValidationError("min_tokens", "cannot be combined with structured output")


def _int_in(name: str, value, lo: int | None, hi: int | None) -> None:
    if isinstance(value, bool) or not isinstance(value, int):
        raise ValidationError(name, f"must be an integer, got {value!r}")
    _check_range(name, value, lo, hi)


def _number_in(name: str, value, lo: float | None, hi: float | None) -> None:
    if (isinstance(value, bool) or not isinstance(value, (int, float))
            or (isinstance(value, float) and not math.isfinite(value))):
        raise ValidationError(name, f"must be a finite number, got {value!r}")
    _check_range(name, value, lo, hi)


def _check_range(name: str, value, lo, hi) -> None:
    if lo is not None and value < lo:
        raise ValidationError(name, f"must be >= {lo}, got {value!r}")
    if hi is not None and value > hi:
        raise ValidationError(name, f"must be <= {hi}, got {value!r}")
