"""Throughput through the gateway and its engine worker processes, against
the offline engine at the same threads on the same workload, in one run.

The workload (seeded): `--num-requests` prompts of 32..256 random ordinary
token ids, outputs geometric with mean ~64 (capped at 256), each forced to
its length (min_tokens = max_tokens, ignore_eos), greedy.

  offline   `LLM` in this process with `--threads` torch threads: every
            request submitted at once, run to the end.
  serve-1   `loragw serve --workers 1 --num-threads T` in a subprocess,
            with its defaults but for admission, which is opened so that
            all the requests are admitted at once (`--standard-max-waiting`
            N+1, no queue-wait bound): this measures throughput, not 429s.
            The same requests as streaming
            /v1/completions with token-id prompts, all sent at once. Output
            tok/s counts the completion tokens the clients received over
            the wall time from the first send to the last byte.
  serve-2   the same with `--workers 2`: on a 2-core CPU two workers share
            the cores with each other and the gateway, so expect no gain;
            on a node with one GPU per worker each would bring its own.

The ratio serve-1 / offline is the cost of the process boundary, HTTP,
tokenizing in the gateway and metering; the target is at least 0.9.

    python benchmarks/workers.py [--num-requests 64] [--threads 1] [--seed 0] [--skip-two] [--out PATH]
"""

from __future__ import annotations

import os

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")  # see benchmarks/throughput.py

import argparse
import asyncio
import json
import time
from pathlib import Path

import httpx
import throughput
from loadgen import GatewayProcess
from machine import CpuMeter, load_average, machine_facts, write_json

TARGET = 0.9
RESULTS = Path(__file__).parent / "results"


def make_workload(num_requests: int, seed: int, tokenizer) -> tuple[list[list[int]], list[int]]:
    """throughput.py's workload, shorter: prompts 32..256, outputs mean 64 (cap 256)."""
    w = throughput.make_workload(num_requests, seed, tokenizer, max_prompt=256, mean_output=64, max_output=256)
    return w.prompts, w.output_lens


def run_offline(prompts: list[list[int]], lens: list[int], threads: int) -> dict:
    from engine import LLM

    llm = LLM(num_threads=threads)
    params = [throughput.forced_params(n) for n in lens]
    llm.generate(prompts[:2], params[:2])  # warm up: kernels built, caches touched
    meter = CpuMeter.start()
    t0 = time.perf_counter()
    outs = llm.generate(prompts, params)
    wall = time.perf_counter() - t0
    tokens = sum(len(o.outputs[0].token_ids) for o in outs)
    return {"wall_s": round(wall, 2), "output_tokens": tokens, "output_tok_s": round(tokens / wall, 1),
            "cpu": meter.stop()}


async def _stream(client: httpx.AsyncClient, url: str, key: str, model: str, prompt: list[int], n: int) -> int:
    # min_tokens = max_tokens forces the length: EOS is masked until then.
    body = {"model": model, "prompt": prompt, "max_tokens": n, "min_tokens": n,
            "temperature": 0.0, "stream": True, "stream_options": {"include_usage": True}}
    tokens = 0
    async with client.stream("POST", f"{url}/v1/completions", json=body,
                             headers={"Authorization": f"Bearer {key}"}) as r:
        r.raise_for_status()
        async for line in r.aiter_lines():
            if line.startswith("data: {"):
                usage = json.loads(line[6:]).get("usage")
                if usage:
                    tokens = usage["completion_tokens"]
    return tokens


def run_serve(prompts: list[list[int]], lens: list[int], threads: int, workers: int) -> dict:
    server = GatewayProcess(["--workers", str(workers), "--num-threads", str(threads), "--standard-max-waiting",
                             str(len(prompts) + 1), "--standard-max-queue-wait", "0"])
    try:
        server.wait_ready()
        key = server.create_tenant("bench", "standard")
        model = httpx.get(f"{server.base_url}/v1/models", headers={"Authorization": f"Bearer {key}"}).json()
        model = model["data"][0]["id"]

        async def drive(batch_prompts, batch_lens) -> tuple[float, int]:
            limits = httpx.Limits(max_connections=len(batch_prompts) + 1)
            async with httpx.AsyncClient(timeout=600, limits=limits) as client:
                t0 = time.perf_counter()
                counts = await asyncio.gather(*(_stream(client, server.base_url, key, model, p, n)
                                                for p, n in zip(batch_prompts, batch_lens)))
                return time.perf_counter() - t0, sum(counts)

        asyncio.run(drive(prompts[:2], lens[:2]))  # warm up
        meter = CpuMeter.start()
        wall, tokens = asyncio.run(drive(prompts, lens))
        return {"workers": workers, "wall_s": round(wall, 2), "output_tokens": tokens,
                "output_tok_s": round(tokens / wall, 1), "cpu": meter.stop()}
    finally:
        server.stop()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--num-requests", type=int, default=64)
    ap.add_argument("--threads", type=int, default=os.cpu_count() or 1,
                    help="torch threads of the offline engine and of each worker (default: one per core, as serve)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--skip-two", action="store_true", help="skip the --workers 2 phase")
    ap.add_argument("--out", type=Path, default=RESULTS / "workers.json")
    args = ap.parse_args()

    from engine.model.loader import load_tokenizer, resolve_model_dir

    prompts, lens = make_workload(args.num_requests, args.seed, load_tokenizer(resolve_model_dir(None)))
    result = {"benchmark": "workers", "machine": machine_facts(), "load_before": load_average(),
              "workload": {"num_requests": len(prompts), "prompt_tokens": sum(map(len, prompts)),
                           "output_tokens": sum(lens), "seed": args.seed}, "threads": args.threads}
    result["offline"] = run_offline(prompts, lens, args.threads)
    print("offline:", result["offline"])
    result["serve_1"] = run_serve(prompts, lens, args.threads, 1)
    print("serve --workers 1:", result["serve_1"])
    if not args.skip_two:
        result["serve_2"] = run_serve(prompts, lens, args.threads, 2)
        print("serve --workers 2:", result["serve_2"])
    ratio = result["serve_1"]["output_tok_s"] / result["offline"]["output_tok_s"]
    result["serve_1_vs_offline"] = round(ratio, 3)
    result["target"] = TARGET
    result["met"] = ratio >= TARGET
    if "serve_2" in result:
        result["serve_2_vs_serve_1"] = round(result["serve_2"]["output_tok_s"] / result["serve_1"]["output_tok_s"], 3)
    result["load_after"] = load_average()
    write_json(result, args.out)
    print(f"serve-1 / offline = {ratio:.3f} (target {TARGET}); written to {args.out}")


if __name__ == "__main__":
    main()
