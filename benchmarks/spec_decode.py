"""Speculative decoding (n-gram prompt lookup) against plain decoding, in
one run, on the offline engine with greedy sampling.

Two workloads, each at several batch sizes (requests submitted at once):

  copy    chat prompts that ask the model to repeat or lightly edit a
          paragraph it is given: the output copies the prompt, which is
          where prompt lookup drafts well;
  open    open questions whose answers copy little of the prompt: drafts
          are mostly wrong, so this measures what speculation costs when
          it does not pay;
  random  random ordinary token ids as prompts, outputs forced to a fixed
          length (ignore_eos). A small model tends to fall into loops on
          such input, which prompt lookup then drafts well.

For every (workload, batch size) the same engine runs the same requests
with speculation off and on, interleaved (off, on, off, on, ...) so that
load changes on a shared host hit both alike; the prefix cache is reset
before every run. "on" here ignores the disable threshold (it is set above
the batch size), so the figures say where the threshold should be. Greedy
outputs with speculation must equal those without: `outputs_changed`
counts the outputs that differ from the first plain run (expected 0).

Reported per cell: output tok/s off and on (the median of the repeats), the
speedup, acceptance rate (accepted / drafted tokens), mean tokens emitted
per drafting step, and the load average before and after.

    python benchmarks/spec_decode.py [--batch-sizes 1,4,16] [--k 7] [--output-len 96]
        [--repeats 2] [--threads N] [--out PATH]
"""

from __future__ import annotations

import os

# Before torch is imported (see benchmarks/throughput.py).
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import argparse
import random
import statistics
import time

import torch
from machine import CpuMeter, load_average, machine_facts, write_json

PARAGRAPHS = [
    "Paged attention stores the keys and values of every sequence in fixed-size blocks, so memory is "
    "allocated as a sequence grows and freed the moment it ends, and no space is reserved for tokens "
    "that may never be generated.",
    "The scheduler runs one step at a time. It first serves the sequences that are decoding, then "
    "prefills new prompts with the token budget that is left, and it preempts the newest sequence when "
    "the cache runs out of blocks.",
    "Our meeting is moved from Tuesday to Thursday at ten in the morning. Please bring the quarterly "
    "report, the budget spreadsheet and your notes from the customer visit, and tell Maria if you cannot come.",
    "To reset your password, open the settings page, choose security, and press the reset button. A link "
    "is sent to your email address; it expires after thirty minutes, so use it soon.",
]
INSTRUCTIONS = [
    "Repeat the following text exactly, word for word:\n\n{}",
    "Fix any typos in the following text and return the full text:\n\n{}",
    "Rewrite the following text with 'Thursday' replaced by 'Friday', changing nothing else:\n\n{}",
    "Copy this text back to me:\n\n{}",
]


def copy_prompts(llm, n: int) -> list[list[int]]:
    out = []
    for i in range(n):
        text = INSTRUCTIONS[i % len(INSTRUCTIONS)].format(PARAGRAPHS[(i // len(INSTRUCTIONS) + i) % len(PARAGRAPHS)])
        out.append(llm.engine.apply_chat_template([{"role": "user", "content": text}]))
    return out


QUESTIONS = [
    "Why is the sky blue? Answer in a short paragraph.",
    "Write a short poem about autumn leaves falling in a park.",
    "Give three tips for a first job interview.",
    "Explain what a hash table is to a beginner.",
    "Describe a good breakfast for a busy morning.",
    "What should I pack for a weekend hiking trip?",
]


def open_prompts(llm, n: int) -> list[list[int]]:
    return [llm.engine.apply_chat_template([{"role": "user", "content": QUESTIONS[i % len(QUESTIONS)]}])
            for i in range(n)]


def random_prompts(tokenizer, n: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    special = set(tokenizer.all_special_ids)
    vocab = [t for t in range(len(tokenizer)) if t not in special]
    return [[rng.choice(vocab) for _ in range(rng.randint(64, 256))] for _ in range(n)]


def run_once(llm, policy, prompts, params) -> dict:
    """One batch, all submitted at once, with speculation `policy` (None: off)."""
    sched = llm.engine.scheduler
    sched.speculation = policy
    sched.kv.reset_prefix_cache()
    before = (policy.stats.num_draft_tokens, policy.stats.num_accepted_tokens, policy.stats.num_drafts) \
        if policy else (0, 0, 0)
    meter = CpuMeter.start()
    t0 = time.perf_counter()
    outs = llm.generate(prompts, params)
    wall = time.perf_counter() - t0
    cpu = meter.stop()
    tokens = [o.outputs[0].token_ids for o in outs]
    after = (policy.stats.num_draft_tokens, policy.stats.num_accepted_tokens, policy.stats.num_drafts) \
        if policy else (0, 0, 0)
    drafted, accepted, drafts = (a - b for a, b in zip(after, before))
    return {"wall_s": wall, "output_tokens": sum(len(t) for t in tokens), "tokens": tokens,
            "drafted": drafted, "accepted": accepted, "drafts": drafts, "other_cores": cpu.get("other_cores")}


def run_cell(llm, policy, prompts, params, repeats: int) -> dict:
    runs = {"off": [], "on": []}
    for _ in range(repeats):
        for mode in ("off", "on"):
            runs[mode].append(run_once(llm, policy if mode == "on" else None, prompts, params))
    off, on = runs["off"], runs["on"]
    # Greedy outputs must not change; a float near-tie flipped by the batch's
    # shape would show here as a count, not stop the run.
    changed = sum(a != b for r in off + on for a, b in zip(r["tokens"], off[0]["tokens"]))
    tok_s = {mode: statistics.median(r["output_tokens"] / r["wall_s"] for r in rs) for mode, rs in runs.items()}
    drafted = sum(r["drafted"] for r in on)
    accepted = sum(r["accepted"] for r in on)
    drafts = sum(r["drafts"] for r in on)
    return {
        "requests": len(prompts),
        "output_tokens": off[0]["output_tokens"],
        "off_tok_s": round(tok_s["off"], 2),
        "on_tok_s": round(tok_s["on"], 2),
        "speedup": round(tok_s["on"] / tok_s["off"], 3),
        "outputs_changed": changed,
        "acceptance_rate": round(accepted / drafted, 3) if drafted else None,
        "tokens_per_drafting_step": round((accepted + drafts) / drafts, 2) if drafts else None,
        "wall_s": {mode: [round(r["wall_s"], 2) for r in rs] for mode, rs in runs.items()},
        "other_cores": {mode: [r["other_cores"] for r in rs] for mode, rs in runs.items()},
    }


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--batch-sizes", default="1,4,16", help="comma-separated")
    parser.add_argument("--workloads", default="copy,open,random", help="comma-separated: copy, open, random")
    parser.add_argument("--k", type=int, default=None, help="--num-speculative-tokens (default: the engine's)")
    parser.add_argument("--prompt-lookup-min", type=int, default=None, help="default: the engine's")
    parser.add_argument("--output-len", type=int, default=96, help="max tokens (forced for random)")
    parser.add_argument("--repeats", type=int, default=2, help="off/on pairs per cell")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--threads", type=int, default=None, help="torch intra-op threads (default: torch's)")
    parser.add_argument("--out", default="benchmarks/results/spec_decode.json")
    return parser.parse_args()


def main() -> None:
    args = parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    from engine import LLM, SamplingParams

    sizes = [int(b) for b in args.batch_sizes.split(",")]
    lookup = {"prompt_lookup_min": args.prompt_lookup_min} if args.prompt_lookup_min else {}
    # Speculation on at every batch size measured; run_once switches it per run.
    drafts = {"num_speculative_tokens": args.k} if args.k else {}
    llm = LLM(speculative="ngram", **drafts, speculative_disable_batch_size=max(sizes),
              **lookup)
    policy = llm.engine.scheduler.speculation
    result: dict = {"args": vars(args), "machine": machine_facts(), "load_before": load_average(),
                    "speculative": {k: v for k, v in llm.config.to_flat().items()
                                    if k.startswith(("num_speculative", "prompt_lookup", "speculative"))},
                    "cells": {}}
    llm.generate(copy_prompts(llm, 2), SamplingParams(temperature=0.0, max_tokens=8))  # warm-up
    for workload in args.workloads.split(","):
        for b in sizes:
            if workload in ("copy", "open"):
                prompts = (copy_prompts if workload == "copy" else open_prompts)(llm, b)
                params = SamplingParams(temperature=0.0, max_tokens=args.output_len)
            else:
                prompts = random_prompts(llm.tokenizer, b, args.seed + b)
                params = SamplingParams(temperature=0.0, max_tokens=args.output_len, min_tokens=args.output_len,
                                        ignore_eos=True)
            cell = run_cell(llm, policy, prompts, params, args.repeats)
            cell["load_after"] = load_average()
            result["cells"][f"{workload}/b{b}"] = cell
            print(f"{workload:>6} b={b:<3} off {cell['off_tok_s']:7.1f} tok/s  on {cell['on_tok_s']:7.1f} tok/s  "
                  f"x{cell['speedup']:.2f}  acceptance {cell['acceptance_rate']}  load {cell['load_after']}",
                  flush=True)
    result["load_after"] = load_average()
    write_json(result, args.out)


if __name__ == "__main__":
    main()
