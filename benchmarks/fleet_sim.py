"""A simulated fleet: 64 workers, 1,000 adapters, two tiers, Poisson arrivals.

Every simulated worker runs the real scheduler and KV cache manager, priced
by a step-time model fitted to the real engine (benchmarks/step_time.py);
the gateway's real admission controller and router sit in front
(benchmarks/sim_fleet.py, benchmarks/sim_worker.py). Phases:

  capacity  standard only, offered at twice an estimate of what the fleet
            can serve, affinity routing: finished requests/s over the
            second half is the fleet's capacity, the unit of every load.
  policies  for each routing policy (affinity and round-robin; with
            `--policies` also least-loaded, a simulation-only baseline),
            premium at 10% of capacity plus standard at 40% (load 0.5) and
            at 300% (3x overload).
  giant     one worker with the fleet's total KV cache, slots, batch and
            compute, at load 0.5: the prefix hit rate a fleet could reach
            if it were one cache.

Targets: the affinity fleet's prefix hit rate >= 90% of the giant's; under
3x standard overload, premium TTFT p99 <= 1.5x its p99 at load 0.5, and no
premium 429.

    python benchmarks/fleet_sim.py [--workers 64] [--adapters 1000] [--duration S]
        [--model benchmarks/step_time_model.json] [--out PATH] [--plot PATH]
    python benchmarks/fleet_sim.py --measure [--seconds 60]   # re-fit the step-time model
"""

from __future__ import annotations

import argparse
import json
import math
import time
from dataclasses import replace
from pathlib import Path

import numpy as np
from sim_fleet import FleetRun, FleetSim, LeastLoadedRouter, SimClock, Workload, WorkloadShape
from sim_worker import SimWorker, WorkerShape
from step_time import (DEFAULT_MODEL, StepFeatures, StepTimeModel, fit, measure, read_samples, write_model,
                       write_samples)

from engine.request import Tier
from gateway.config import GatewayConfig
from gateway.router import RoutingConfig, make_router

TARGETS = {"prefix_hit_vs_giant": 0.90, "premium_p99_overload_vs_half": 1.5, "premium_429": 0}
PREMIUM_SHARE = 0.1  # of capacity, in every phase
POLICIES = ("affinity", "round-robin", "least-loaded")
DEFAULT_POLICIES = ("affinity", "round-robin")  # least-loaded with --policies: two more runs
LOADS = {"0.5": 0.5 - PREMIUM_SHARE, "3x": 3.0}  # the standard rate, in capacities
# Phases last this many typical steps by default, so that a model of a fast
# machine and one of a slow machine cost about the same to simulate.
STEPS_PER_PHASE = 32


def make_fleet(policy: str, num_workers: int, shape: WorkerShape, model: StepTimeModel,
               workload: Workload) -> FleetSim:
    """A fleet whose router, admission and workers read the simulation's clock."""
    clock = SimClock()
    workers = [SimWorker(f"w{i:03d}", shape, model, clock) for i in range(num_workers)]
    router = LeastLoadedRouter() if policy == "least-loaded" else make_router(RoutingConfig(policy=policy), clock)
    return FleetSim(clock, workers, router, workload, tier_limits(num_workers))


def tier_limits(num_workers: int) -> dict:
    """The gateway's default tier limits, their queue lengths per worker."""
    gateway = GatewayConfig()
    return {tier: _per_fleet(limits, num_workers)
            for tier, limits in ((Tier.PREMIUM, gateway.premium), (Tier.STANDARD, gateway.standard))}


def _per_fleet(limits, num_workers: int):
    return replace(limits, max_waiting=limits.max_waiting * num_workers)


def simulate(policy: str, num_workers: int, shape: WorkerShape, model: StepTimeModel, workload: Workload,
             rates: dict[Tier, float], duration_s: float, grace_s: float) -> FleetRun:
    sim = make_fleet(policy, num_workers, shape, model, workload)
    return sim.run(workload.arrivals(rates, duration_s), duration_s + grace_s)


def summarize(run: FleetRun, warmup_s: float, duration_s: float) -> dict:
    """Per tier: what arrived after the warm-up and what became of it."""
    out: dict = {"steps": run.steps, "sim_end_s": round(run.sim_end_s, 2)}
    window = [r for r in run.records if warmup_s <= r.arrival.t < duration_s]
    for tier in Tier:
        mine = [r for r in window if r.arrival.tier is tier]
        served = [r for r in mine if r.status != "refused"]
        ttfts = [r.ttft for r in served]
        out[tier.value] = {
            "arrived": len(mine), "refused_429": sum(r.status == "refused" for r in mine),
            "finished": sum(r.status == "finished" for r in mine),
            "aborted_at_end": sum(r.status == "aborted" for r in mine),
            "no_first_token": sum(r.first_token_t is None for r in served),
            "ttft_p50_s": _finite(percentile(ttfts, 50)), "ttft_p99_s": _finite(percentile(ttfts, 99)),
        }
    started = [r for r in window if r.request is not None and r.request.num_computed_tokens + len(
        r.request.output_token_ids) > 0]
    prompt = sum(r.request.num_prompt_tokens for r in started)
    cached = sum(r.request.num_cached_prompt_tokens for r in started)
    out["prefix_hit_rate"] = round(cached / prompt, 4) if prompt else None
    # Throughput inside the window, whenever those requests arrived.
    finished = [r for r in run.records if r.status == "finished" and warmup_s <= r.finish_t < duration_s]
    out["finished_per_s"] = round(len(finished) / (duration_s - warmup_s), 2)
    snaps = [w.snapshot for w in run.workers if w.snapshot is not None]
    out["adapter_loads"] = sum(s.adapter_loads for s in snaps)
    out["preemptions"] = {t.value: sum(s.num_preemptions.get(t, 0) for s in snaps) for t in Tier}
    return out


def typical_step_s(model: StepTimeModel, shape: WorkerShape) -> float:
    """A busy step: a standard prefill chunk (the serving cap, 256 tokens)
    beside half a batch of decodes, every slot in use."""
    return model.predict(StepFeatures(256 + shape.max_num_seqs // 2, shape.max_num_seqs // 2, shape.max_loras, 0))


def estimate_capacity(model: StepTimeModel, shape: WorkerShape, ws: WorkloadShape, num_workers: int) -> float:
    """Requests/s if every worker ran a full batch of decodes with the
    prefill of its successors beside it; only the starting point of the
    measured capacity phase."""
    prompt, output = ws.mean_request_tokens()
    batch = min(shape.max_num_seqs, shape.num_kv_blocks * shape.block_size * 0.8 / (prompt + output / 2))
    per_step = batch / output  # requests finishing per step
    step = model.predict(StepFeatures(round(batch + per_step * prompt), round(batch), shape.max_loras, 0))
    return num_workers * per_step / step


def main() -> None:
    args = parse_args()
    if args.measure or args.fit:
        refit(args)
        return
    model = StepTimeModel.load(args.model)
    shape = WorkerShape(num_kv_blocks=args.kv_blocks, max_loras=args.max_loras)
    ws = WorkloadShape(num_adapters=args.adapters)
    workload = Workload(ws, args.seed)
    step_s = typical_step_s(model, shape)
    args.duration = args.duration or round(STEPS_PER_PHASE * step_s, 1)
    # Long enough for the standard queue bound (10 s) to play out, so a
    # request that arrived late in the window is not cut off unserved.
    args.grace = args.grace if args.grace is not None else args.duration
    warmup = args.duration * 0.25
    t0 = time.perf_counter()
    result: dict = {"args": vars(args), "step_time_model": model.to_json(), "workload": vars(ws), "worker": vars(shape)}

    probe_rate = 2 * estimate_capacity(model, shape, ws, args.workers)
    probe = simulate("affinity", args.workers, shape, model, workload, {Tier.STANDARD: probe_rate}, args.duration, 0)
    capacity = sum(r.status == "finished" and r.finish_t >= args.duration / 2 for r in probe.records) / (args.duration / 2)
    result["capacity"] = {"offered_per_s": round(probe_rate, 1), "finished_per_s": round(capacity, 1)}
    print(f"capacity: {capacity:.1f} requests/s (offered {probe_rate:.1f})", flush=True)

    runs: dict = {}
    for policy in args.policies:
        for label, standard in LOADS.items():
            rates = {Tier.PREMIUM: PREMIUM_SHARE * capacity, Tier.STANDARD: standard * capacity}
            run = simulate(policy, args.workers, shape, model, workload, rates, args.duration, args.grace)
            runs[f"{policy}@{label}"] = summarize(run, warmup, args.duration)
            print(f"{policy}@{label}: {json.dumps(runs[f'{policy}@{label}'])}", flush=True)
    giant_shape = WorkerShape(**{**vars(shape), "scale": args.workers})
    rates = {Tier.PREMIUM: PREMIUM_SHARE * capacity, Tier.STANDARD: LOADS["0.5"] * capacity}
    giant = simulate("round-robin", 1, giant_shape, model, workload, rates, args.duration, args.grace)
    result["giant@0.5"] = summarize(giant, warmup, args.duration)
    result["runs"] = runs
    result["targets"] = TARGETS
    result["verdict"] = verdict(runs, result["giant@0.5"], args.policies)
    result["sim_wall_s"] = round(time.perf_counter() - t0, 1)
    print_table(runs, result["giant@0.5"], result["verdict"])
    write(result, args.out)
    plot(runs, args.policies, args.plot)


def refit(args: argparse.Namespace) -> None:
    """Measure the real engine (or read samples measured before) and write
    the fitted step-time model to --model."""
    if args.measure:
        samples, facts = measure(args.seconds)
        write_samples(samples, facts, args.samples_out)
    else:
        samples, facts = read_samples(args.fit)
    write_model(fit(samples, {**facts, "label": args.label} if args.label else facts), args.model)


def verdict(runs: dict, giant: dict, policies) -> dict:
    out: dict = {}
    fleet_hit = runs.get("affinity@0.5", {}).get("prefix_hit_rate")
    if fleet_hit is not None and giant["prefix_hit_rate"]:
        ratio = fleet_hit / giant["prefix_hit_rate"]
        out["prefix_hit_vs_giant"] = {"value": round(ratio, 3), "met": ratio >= TARGETS["prefix_hit_vs_giant"]}
    for policy in policies:
        half, over = runs[f"{policy}@0.5"]["premium"], runs[f"{policy}@3x"]["premium"]
        # A p99 past the end of the run (a premium request with no first
        # token when it was cut off) is unbounded, not missing.
        ratio = "unbounded" if over["ttft_p99_s"] == "inf" else _ratio(over["ttft_p99_s"], half["ttft_p99_s"])
        refused = over["refused_429"] + half["refused_429"]
        out[policy] = {"premium_p99_overload_vs_half": ratio, "premium_429": refused,
                       "met": isinstance(ratio, float) and ratio <= TARGETS["premium_p99_overload_vs_half"]
                       and refused == 0}
    return out


def print_table(runs: dict, giant: dict, verdicts: dict) -> None:
    head = f"{'run':<22}{'prem p50':>10}{'prem p99':>10}{'std p99':>10}{'prem 429':>9}{'std 429':>9}" \
           f"{'hit rate':>9}{'done/s':>9}{'loads':>8}"
    print(head)
    for name, s in list(runs.items()) + [("giant@0.5", giant)]:
        p, st = s["premium"], s["standard"]
        print(f"{name:<22}{_fmt(p['ttft_p50_s']):>10}{_fmt(p['ttft_p99_s']):>10}{_fmt(st['ttft_p99_s']):>10}"
              f"{p['refused_429']:>9}{st['refused_429']:>9}{_fmt(s['prefix_hit_rate']):>9}"
              f"{s['finished_per_s']:>9}{s['adapter_loads']:>8}")
    print(json.dumps(verdicts, indent=2))


def plot(runs: dict, policies, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(10, 4), sharey=True)
    width = 0.8 / len(policies)
    for ax, tier in zip(axes, Tier):
        for i, policy in enumerate(policies):
            values = [runs[f"{policy}@{load}"][tier.value]["ttft_p99_s"] for load in LOADS]
            xs = [x + i * width for x in range(len(LOADS))]
            ax.bar(xs, [v if isinstance(v, float) else math.nan for v in values], width, label=policy)
            for x, v in zip(xs, values):
                if v == "inf":  # some request had no first token when the run ended
                    ax.annotate("no first\ntoken", (x, 1.0), ha="center", fontsize=7)
        ax.set_xticks([x + width * (len(policies) - 1) / 2 for x in range(len(LOADS))],
                      ["load 0.5", "3x standard overload"])
        ax.set_title(f"{tier.value} TTFT p99")
        ax.set_yscale("log")
    axes[0].set_ylabel("seconds")
    axes[0].legend()
    fig.suptitle("Simulated fleet: TTFT p99 by routing policy and load")
    fig.tight_layout()
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    print(f"wrote {path}")


def write(result: dict, path: str) -> None:
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    Path(path).write_text(json.dumps(result, indent=2))
    print(f"wrote {path}")


def percentile(values: list[float], q: float) -> float:
    """Nearest rank (a value that occurred); inf for a request with no first token."""
    return float(np.percentile(values, q, method="inverted_cdf")) if values else math.nan


def _ratio(a, b):
    return None if not b else round(a / b, 3)


def _finite(x: float):
    """JSON has no infinity: "inf" is a p99 that some request never reached."""
    if math.isnan(x):
        return None
    return "inf" if math.isinf(x) else round(x, 4)


def _fmt(x) -> str:
    return x if isinstance(x, str) else "-" if x is None else f"{x:.3f}"


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--workers", type=int, default=64)
    parser.add_argument("--adapters", type=int, default=1000)
    parser.add_argument("--kv-blocks", type=int, default=1024, help="KV blocks per worker (16 tokens each)")
    parser.add_argument("--max-loras", type=int, default=4, help="adapter slots per worker")
    parser.add_argument("--duration", type=float, default=None,
                        help=f"simulated seconds of arrivals per phase; default: {STEPS_PER_PHASE} typical steps")
    parser.add_argument("--grace", type=float, default=None,
                        help="simulated seconds to drain before aborting; default: --duration")
    parser.add_argument("--policies", nargs="+", default=list(DEFAULT_POLICIES), choices=POLICIES)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--model", default=str(DEFAULT_MODEL), help="the step-time model's JSON")
    parser.add_argument("--out", default="benchmarks/results/fleet_sim.json")
    parser.add_argument("--plot", default="docs/img/fleet_sim_ttft.png")
    parser.add_argument("--measure", action="store_true", help="measure the real engine and re-fit --model")
    parser.add_argument("--fit", metavar="SAMPLES", help="re-fit --model from samples --measure wrote")
    parser.add_argument("--seconds", type=float, default=70.0, help="with --measure: time in the engine's phases")
    parser.add_argument("--samples-out", default="benchmarks/results/step_time_samples.json")
    parser.add_argument("--label", default="", help="with --measure/--fit: the machine and its load, in words")
    return parser.parse_args()


if __name__ == "__main__":
    main()
