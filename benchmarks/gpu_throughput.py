"""Offline throughput on a CUDA GPU: loragw's engine against HF static
batching on the same GPU, the same workload, in one run.

The workload is throughput.py's (seeded prompts of random ordinary token
ids, geometric output lengths forced with min_tokens and ignore_eos), so
both sides emit exactly the same tokens. The engine runs with its defaults
on the GPU (`--dtype auto` is bfloat16 there, attention and LoRA ops are the
Triton kernels); HF `generate` runs left-padded batches of 32 in arrival
order, each to its longest output. A roofline of the matmuls alone says
little on a GPU at this size, so there is none: the ratio to HF is the
figure.

    python benchmarks/gpu_throughput.py [--model DIR] [--dtype bfloat16]
        [--num-requests 256] [--prompt-range 32 512] [--mean-output 128] [--out PATH]

Without `--model` it serves the bundled SmolLM2-135M. Where that package
cannot travel, benchmarks/gpu_check.sh puts a checkpoint of the same shape
with random weights in its place (throughput does not depend on the
weights' values).
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
from machine import load_average, write_json
from throughput import HF_BATCH_SIZE, forced_params, hf_generate, make_workload, warm_up_engine


def _sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def run_engine(llm, workload) -> dict:
    engine = llm.engine
    _sync()
    t0 = time.perf_counter()
    ids = [engine.add_request(p, forced_params(n)) for p, n in zip(workload.prompts, workload.output_lens)]
    batched, done = [], {}
    while engine.has_unfinished():
        outs = engine.step(final_only=True)
        batched.append(engine.core.last_schedule.num_batched_tokens)
        done.update((o.request_id, o) for o in outs if o.finished)
    _sync()
    wall = time.perf_counter() - t0
    emitted = [len(done[i].outputs[0].token_ids) for i in ids]
    assert emitted == workload.output_lens, "the engine did not emit exactly the forced lengths"
    return {
        "wall_s": round(wall, 2),
        "output_tok_s": round(workload.output_tokens / wall, 1),
        "processed_tok_s": round((workload.prompt_tokens + workload.output_tokens) / wall, 1),
        "steps": len(batched),
        "ms_per_step": round(wall / len(batched) * 1e3, 2),
        "batched_tokens_per_step_mean": round(statistics.mean(batched), 1),
        "peak_gpu_memory_gib": (round(torch.cuda.max_memory_allocated() / 2**30, 2)
                                if torch.cuda.is_available() else None),
    }


def run_hf(model_dir, dtype: torch.dtype, device: str, workload) -> dict:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype).to(device).eval()
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    hf_generate(model, workload.prompts[:2], 4, pad)  # warm-up
    _sync()
    t0 = time.perf_counter()
    for start in range(0, len(workload.prompts), HF_BATCH_SIZE):
        longest = max(workload.output_lens[start:start + HF_BATCH_SIZE])
        hf_generate(model, workload.prompts[start:start + HF_BATCH_SIZE], longest, pad)
    _sync()
    wall = time.perf_counter() - t0
    return {"batch_size": HF_BATCH_SIZE, "wall_s": round(wall, 2),
            "output_tok_s": round(workload.output_tokens / wall, 1)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=None, help="checkpoint directory (default: the bundled SmolLM2)")
    parser.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16"])
    parser.add_argument("--num-requests", type=int, default=256)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--prompt-range", type=int, nargs=2, default=(32, 512), metavar=("MIN", "MAX"))
    parser.add_argument("--mean-output", type=int, default=128)
    parser.add_argument("--skip-hf", action="store_true")
    parser.add_argument("--device", default="cuda", help="cpu only to try the script out; throughput.py is the CPU's")
    parser.add_argument("--out", default="benchmarks/results/gpu_throughput.json")
    args = parser.parse_args()
    if args.device.startswith("cuda") and not torch.cuda.is_available():
        raise SystemExit("gpu_throughput.py needs a CUDA GPU; benchmarks/throughput.py is the CPU's")

    from engine import LLM

    gpu = torch.cuda.get_device_name(args.device) if args.device.startswith("cuda") else None
    result: dict = {"args": vars(args), "gpu": gpu, "torch": torch.__version__, "load_before": load_average()}
    llm = LLM(args.model, dtype=args.dtype, device=args.device)
    dtype = next(llm.engine.core.runner.model.parameters()).dtype
    flat = llm.config.to_flat()
    result["engine_config"] = {k: flat[k] for k in ("max_num_seqs", "max_num_batched_tokens", "block_size",
                                                    "attention_backend", "lora_backend")}
    result["engine_config"]["dtype"] = str(dtype).removeprefix("torch.")
    result["engine_config"]["attention"] = type(llm.engine.core.runner.attn_backend).__name__
    workload = make_workload(args.num_requests, args.seed, llm.tokenizer, min_prompt=args.prompt_range[0],
                             max_prompt=args.prompt_range[1], mean_output=args.mean_output)
    result["workload"] = workload.summary()
    warm_up_engine(llm, llm.tokenizer)
    result["engine"] = run_engine(llm, workload)
    model_dir = llm.engine.model_dir
    del llm
    if not args.skip_hf:
        result["hf"] = run_hf(model_dir, dtype, args.device, workload)
        result["output_vs_hf"] = round(result["engine"]["output_tok_s"] / result["hf"]["output_tok_s"], 2)
    result["load_after"] = load_average()
    eng = result["engine"]
    print(f"gpu        {result['gpu']}, torch {result['torch']}, {result['engine_config']}")
    print(f"workload   {result['workload']}")
    print(f"engine     output {eng['output_tok_s']} tok/s, processed {eng['processed_tok_s']} tok/s "
          f"({eng['wall_s']} s, {eng['steps']} steps of {eng['ms_per_step']} ms, "
          f"{eng['batched_tokens_per_step_mean']} tokens/step, peak {eng['peak_gpu_memory_gib']} GiB)")
    if "hf" in result:
        print(f"hf static  output {result['hf']['output_tok_s']} tok/s ({result['hf']['wall_s']} s); "
              f"engine/HF {result['output_vs_hf']}x")
    write_json(result, args.out)


if __name__ == "__main__":
    main()
