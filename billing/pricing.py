"""Prices per tier, applied to ledger figures when they are exported.

Costs are computed with `Decimal` from integer figures, and rounded once,
at the end, to `COST_PLACES` decimal places (half-even)."""

from __future__ import annotations

from dataclasses import dataclass, field
from decimal import ROUND_HALF_EVEN, Decimal, InvalidOperation

COST_PLACES = Decimal("0.000001")


@dataclass(frozen=True)
class TierPrices:
    per_gpu_second: Decimal = Decimal(0)
    per_1k_prompt_tokens: Decimal = Decimal(0)  # prompt tokens not served from the prefix cache
    per_1k_completion_tokens: Decimal = Decimal(0)

    def cost(self, *, charged_us: int, billable_prompt_tokens: int, completion_tokens: int) -> Decimal:
        exact = (self.per_gpu_second * charged_us / 1_000_000
                 + self.per_1k_prompt_tokens * billable_prompt_tokens / 1000
                 + self.per_1k_completion_tokens * completion_tokens / 1000)
        return exact.quantize(COST_PLACES, rounding=ROUND_HALF_EVEN)


@dataclass(frozen=True)
class PriceBook:
    """Tier name -> prices; a tier without prices (the platform's overhead) costs nothing."""

    tiers: dict[str, TierPrices] = field(default_factory=dict)

    def for_tier(self, tier: str) -> TierPrices:
        return self.tiers.get(tier, TierPrices())

    @classmethod
    def parse(cls, specs: list[str], *, known_tiers: tuple[str, ...] | None = None) -> PriceBook:
        """From `TIER:GPU_S,PROMPT_1K,COMPLETION_1K` strings, e.g.
        `premium:0.002,0.0005,0.0015`. A price must be a finite number from 0
        up to MAX_PRICE; each tier is priced once, and must be one of
        `known_tiers` when given. ValueError otherwise."""
        tiers = {}
        for spec in specs:
            tier, _, values = spec.partition(":")
            tier, parts = tier.strip(), values.split(",")
            if not tier or len(parts) != 3:
                raise ValueError(f"price {spec!r}: expected TIER:PER_GPU_SECOND,PER_1K_PROMPT,PER_1K_COMPLETION")
            if known_tiers is not None and tier not in known_tiers:
                raise ValueError(f"price {spec!r}: unknown tier {tier!r} (tiers: {', '.join(known_tiers)})")
            if tier in tiers:
                raise ValueError(f"price {spec!r}: tier {tier!r} is priced twice")
            tiers[tier] = TierPrices(*(_price(p, spec) for p in parts))
        return cls(tiers)


# Past this a price is a typo; under it every cost stays within Decimal's
# 28 digits at COST_PLACES (a million per GPU-second over a year of them).
MAX_PRICE = Decimal(1_000_000)


def _price(text: str, spec: str) -> Decimal:
    text = text.strip()
    try:
        price = Decimal(text)
    except InvalidOperation:
        raise ValueError(f"price {spec!r}: {text!r} is not a number") from None
    if not price.is_finite() or not 0 <= price <= MAX_PRICE:
        raise ValueError(f"price {spec!r}: {text!r} is not a price from 0 to {MAX_PRICE}")
    return price
