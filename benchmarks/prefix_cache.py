"""Time to first token with and without the prefix cache, in one run.

`--num-requests` requests share one system prompt (`--system-tokens` random
ordinary token ids), each followed by its own question (`--question-tokens`).
Two engines, `enable_prefix_caching=True` and `False`, get the same requests
one at a time: each is submitted after the previous one finished, so its
TTFT is prefill time, not queueing. The engines take turns request by
request, so both see the same load on a shared host.

With the cache on, the first request computes the whole prompt and fills the
cache; every later one finds the system prompt's full blocks cached and
computes only its question. The target: the median TTFT of the requests
after the first is at least 10x lower with the cache on.

TTFT is `RequestOutput.metrics.ttft`: from `add_request` to the end of the
step that produced the first token, on the engine's clock.

    python benchmarks/prefix_cache.py [--dtype float32|bfloat16] [--num-requests 32]
        [--system-tokens 1024] [--question-tokens 32] [--seed 0] [--out PATH]
"""

from __future__ import annotations

import os

# Before torch is imported; see throughput.py.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import argparse
import random
import statistics

from machine import CpuMeter, load_average, machine_facts, write_json

TARGET_SPEEDUP = 10.0


def make_prompts(tokenizer, num_requests: int, system_tokens: int, question_tokens: int,
                 seed: int) -> tuple[list[list[int]], list[int]]:
    """(one prompt per request, a warm-up prompt with another system prompt)."""
    rng = random.Random(seed)
    special = set(tokenizer.all_special_ids)
    vocab = [t for t in range(len(tokenizer)) if t not in special]

    def draw(n: int) -> list[int]:
        return [rng.choice(vocab) for _ in range(n)]

    system = draw(system_tokens)
    prompts = [system + draw(question_tokens) for _ in range(num_requests)]
    return prompts, draw(system_tokens + question_tokens)


def run_one(llm, prompt: list[int], max_tokens: int) -> tuple[float, int]:
    """(TTFT seconds, prompt tokens served from the cache) of one request on an idle engine."""
    from engine import SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, min_tokens=max_tokens, ignore_eos=True)
    (out,) = llm.generate([prompt], params)
    return out.metrics.ttft, out.num_cached_tokens


def summarize(ttfts: list[float], cached: list[int]) -> dict:
    return {
        "ttft_ms": [round(t * 1e3, 2) for t in ttfts],
        "first_ms": round(ttfts[0] * 1e3, 2),
        "median_after_first_ms": round(statistics.median(ttfts[1:]) * 1e3, 2),
        "cached_tokens": cached,
    }


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    parser.add_argument("--num-requests", type=int, default=32)
    parser.add_argument("--system-tokens", type=int, default=1024)
    parser.add_argument("--question-tokens", type=int, default=32)
    parser.add_argument("--max-tokens", type=int, default=2, help="tokens generated per request")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", default=None, help="default: benchmarks/results/prefix_cache-<dtype>.json")
    return parser.parse_args()


def main() -> None:
    args = parse_args()
    from engine import LLM

    result: dict = {"args": vars(args), "machine": machine_facts(), "load_before": load_average()}
    # Two engines live at once: size their KV caches to the workload, not to the default budget.
    blocks_per_request = -(-(args.system_tokens + args.question_tokens + args.max_tokens) // 16)
    num_blocks = 4 * blocks_per_request + args.num_requests * 4
    engines = {
        "cache_off": LLM(dtype=args.dtype, enable_prefix_caching=False, num_kv_blocks=num_blocks),
        "cache_on": LLM(dtype=args.dtype, enable_prefix_caching=True, num_kv_blocks=num_blocks),
    }
    tokenizer = engines["cache_on"].tokenizer
    prompts, warm_up = make_prompts(tokenizer, args.num_requests, args.system_tokens,
                                    args.question_tokens, args.seed)
    for llm in engines.values():
        run_one(llm, warm_up, args.max_tokens)

    ttfts = {name: [] for name in engines}
    cached = {name: [] for name in engines}
    meter = CpuMeter.start()
    for prompt in prompts:
        for name, llm in engines.items():
            ttft, hit = run_one(llm, prompt, args.max_tokens)
            ttfts[name].append(ttft)
            cached[name].append(hit)
    result["cpu"] = meter.stop()
    result["load_after"] = load_average()
    for name in engines:
        result[name] = summarize(ttfts[name], cached[name])
    speedup = result["cache_off"]["median_after_first_ms"] / result["cache_on"]["median_after_first_ms"]
    result["speedup_median_after_first"] = round(speedup, 1)
    result["target"] = TARGET_SPEEDUP

    prompt_len = args.system_tokens + args.question_tokens
    print(f"{args.num_requests} requests of {prompt_len} tokens ({args.system_tokens} shared), {args.dtype}")
    for name in engines:
        r = result[name]
        print(f"{name:9s}  first {r['first_ms']:8.1f} ms   median after first {r['median_after_first_ms']:8.1f} ms"
              f"   cached tokens after first: {sorted(set(r['cached_tokens'][1:]))}")
    verdict = "met" if speedup >= TARGET_SPEEDUP else "MISSED"
    print(f"speedup (median after first): {speedup:.1f}x  (target >= {TARGET_SPEEDUP}x: {verdict})")
    print(f"load before {result['load_before']}, after {result['load_after']}; "
          f"other processes {result['cpu'].get('other_cores')} cores")

    out = args.out or f"benchmarks/results/prefix_cache-{args.dtype}.json"
    write_json(result, out)


if __name__ == "__main__":
    main()
