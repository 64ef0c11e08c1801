"""Multi-LoRA throughput: many adapters in one batch against the base model
alone and against HF transformers + peft, in one run.

The workload is the throughput benchmark's (seeded prompts of 32..512
random ordinary tokens, geometric output lengths forced with min_tokens), and
each request is assigned an adapter. The adapters are random rank-8 LoRAs on
all seven projections of SmolLM2, made with peft and imported into a
throwaway registry.

  base       the engine with no adapter on any request
  lora-8     8 adapters, uniform popularity
  lora-32    32 adapters, uniform popularity
  zipf-32    32 adapters, Zipf popularity (s = 1.1)
  peft       what a user would otherwise run: transformers + peft with every
             adapter loaded, requests grouped by adapter, `set_adapter`
             between static batches of 32 (left padded, each batch run to its
             longest output)

    python benchmarks/multi_lora.py [--num-requests 256] [--dtype float32]
        [--skip-peft] [--threads N] [--out PATH]
"""

from __future__ import annotations

import os

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")  # see benchmarks/throughput.py

import argparse
import json
import random
import tempfile
import time
from pathlib import Path

import torch

from machine import load_average, machine_facts, write_json
from throughput import forced_params, make_workload

TARGETS = {"lora32_vs_base": 0.85, "lora32_vs_peft": 10.0}
RANK = 8
PEFT_BATCH = 32


def make_adapters(model_dir: Path, out: Path, count: int) -> list[Path]:
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    modules = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
    dirs = []
    for i in range(count):
        torch.manual_seed(i)
        base = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
        model = get_peft_model(base, LoraConfig(r=RANK, lora_alpha=16, target_modules=modules,
                                                init_lora_weights=False))
        with torch.no_grad():
            for name, p in model.named_parameters():
                if "lora_B" in name:
                    p.mul_(0.1)
        dirs.append(out / f"bench-{i:02d}")
        model.save_pretrained(dirs[-1])
    return dirs


def assign(num_requests: int, names: list[str], zipf: bool, seed: int) -> list[str]:
    rng = random.Random(seed)
    weights = [1.0 / (k + 1) ** 1.1 for k in range(len(names))] if zipf else None
    return rng.choices(names, weights=weights, k=num_requests)


def run_engine(llm, workload, adapters: list[str | None]) -> dict:
    engine = llm.engine
    # Every phase serves the same prompts: without this, a phase would hit the
    # KV blocks an earlier phase cached under the same adapter (the second base
    # run hit all of the first's) and skip its prefill.
    kv = engine.scheduler.kv
    assert kv.reset_prefix_cache()
    hits_before = kv.prefix_hits
    t0 = time.perf_counter()
    for prompt, n, adapter in zip(workload.prompts, workload.output_lens, adapters):
        engine.add_request(prompt, forced_params(n), adapter=adapter)
    steps = 0
    while engine.has_unfinished():
        engine.step()
        steps += 1
    wall = time.perf_counter() - t0
    slots = engine.lora_slots
    return {"wall_s": round(wall, 2), "output_tok_s": round(workload.output_tokens / wall, 1),
            "processed_tok_s": round((workload.prompt_tokens + workload.output_tokens) / wall, 1),
            "steps": steps, "prefix_hit_tokens": kv.prefix_hits - hits_before, "slot_loads": slots.num_loads if slots else 0,
            "slot_evictions": slots.num_evictions if slots else 0}


def run_peft(model_dir: Path, adapter_dirs: dict[str, Path], workload, adapters: list[str], dtype) -> dict:
    from peft import PeftModel
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model_dir)
    pad = tok.pad_token_id if tok.pad_token_id is not None else tok.eos_token_id
    names = sorted(set(adapters))
    base = AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype)
    model = PeftModel.from_pretrained(base, adapter_dirs[names[0]], adapter_name=names[0])
    for name in names[1:]:
        model.load_adapter(adapter_dirs[name], adapter_name=name)
    model.eval()
    t0 = time.perf_counter()
    for name in names:
        idx = [i for i, a in enumerate(adapters) if a == name]
        model.set_adapter(name)
        for start in range(0, len(idx), PEFT_BATCH):
            batch = idx[start:start + PEFT_BATCH]
            prompts = [workload.prompts[i] for i in batch]
            longest = max(workload.output_lens[i] for i in batch)
            width = max(len(p) for p in prompts)
            ids = torch.tensor([[pad] * (width - len(p)) + p for p in prompts])
            mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])
            with torch.inference_mode():
                model.generate(input_ids=ids, attention_mask=mask, do_sample=False, max_new_tokens=longest,
                               min_new_tokens=longest, pad_token_id=pad)
    wall = time.perf_counter() - t0
    return {"wall_s": round(wall, 2), "output_tok_s": round(workload.output_tokens / wall, 1),
            "num_adapters": len(names)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--num-requests", type=int, default=256)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    parser.add_argument("--skip-peft", action="store_true")
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--out", default="benchmarks/results/multi_lora.json")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    from engine import LLM
    from engine.model.loader import resolve_model_dir

    model_dir = resolve_model_dir(None)
    result: dict = {"args": vars(args), "machine": machine_facts(), "load_before": load_average()}
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        dirs = make_adapters(model_dir, tmp / "peft", 32)
        names = [d.name for d in dirs]
        llm = LLM(dtype=args.dtype, data_dir=str(tmp / "data"), max_loras=32, max_lora_rank=RANK,
                  max_cpu_loras=32)
        for name, path in zip(names, dirs):
            llm.adapters.import_dir(name, path)
        if llm.engine.core.runner.device.type == "cpu":
            from engine.model import cpu_linear

            result["cpu_linear_row_limit"] = (cpu_linear.row_limit(getattr(torch, args.dtype), torch.get_num_threads())
                                              if cpu_linear.load_kernel() else None)
        workload = make_workload(args.num_requests, args.seed, llm.tokenizer)
        result["workload"] = workload.summary()
        llm.generate(workload.prompts[:2], forced_params(4), adapters=names[:2])  # warm-up, loads slots

        plans = {
            "base": [None] * args.num_requests,
            "lora-8": assign(args.num_requests, names[:8], zipf=False, seed=1),
            "lora-32": assign(args.num_requests, names, zipf=False, seed=2),
            "zipf-32": assign(args.num_requests, names, zipf=True, seed=3),
        }
        for label, adapters in plans.items():
            result[label] = run_engine(llm, workload, adapters)
            print(label, result[label], flush=True)
        # Base again at the end: on a shared machine the load drifts, and the
        # better of the two base runs is the reference the LoRA runs must meet.
        result["base-again"] = run_engine(llm, workload, plans["base"])
        print("base-again", result["base-again"], flush=True)
        del llm
        if not args.skip_peft:
            result["peft"] = run_peft(model_dir, dict(zip(names, dirs)), workload, plans["lora-32"],
                                      getattr(torch, args.dtype))
            print("peft", result["peft"], flush=True)
    base = max(result["base"]["output_tok_s"], result["base-again"]["output_tok_s"])
    result["ratios"] = {label: round(result[label]["output_tok_s"] / base, 3)
                        for label in ("lora-8", "lora-32", "zipf-32")}
    if "peft" in result:
        result["ratios"]["lora-32_vs_peft"] = round(result["lora-32"]["output_tok_s"]
                                                    / result["peft"]["output_tok_s"], 2)
    result["targets"] = TARGETS
    result["load_after"] = load_average()
    print(json.dumps({"ratios": result["ratios"], "targets": TARGETS}, indent=2))
    write_json(result, args.out)


if __name__ == "__main__":
    main()
