"""A model of one engine step's busy time, fitted to the real engine's steps.

The fleet simulation (benchmarks/fleet_sim.py) runs the real scheduler on
every simulated worker and needs, in place of the model runner, how long a
step takes. The model is linear in four facts of the step:

    busy_s = c0 + c_tok * tokens + c_dec * decode_rows
                + c_lora * distinct_adapters + c_load * adapter_loads

`tokens` counts every position computed (prefill chunks and decodes),
`decode_rows` the slices that decode one token (their attention reads the
whole context), `distinct_adapters` the LoRA adapters in the batch (one
segment each in the SGMV kernels) and `adapter_loads` the host-to-slot
copies the step made.

    python benchmarks/fleet_sim.py --measure [--seconds 70] [--label "..."]
    python benchmarks/fleet_sim.py --fit SAMPLES.json [--label "..."]

`--measure` drives the offline engine (`engine.LLM`) with random LoRA
adapters (benchmarks/multi_lora.py's) and the throughput workload
(benchmarks/throughput.py's) through phases of different batch sizes and
adapter mixes, records every step's features and busy time, and fits.
"""

from __future__ import annotations

import os

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")  # see benchmarks/throughput.py

import json
import random
import tempfile
import time
from collections.abc import Iterable
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np

from engine.step_io import RequestStepUsage

FEATURES = ("tokens", "decode_rows", "distinct_adapters", "adapter_loads")
DEFAULT_MODEL = Path(__file__).parent / "step_time_model.json"


@dataclass(frozen=True)
class StepFeatures:
    tokens: int
    decode_rows: int
    distinct_adapters: int
    adapter_loads: int

    @classmethod
    def of(cls, usages: Iterable[RequestStepUsage], adapter_loads: int) -> StepFeatures:
        """The features of a step from its per-request usage, as the
        scheduler's `StepUsage` reports it (and `RequestStepUsage.from_slice`
        derives it from a scheduled slice)."""
        usages = list(usages)
        return cls(tokens=sum(u.computed_tokens for u in usages),
                   decode_rows=sum(1 for u in usages if u.decode_tokens > 0),
                   distinct_adapters=len({u.adapter_key for u in usages if u.adapter_key is not None}),
                   adapter_loads=adapter_loads)

    def row(self) -> list[float]:
        return [1.0, self.tokens, self.decode_rows, self.distinct_adapters, self.adapter_loads]


@dataclass(frozen=True)
class StepTimeModel:
    """Seconds per step; `intercept_s` plus a coefficient per feature."""

    intercept_s: float
    coefficients_s: dict[str, float]
    r2: float
    num_samples: int
    measured_on: dict

    def predict(self, f: StepFeatures) -> float:
        c = self.coefficients_s
        busy = (self.intercept_s + c["tokens"] * f.tokens + c["decode_rows"] * f.decode_rows
                + c["distinct_adapters"] * f.distinct_adapters + c["adapter_loads"] * f.adapter_loads)
        # A least-squares fit may put a small step below zero; a step is never free.
        return max(busy, 1e-4)

    def to_json(self) -> dict:
        return asdict(self)

    @classmethod
    def from_json(cls, data: dict) -> StepTimeModel:
        return cls(**{k: data[k] for k in ("intercept_s", "coefficients_s", "r2", "num_samples", "measured_on")})

    @classmethod
    def load(cls, path: Path | str = DEFAULT_MODEL) -> StepTimeModel:
        return cls.from_json(json.loads(Path(path).read_text()))


def fit(samples: list[tuple[StepFeatures, float]], measured_on: dict) -> StepTimeModel:
    """Least squares over the samples, every coefficient >= 0: a feature
    whose coefficient comes out negative (noise, on a loaded host, or too
    few samples that vary it) is fixed at zero and the rest refitted, since
    no feature of a step makes it faster. R^2 on the same samples."""
    if len(samples) < len(FEATURES) + 1:
        raise ValueError(f"{len(samples)} samples cannot fit {len(FEATURES) + 1} coefficients")
    x = np.array([f.row() for f, _ in samples])
    y = np.array([t for _, t in samples])
    active = list(range(x.shape[1]))
    while True:
        coef = np.zeros(x.shape[1])
        coef[active], *_ = np.linalg.lstsq(x[:, active], y, rcond=None)
        negative = [i for i in active if i > 0 and coef[i] < 0]
        if not negative:
            break
        active.remove(min(negative, key=lambda i: coef[i]))
    residual = y - x @ coef
    total = float(((y - y.mean()) ** 2).sum())
    r2 = 1.0 - float((residual ** 2).sum()) / total if total > 0 else 0.0
    return StepTimeModel(intercept_s=float(coef[0]),
                         coefficients_s={name: float(c) for name, c in zip(FEATURES, coef[1:])},
                         r2=round(r2, 4), num_samples=len(samples),
                         measured_on={**measured_on, "fixed_at_zero": [FEATURES[i - 1] for i in range(1, x.shape[1])
                                                                       if i not in active]})


def read_samples(path: Path | str) -> tuple[list[tuple[StepFeatures, float]], dict]:
    data = json.loads(Path(path).read_text())
    return [(StepFeatures(**s["features"]), s["busy_s"]) for s in data["samples"]], data["measured_on"]


# ---- measuring the real engine ------------------------------------------------------

# (requests in flight, adapters they draw from): small and large batches,
# the base model alone, few and many adapters; with 8 adapters and 4 slots
# some steps load one.
PHASES = ((1, 0), (4, 1), (8, 0), (16, 4), (32, 8), (8, 8), (48, 8))
SLOTS = 4


def measure(seconds: float, seed: int = 0) -> tuple[list[tuple[StepFeatures, float]], dict]:
    """Run every phase for about `seconds / len(PHASES)`; each step's features
    and busy time. Imports torch, peft and transformers (the rest does not)."""
    import torch
    from machine import load_average, machine_facts
    from multi_lora import RANK, make_adapters
    from throughput import forced_params, make_workload

    from engine import LLM
    from engine.model.loader import resolve_model_dir

    samples: list[tuple[StepFeatures, float]] = []
    facts = {"machine": machine_facts(), "load_before": load_average(),
             "device": "cuda" if torch.cuda.is_available() else "cpu"}
    with tempfile.TemporaryDirectory() as tmp:
        dirs = make_adapters(resolve_model_dir(None), Path(tmp) / "peft", 8)
        llm = LLM(data_dir=str(Path(tmp) / "data"), max_loras=SLOTS, max_lora_rank=RANK, max_cpu_loras=8,
                  max_num_batched_tokens=512)
        for path in dirs:
            llm.adapters.import_dir(path.name, path)
        engine = llm.engine
        rng = random.Random(seed)
        llm.generate([[1000 + i for i in range(32)]], forced_params(4), adapter=dirs[0].name)  # warm-up
        engine.usage_sinks.append(
            lambda u: samples.append((StepFeatures.of(u.requests, len(u.adapter_loads)), u.busy_time_us / 1e6)))
        for in_flight, num_adapters in PHASES:
            workload = make_workload(4 * in_flight + 8, rng.randrange(1 << 30), llm.tokenizer, min_prompt=16,
                                     max_prompt=256, mean_output=32, max_output=96)
            names = [d.name for d in dirs[:num_adapters]] or [None]
            deadline = time.perf_counter() + seconds / len(PHASES)
            pending = list(zip(workload.prompts, workload.output_lens))
            while time.perf_counter() < deadline and (pending or engine.has_unfinished()):
                while pending and len(engine.scheduler.requests) < in_flight:
                    prompt, n = pending.pop()
                    engine.add_request(prompt, forced_params(n), adapter=rng.choice(names))
                engine.step()
            for request_id in list(engine.output_processor.request_ids()):
                engine.abort(request_id)
            print(f"phase in_flight={in_flight} adapters={num_adapters}: {len(samples)} samples", flush=True)
    facts["load_after"] = load_average()
    return samples, facts


def write_samples(samples: list[tuple[StepFeatures, float]], facts: dict, path: Path | str) -> None:
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    Path(path).write_text(json.dumps(
        {"measured_on": facts, "samples": [{"features": asdict(f), "busy_s": t} for f, t in samples]}))
    print(f"wrote {path}")


def write_model(model: StepTimeModel, path: Path | str) -> None:
    Path(path).write_text(json.dumps(model.to_json(), indent=2) + "\n")
    print(json.dumps({"intercept_s": model.intercept_s, **model.coefficients_s, "r2": model.r2,
                      "samples": model.num_samples}, indent=2))
    print(f"wrote {path}")
