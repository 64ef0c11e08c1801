"""What --quantization trades on the bundled SmolLM2-135M: decode speed,
perplexity and greedy agreement with float32, none / int8 / int4, in
float32 and bfloat16 activations, all in one run.

  decode     the offline engine's decode tok/s at batch 1, 4 and 16: each
             batch generated twice, to SHORT and to LONG tokens (forced,
             greedy), and the rate taken from the difference, so prefill
             drops out. Engines are built first and timed round-robin,
             best of --rounds (the least disturbed on a shared host).
  ppl        perplexity of PARAGRAPH under the quantized weights (HF
             transformers on the dequantized weights: what the format
             costs, apart from our kernels' rounding).
  agreement  share of greedy tokens equal to float32's, position by
             position, over the decode benchmark's prompts.

    python benchmarks/quantization.py [--dtypes float32 bfloat16] [--rounds 3] [--out PATH]
"""

from __future__ import annotations

import os

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")  # as the other CPU benchmarks; see throughput.py

import argparse
import math
import time

import torch
from machine import load_average, machine_facts, write_json

METHODS = ("none", "int8", "int4")
BATCHES = (1, 4, 16)
SHORT, LONG = 4, 36
PROMPTS = ["Why is the sky blue?", "Write a short poem about autumn leaves.", "The capital of France is",
           "Explain continuous batching in one paragraph.", "Once upon a time, in a village by the sea,",
           "def fibonacci(n):", "List three prime numbers.", "How do bees make honey?"]
PARAGRAPH = (
    "The river bends twice before it reaches the old mill by the bridge. In spring the water rises and "
    "covers the stones that children use to cross in summer, and the miller's family moves the sacks of "
    "flour to the upper floor. Most years the flood is gentle. It leaves a line of mud on the walls and a "
    "smell of wet wood that lasts until June. The village keeps a record of every flood since 1820 on a "
    "board inside the church, and the highest mark, from a night in March 1947, sits a full metre above "
    "the door. Engineers have proposed a dam upstream more than once, but the village has always voted "
    "against it, because the meadows downstream need the silt that the water brings."
)


def batch_prompts(n: int) -> list[str]:
    return [PROMPTS[i % len(PROMPTS)] + f" ({i})" * (i >= len(PROMPTS)) for i in range(n)]


def decode_seconds(llm, batch: int) -> float:
    """Seconds for LONG - SHORT decode steps of `batch` sequences."""
    from engine import SamplingParams

    prompts = batch_prompts(batch)
    spent = []
    for tokens in (SHORT, LONG):
        params = SamplingParams(temperature=0.0, max_tokens=tokens, min_tokens=tokens)
        t0 = time.perf_counter()
        llm.generate(prompts, params)
        spent.append(time.perf_counter() - t0)
    return spent[1] - spent[0]


def greedy(llm) -> list[list[int]]:
    from engine import SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=24, min_tokens=24)
    return [o.outputs[0].token_ids for o in llm.generate(PROMPTS, params)]


def perplexity(model_dir, method: str, dtype: torch.dtype) -> float:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from engine.model import quant_linear

    tok = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    if method != "none":
        with torch.no_grad():
            for name, mod in model.named_modules():
                if isinstance(mod, torch.nn.Linear) and name.startswith("model.layers."):
                    mod.weight.data = quant_linear.quantize(mod.weight.data, method).dequantize(torch.float32)
            head = quant_linear.quantize(model.model.embed_tokens.weight.data, quant_linear.HEAD_QUANTIZATION[method])
            model.lm_head.weight = torch.nn.Parameter(head.dequantize(torch.float32))  # unties it
    model = model.to(dtype)
    ids = tok(PARAGRAPH, return_tensors="pt").input_ids
    with torch.inference_mode():
        loss = model(ids, labels=ids).loss.item()
    return round(math.exp(loss), 3)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--dtypes", nargs="+", default=["float32", "bfloat16"])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--out", default="benchmarks/results/quantization.json")
    args = parser.parse_args()
    from engine import LLM
    from engine.model.loader import resolve_model_dir

    result: dict = {"args": vars(args), "machine": machine_facts(), "load_before": load_average(), "runs": {}}
    engines = {(d, m): LLM(dtype=d, quantization=m, num_kv_blocks=256, max_num_seqs=max(BATCHES))
               for d in args.dtypes for m in METHODS}
    best = {key: {b: float("inf") for b in BATCHES} for key in engines}
    for _ in range(args.rounds):
        for batch in BATCHES:
            for key, llm in engines.items():
                best[key][batch] = min(best[key][batch], decode_seconds(llm, batch))
    reference = greedy(engines[(args.dtypes[0], "none")]) if args.dtypes[0] == "float32" else None
    model_dir = resolve_model_dir(None)
    for (d, m), llm in engines.items():
        run = {"decode_tok_s": {b: round(b * (LONG - SHORT) / s, 1) for b, s in best[(d, m)].items()},
               "perplexity": perplexity(model_dir, m, getattr(torch, d))}
        if reference is not None:
            got = greedy(llm)
            same = sum(a == b for x, y in zip(reference, got) for a, b in zip(x, y))
            run["greedy_agreement_vs_float32"] = round(same / sum(len(x) for x in reference), 3)
        result["runs"][f"{d}/{m}"] = run
        print(f"{d}/{m}: {run}", flush=True)
    result["load_after"] = load_average()
    write_json(result, args.out)


if __name__ == "__main__":
    main()
