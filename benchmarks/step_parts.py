"""Where an offline engine step's time goes, by the step's size.

benchmarks/throughput.py says how fast the engine runs its workload; this
says where the time of its steps goes. It runs the same workload (the same
seed, prompts and forced output lengths) through `engine.LLM` and times each
part of every step with a wrapper around it: the linear layers (every packed
projection), attention (the backend's forward), the LM head, the norms, the
rotary embedding and the SiLU-and-product, and the step as a whole; "the
rest" is what is left (Python, sampling, scheduling, outputs). Steps are
grouped by their batched tokens as throughput.py groups them. A wrapper
costs about a microsecond a call, a few hundred calls a step.

Idle OpenMP threads spin here (OMP_WAIT_POLICY=ACTIVE), as `loragw serve`
runs them, unless the environment says otherwise; throughput.py lets them
sleep, which adds a wake-up to every small parallel call.

The serving benchmark's shape at concurrency 16 (benchmarks/serve_peer.py:
prompts of 20 to 180 words, outputs of mean ~60) is, offline,
`--max-num-seqs 16 --prompt-range 30 200 --mean-output 60`.

    python benchmarks/step_parts.py [--dtype bfloat16] [--num-requests 64] [--max-num-seqs N]
        [--prompt-range MIN MAX] [--mean-output N] [--out PATH]
"""

from __future__ import annotations

import os

os.environ.setdefault("OMP_WAIT_POLICY", "ACTIVE")  # before torch loads; see above

import argparse
import time
from collections import Counter, defaultdict

from machine import load_average, machine_facts, write_json
from throughput import STEP_BINS, forced_params, make_workload, warm_up_engine

PARTS = ("linear layers", "attention", "LM head", "norms", "rotary", "SiLU and product")
# throughput.py's bins, by name: "<= 4", "5-16", "17-64", "larger".
BIN_NAMES = [f"{low + 1}-{high}" if low else f"<= {high}" for low, high in zip((0, *STEP_BINS), STEP_BINS[:-1])]
BIN_NAMES.append("larger")


def bin_of(tokens: int) -> str:
    return BIN_NAMES[next(i for i, high in enumerate(STEP_BINS) if tokens <= high)]


def time_parts(runner, spent: Counter) -> None:
    """Wraps the model's parts so that each call adds its seconds to `spent`."""
    from engine.model import cpu_elementwise, layers

    def wrap(owner, name: str, part: str) -> None:
        inner = getattr(owner, name)

        def timed(*args, **kwargs):
            t0 = time.perf_counter()
            try:
                return inner(*args, **kwargs)
            finally:
                spent[part] += time.perf_counter() - t0

        setattr(owner, name, timed)

    wrap(layers.PackedLinear, "forward", "linear layers")
    wrap(layers.RMSNorm, "forward", "norms")
    wrap(layers.RMSNorm, "add_forward", "norms")
    wrap(cpu_elementwise, "rotary", "rotary")
    wrap(cpu_elementwise, "silu_mul", "SiLU and product")
    wrap(runner.attn_backend, "forward", "attention")
    wrap(runner.model, "compute_logits", "LM head")


def run(args) -> dict:
    from engine import LLM

    llm = LLM(dtype=args.dtype, **({"max_num_seqs": args.max_num_seqs} if args.max_num_seqs else {}))
    warm_up_engine(llm, llm.tokenizer)
    spent: Counter = Counter()
    time_parts(llm.engine.core.runner, spent)
    low, high = args.prompt_range
    workload = make_workload(args.num_requests, args.seed, llm.tokenizer, min_prompt=low, max_prompt=high,
                             mean_output=args.mean_output)
    engine = llm.engine
    for prompt, length in zip(workload.prompts, workload.output_lens):
        engine.add_request(prompt, forced_params(length))
    totals: dict[str, Counter] = defaultdict(Counter)
    steps: Counter = Counter()
    while engine.has_unfinished():
        spent.clear()
        t0 = time.perf_counter()
        engine.step(final_only=True)
        spent["step"] = time.perf_counter() - t0
        name = bin_of(engine.core.last_schedule.num_batched_tokens)
        totals[name].update(spent)
        steps[name] += 1
    table = {}
    for name in BIN_NAMES:
        if not steps[name]:
            continue
        ms = {part: round(1e3 * totals[name][part] / steps[name], 2) for part in ("step", *PARTS)}
        ms["the rest"] = round(ms["step"] - sum(ms[part] for part in PARTS), 2)
        table[name] = {"steps": steps[name], "ms_per_step": ms}
    return {"workload": workload.summary(), "by_step_tokens": table}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dtype", default="bfloat16", choices=["float32", "bfloat16"])
    parser.add_argument("--num-requests", type=int, default=64)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--max-num-seqs", type=int, default=None, help="engine default if unset")
    parser.add_argument("--prompt-range", type=int, nargs=2, default=(32, 512), metavar=("MIN", "MAX"),
                        help="prompt tokens, uniform (default 32 512, as throughput.py)")
    parser.add_argument("--mean-output", type=int, default=128, help="mean of the geometric output lengths")
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    result = {"args": vars(args), "machine": machine_facts(), "load_before": load_average()}
    result.update(run(args))
    result["load_after"] = load_average()
    print(f"ms a step ({args.dtype}, OMP_WAIT_POLICY={os.environ['OMP_WAIT_POLICY']})")
    print(f"{'step tokens':<12} {'steps':>6} {'step':>8} " + " ".join(f"{p:>16}" for p in (*PARTS, "the rest")))
    for name, row in result["by_step_tokens"].items():
        ms = row["ms_per_step"]
        print(f"{name:<12} {row['steps']:>6} {ms['step']:>8} " + " ".join(f"{ms[p]:>16}" for p in (*PARTS, "the rest")))
    print(f"load       before {result['load_before']}, after {result['load_after']}")
    write_json(result, args.out or f"benchmarks/results/step_parts-{args.dtype}.json")


if __name__ == "__main__":
    main()
