"""Structured output's cost, in one run on the bundled SmolLM2.

  throughput  throughput.py's workload (seeded random token-id prompts,
              32..256 tokens, geometric output lengths, mean ~64), all
              submitted at once, greedy. `mixed`: every other request is
              constrained to a JSON schema (max_tokens CONSTRAINED_MAX_TOKENS,
              ending where the grammar ends or at max_tokens); the others
              are forced to their lengths as in throughput.py. `plain`: the
              same prompts with no constraint, every request forced to the
              length it emitted in `mixed`, so both runs compute exactly the
              same tokens and the ratio of their output tok/s is the
              grammar's cost alone (target >= 0.9). The two alternate
              `--repeats` times; the ratio is best against best, and
              `ratio_cpu` the same per CPU-second of this process.
  compile     GrammarCompiler time to a usable matcher: a cold schema
              (never seen; the median over several) and a cached one.
  ttft        time to first token on an idle engine: an unconstrained
              request, a constrained one whose grammar is cached, and one
              whose schema is new (its compile included). Fresh random
              prompts each, so no prefix-cache hits.

    python benchmarks/structured.py [--num-requests 64] [--seed 0] [--threads N] [--repeats 2] [--trials 5]
        [--out PATH]
"""

from __future__ import annotations

import os

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")  # see benchmarks/throughput.py

import argparse
import statistics
import time

import throughput
from machine import CpuMeter, load_average, machine_facts, write_json

TARGET = 0.9
MEAN_OUTPUT, MAX_OUTPUT, MAX_PROMPT = 64, 128, 256
# A constrained request may run past its workload length, so that its grammar,
# not its budget, ends it.
CONSTRAINED_MAX_TOKENS = 192


def order_schema(tag: str = "") -> dict:
    """A schema whose documents run to tens of tokens; `tag` makes a new
    (uncached) schema with the same shape."""
    item = {"type": "object", "additionalProperties": False, "required": ["sku", "qty"],
            "properties": {"sku": {"type": "string", "maxLength": 8},
                           "qty": {"type": "integer", "minimum": 1, "maximum": 999}}}
    return {
        "type": "object", "additionalProperties": False, "required": ["id", "customer", "items", "status"],
        "properties": {
            "id": {"type": "integer", "minimum": 1, "maximum": 999999},
            "customer": {"type": "string", "maxLength": 24},
            "items": {"type": "array", "items": item, "maxItems": 6},
            "status": {"enum": ["open", "shipped", "closed", f"archived{tag}"]},
        },
    }


def structured_params(max_tokens: int, schema: dict):
    from engine import SamplingParams
    from engine.structured.spec import StructuredSpec

    return SamplingParams(temperature=0.0, max_tokens=max_tokens, structured=StructuredSpec.json_schema(schema))


def run_batch(llm, prompts: list[list[int]], params: list) -> dict:
    """Submit all, step to the end; output tok/s over the wall time."""
    engine = llm.engine
    meter = CpuMeter.start()
    t0 = time.perf_counter()
    ids = [engine.add_request(p, sp) for p, sp in zip(prompts, params)]
    done = {}
    while engine.has_unfinished():
        done.update((o.request_id, o) for o in engine.step(final_only=True) if o.finished)
    wall = time.perf_counter() - t0
    lengths = [len(done[i].outputs[0].token_ids) for i in ids]
    return {
        "wall_s": round(wall, 2),
        "output_tokens": sum(lengths),
        "output_tok_s": round(sum(lengths) / wall, 1),
        "cpu": meter.stop(),
        "lengths": lengths,
        "finish_reasons": [done[i].outputs[0].finish_reason for i in ids],
    }


def run_throughput(llm, workload: throughput.Workload, repeats: int) -> dict:
    schema = order_schema()
    constrained = [i % 2 == 1 for i in range(len(workload.prompts))]
    params = [structured_params(CONSTRAINED_MAX_TOKENS, schema) if c else throughput.forced_params(n)
              for n, c in zip(workload.output_lens, constrained)]
    # Warm-up: the schema compiled once, and one full-size batch, so that
    # neither side pays the engine's first large batch (buffers, page faults;
    # it cost the first mixed run a third of its speed here).
    llm.generate(workload.prompts[:2], params[:2])
    run_batch(llm, workload.prompts, [throughput.forced_params(n) for n in workload.output_lens])
    mixed, plain = [], []
    for _ in range(repeats):  # alternated, so that a change in the host's load hits both
        mixed.append(run_batch(llm, workload.prompts, params))
        # The same tokens' worth of work with no grammar: each length as `mixed` emitted it.
        plain.append(run_batch(llm, workload.prompts, [throughput.forced_params(n) for n in mixed[-1]["lengths"]]))
        assert plain[-1]["lengths"] == mixed[-1]["lengths"], "the plain run did not emit the mixed run's lengths"
    first = mixed[0]
    stopped = [r for r, c in zip(first["finish_reasons"], constrained) if c]
    constrained_lens = [n for n, c in zip(first["lengths"], constrained) if c]
    for run in mixed + plain:
        del run["lengths"], run["finish_reasons"]
    best_mixed = max(mixed, key=lambda r: r["output_tok_s"])
    best_plain = max(plain, key=lambda r: r["output_tok_s"])
    return {
        "mixed": mixed,
        "plain": plain,
        "constrained_requests": len(stopped),
        "constrained_ended_by_grammar": stopped.count("stop"),
        "constrained_len_mean": round(statistics.mean(constrained_lens), 1),
        "ratio": round(best_mixed["output_tok_s"] / best_plain["output_tok_s"], 3),
        # Each mixed run against the plain run beside it: the spread of the ratio.
        "ratio_paired": [round(m["output_tok_s"] / p["output_tok_s"], 3) for m, p in zip(mixed, plain)],
        "ratio_cpu": round((best_mixed["output_tokens"] / best_mixed["cpu"]["own_cpu_s"])
                           / (best_plain["output_tokens"] / best_plain["cpu"]["own_cpu_s"]), 3),
    }


def run_compile(llm, trials: int) -> dict:
    from engine.structured.grammar import GrammarCompiler
    from engine.structured.spec import StructuredSpec

    compiler = GrammarCompiler(llm.engine.grammar_compiler().ll_tokenizer)
    cold, cached = [], []
    for k in range(trials):
        spec = StructuredSpec.json_schema(order_schema(f"-compile-{k}"))
        for times in (cold, cached):
            t0 = time.perf_counter()
            compiler.submit(spec).result()
            times.append((time.perf_counter() - t0) * 1000)
    compiler.shutdown()
    return {"cold_ms_median": round(statistics.median(cold), 2), "cold_ms_max": round(max(cold), 2),
            "cached_ms_median": round(statistics.median(cached), 3), "trials": trials}


def first_token_s(llm, prompt: list[int], params) -> float:
    engine = llm.engine
    t0 = time.perf_counter()
    request_id = engine.add_request(prompt, params)
    first = None
    while engine.has_unfinished():
        for out in engine.step():
            if first is None and out.request_id == request_id and out.outputs[0].token_ids:
                first = time.perf_counter() - t0
    return first


def run_ttft(llm, tokenizer, trials: int, seed: int) -> dict:
    prompts = throughput.make_workload(3 * trials, seed + 1, tokenizer, min_prompt=128, max_prompt=128).prompts
    cases = {
        "unconstrained": lambda k: throughput.forced_params(4),
        "constrained_cached": lambda k: structured_params(4, order_schema()),
        "constrained_cold": lambda k: structured_params(4, order_schema(f"-ttft-{seed}-{k}")),
    }
    result = {}
    for c, (name, make) in enumerate(cases.items()):
        times = [first_token_s(llm, prompts[c * trials + k], make(k)) for k in range(trials)]
        result[f"{name}_ms_median"] = round(statistics.median(times) * 1000, 1)
    result["prompt_tokens"] = 128
    result["constrained_cached_vs_unconstrained"] = round(
        result["constrained_cached_ms_median"] / result["unconstrained_ms_median"], 3)
    return result


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--num-requests", type=int, default=64)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--threads", type=int, default=None, help="engine torch threads (default: torch's)")
    parser.add_argument("--repeats", type=int, default=2, help="mixed/plain throughput runs, alternated")
    parser.add_argument("--trials", type=int, default=5, help="compile and TTFT trials (medians reported)")
    parser.add_argument("--out", default="benchmarks/results/structured.json")
    return parser.parse_args()


def main() -> None:
    args = parse_args()
    from engine import LLM

    result: dict = {"args": vars(args), "machine": machine_facts(), "load_before": load_average()}
    llm = LLM(num_threads=args.threads)
    workload = throughput.make_workload(args.num_requests, args.seed, llm.tokenizer, max_prompt=MAX_PROMPT,
                                        mean_output=MEAN_OUTPUT, max_output=MAX_OUTPUT)
    result["workload"] = workload.summary()
    result["throughput"] = run_throughput(llm, workload, args.repeats)
    result["compile"] = run_compile(llm, args.trials)
    result["ttft"] = run_ttft(llm, llm.tokenizer, args.trials, args.seed)
    result["load_after"] = load_average()
    result["target"] = {"throughput_ratio": TARGET}
    t, c, f = result["throughput"], result["compile"], result["ttft"]
    print(f"throughput  mixed {[r['output_tok_s'] for r in t['mixed']]} tok/s, "
          f"plain {[r['output_tok_s'] for r in t['plain']]} tok/s: ratio {t['ratio']}, per CPU-s {t['ratio_cpu']} (target >= {TARGET}: {'met' if t['ratio'] >= TARGET else 'MISSED'}); "
          f"{t['constrained_ended_by_grammar']}/{t['constrained_requests']} constrained ended by the grammar")
    print(f"compile     cold {c['cold_ms_median']} ms (max {c['cold_ms_max']}), cached {c['cached_ms_median']} ms")
    print(f"ttft        unconstrained {f['unconstrained_ms_median']} ms, constrained cached "
          f"{f['constrained_cached_ms_median']} ms, constrained cold {f['constrained_cold_ms_median']} ms")
    print(f"load        before {result['load_before']}, after {result['load_after']}")
    write_json(result, args.out)


if __name__ == "__main__":
    main()
