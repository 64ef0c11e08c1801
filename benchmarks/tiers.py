"""SLO tiers under overload, through the real HTTP gateway.

    python benchmarks/tiers.py [--duration 60] [--prompt-tokens 128] [--output-tokens 32]

For each mode (tiers and admission on; then both off, plain FCFS) a fresh
`loragw serve` is started and measured in three phases:

1. capacity: closed loop at `--concurrency` clients; completed requests/s;
2. idle: premium alone, Poisson at 10% of capacity; its TTFT is the baseline;
3. overload: premium at 10% of capacity, at the same times as in the idle
   phase (with other prompts), plus standard at 3x, Poisson, open loop;
   requests still open `--grace` seconds after the arrivals stop are
   cancelled and count as never having had a first token.

Targets (tiers on): premium TTFT p99 under overload <= 1.5x its idle p99,
no premium 429, completed throughput within 10% of capacity. Writes JSON to
benchmarks/results/tiers.json and a TTFT-over-time plot per tier.
"""

from __future__ import annotations

import argparse
import asyncio
import math
import time
from pathlib import Path

from loadgen import GatewayProcess, Sample, Stream, closed_loop, open_loop
from machine import load_average, machine_facts, write_json

from engine.heap import freeze_startup_heap

RESULTS = Path(__file__).parent / "results"
PREMIUM_ARRIVAL_SEED = 2


def percentile(values: list[float], q: float) -> float:
    """Nearest-rank percentile; inf where a request never got a first token."""
    if not values:
        return math.nan
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, max(0, math.ceil(q / 100 * len(ordered)) - 1))]


def ttfts(samples: list[Sample], tier: str) -> list[float]:
    """TTFT of every admitted request of `tier` (429s excluded: they were
    told to come back, and are counted apart)."""
    return [s.ttft if s.ttft is not None else math.inf
            for s in samples if s.tier == tier and s.status not in (429,)]


def summarize(samples: list[Sample], tier: str) -> dict:
    mine = [s for s in samples if s.tier == tier]
    t = ttfts(samples, tier)
    return {
        "sent": len(mine),
        "ok": sum(s.status == 200 for s in mine),
        "rejected_429": sum(s.status == 429 for s in mine),
        "cancelled_unfinished": sum(s.status == -1 for s in mine),
        "errors": sum(s.status not in (200, 429, -1) for s in mine),
        "rate_429": (sum(s.status == 429 for s in mine) / len(mine)) if mine else 0.0,
        "ttft_p50_s": _finite(percentile(t, 50)),
        "ttft_p99_s": _finite(percentile(t, 99)),
    }


def _finite(x: float):
    return None if math.isinf(x) or math.isnan(x) else round(x, 4)


def completed_rps(samples: list[Sample], duration_s: float) -> float:
    """The sustained completion rate while the server was busy: completions
    between the first and the last of those that ended in the arrival
    window (the pipeline's fill time at the start is not counted)."""
    ends = sorted(s.sent_at + s.latency for s in samples if s.status == 200 and s.latency is not None)
    ends = [t for t in ends if t <= duration_s]
    return (len(ends) - 1) / (ends[-1] - ends[0]) if len(ends) > 1 and ends[-1] > ends[0] else 0.0


def closed_loop_rps(samples: list[Sample]) -> float:
    """Completed requests over the time until the last one ended."""
    ends = [s.sent_at + s.latency for s in samples if s.status == 200 and s.latency is not None]
    return len(ends) / max(ends) if ends else 0.0


def run_mode(args, tiers_on: bool) -> dict:
    flags = ["--max-num-seqs", str(args.max_num_seqs), *args.loragw_arg] + ([] if tiers_on else ["--no-tiers"])
    server = GatewayProcess(flags, model=args.model,
                            keep_log=args.server_log and Path(f"{args.server_log}.{'on' if tiers_on else 'off'}.log"))
    try:
        server.wait_ready()
        premium_keys = [server.create_tenant(f"premium-{i}", "premium") for i in range(2)]
        standard_keys = [server.create_tenant(f"standard-{i}", "standard") for i in range(4)]
        model = _base_model(server, premium_keys[0])
        shape = dict(prompt_tokens=args.prompt_tokens, output_tokens=args.output_tokens)

        cap = asyncio.run(closed_loop(server.base_url, model, premium_keys[0], concurrency=args.concurrency,
                                      duration_s=args.capacity_duration, seed=1, **shape))
        capacity = closed_loop_rps(cap)
        if capacity == 0:
            raise RuntimeError(f"no request completed in the capacity phase: {[s.status for s in cap]}")
        print(f"[tiers {'on' if tiers_on else 'off'}] capacity {capacity:.2f} req/s", flush=True)

        premium_rate = args.premium_load * capacity
        # Premium arrives at the same times in both phases (prompts differ,
        # so the second phase gets no prefix hits from the first): the ratio
        # then compares the same premium traffic with and without the flood.
        # With a schedule drawn apart for each phase, a burst of premium
        # arrivals in one phase and not the other could move it by half or more
        # (docs/benchmarks.md, "Zen 4, a credit for dropped steps").
        premium = Stream("premium", premium_keys, premium_rate, arrival_seed=PREMIUM_ARRIVAL_SEED)
        idle = asyncio.run(open_loop(server.base_url, model, [premium],
                                     duration_s=args.duration, seed=2, grace_s=args.grace, **shape))
        streams = [premium, Stream("standard", standard_keys, args.standard_load * capacity)]
        load_before = load_average()
        over = asyncio.run(open_loop(server.base_url, model, streams, duration_s=args.duration, seed=3,
                                     grace_s=args.grace, **shape))
        result = {
            "tiers": tiers_on,
            "capacity_rps": round(capacity, 3),
            "idle_premium": summarize(idle, "premium"),
            "overload": {"premium": summarize(over, "premium"), "standard": summarize(over, "standard"),
                         "completed_rps": round(completed_rps(over, args.duration), 3)},
            "load_average_before_overload": load_before,
            "timeline": [[round(s.sent_at, 3), s.tier, s.status, s.ttft and round(s.ttft, 4)] for s in over],
            # What broke each failed request (loadgen's Sample.error), by phase.
            "errors": [[phase, round(s.sent_at, 3), s.tier, s.status, s.error]
                       for phase, samples in (("idle", idle), ("overload", over)) for s in samples if s.error],
        }
        o, i = result["overload"], result["idle_premium"]
        result["premium_p99_ratio"] = (o["premium"]["ttft_p99_s"] / i["ttft_p99_s"]
                                       if o["premium"]["ttft_p99_s"] and i["ttft_p99_s"] else None)
        result["throughput_vs_capacity"] = round(o["completed_rps"] / capacity, 3) if capacity else None
        _print_mode(result)
        return result
    finally:
        server.stop()


def _base_model(server: GatewayProcess, key: str) -> str:
    import httpx

    r = httpx.get(f"{server.base_url}/v1/models", headers={"Authorization": f"Bearer {key}"})
    r.raise_for_status()
    return next(m["id"] for m in r.json()["data"] if not m.get("parent"))


def _print_mode(r: dict) -> None:
    name = "tiers on " if r["tiers"] else "tiers off"
    o = r["overload"]
    for tier in ("premium", "standard"):
        s = o[tier]
        print(f"[{name}] {tier:8s} sent {s['sent']:5d}  ok {s['ok']:5d}  429 {s['rate_429']:6.1%}  "
              f"unfinished {s['cancelled_unfinished']:4d}  errors {s['errors']:3d}  "
              f"TTFT p50 {s['ttft_p50_s']}  p99 {s['ttft_p99_s']}")
    for phase, sent_at, tier, status, error in r["errors"]:
        print(f"[{name}] {phase} {tier} request sent at {sent_at} s failed ({status}): {error}")
    print(f"[{name}] idle premium TTFT p50 {r['idle_premium']['ttft_p50_s']}  p99 {r['idle_premium']['ttft_p99_s']}"
          f"  -> overload/idle p99 {r['premium_p99_ratio']}")
    print(f"[{name}] completed {o['completed_rps']:.2f} req/s = {r['throughput_vs_capacity']} of capacity",
          flush=True)


def plot(results: list[dict], path: Path) -> bool:
    """Whether it drew: matplotlib is an optional extra (`.[bench]`)."""
    try:
        import matplotlib
    except ImportError:
        print(f"matplotlib is not installed (pip install -e '.[bench]'): {path} not drawn")
        return False

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(results), figsize=(6 * len(results), 4), sharey=True, squeeze=False)
    for ax, r in zip(axes[0], results):
        for tier, color in (("standard", "tab:gray"), ("premium", "tab:red")):
            pts = [(t, ttft) for t, tr, status, ttft in r["timeline"] if tr == tier and ttft is not None]
            if pts:
                ax.scatter(*zip(*pts), s=6, color=color, label=tier, alpha=0.7)
        ax.set_yscale("log")
        ax.set_title(f"tiers {'on' if r['tiers'] else 'off (FCFS)'}: TTFT under overload")
        ax.set_xlabel("arrival time (s)")
        ax.set_ylabel("TTFT (s)")
        ax.legend()
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    return True


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default=None, help="checkpoint dir; default: bundled SmolLM2")
    p.add_argument("--duration", type=float, default=60.0, help="seconds of Poisson arrivals per phase")
    p.add_argument("--capacity-duration", type=float, default=40.0)
    p.add_argument("--grace", type=float, default=30.0, help="seconds open requests get after arrivals stop")
    p.add_argument("--concurrency", type=int, default=32, help="closed-loop clients for the capacity phase")
    p.add_argument("--max-num-seqs", type=int, default=32)
    p.add_argument("--prompt-tokens", type=int, default=128)
    p.add_argument("--output-tokens", type=int, default=32)
    p.add_argument("--premium-load", type=float, default=0.1, help="premium offered load / capacity")
    p.add_argument("--standard-load", type=float, default=3.0, help="standard offered load / capacity")
    p.add_argument("--loragw-arg", action="append", default=[], metavar="ARG",
                   help="one more `loragw serve` argument (repeat it), e.g. --loragw-arg=--standard-prefill-tokens=128")
    p.add_argument("--modes", default="on,off", help="which modes to run: on, off or on,off")
    p.add_argument("--plot", type=Path, default=Path("docs/img/tiers_ttft.png"))
    p.add_argument("--out", type=Path, default=RESULTS / "tiers.json")
    p.add_argument("--server-log", default=None, metavar="PREFIX",
                   help="keep each mode's server log as PREFIX.on.log / PREFIX.off.log")
    args = p.parse_args()
    # The client's own full collections paused it up to ~190 ms, counted
    # into whichever first token was in flight (engine/heap.py).
    freeze_startup_heap()

    started = time.time()
    results = [run_mode(args, tiers_on=(m == "on")) for m in args.modes.split(",")]
    out = {"benchmark": "tiers", "args": {k: str(v) for k, v in vars(args).items()},
           "machine": machine_facts(), "wall_s": round(time.time() - started, 1), "modes": results}
    write_json(out, args.out, indent=1)
    if plot(results, args.plot):
        print(f"wrote {args.plot}")


if __name__ == "__main__":
    main()
