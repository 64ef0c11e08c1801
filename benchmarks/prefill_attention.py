"""The CPU prefill attention kernel (engine/attention/cpu_prefill.py:
bfloat16 on AVX512-BF16, float32 anywhere) against its torch twin (one SDPA
per chunk), on prefill steps as the engine runs them: SmolLM2-135M's 30
layers (9 query heads, 3 KV heads, head_dim 64) and a KV cache of the bytes
`LLM()` allocates by default on a bfloat16 host (11,650 blocks of 16),
blocks scattered over a shuffled pool. `--kv-cache-dtype float16` keeps
float32 queries over a float16 cache (a float32 model's default cache on
the CPU).

A step is given as chunks: `NxQ` is N chunks of Q new tokens each with no
cached prefix (a prompt's first chunk: SDPA's `is_causal` path), `NxQ+P`
the same over a prefix of P positions already in the cache (a chunk after
the first, or a prefix-cache hit: SDPA over the gathered blocks with a
mask). Each figure is the median over --rounds of one whole step's
attention (every layer's `TorchAttentionBackend.forward`), in
milliseconds, with the causal attention's GFLOP/s (the scores and values
a query can see: 4 * head_dim flops per query head and visible key) and
the kernel's speedup over the twin.

    python benchmarks/prefill_attention.py [--dtype float32] [--kv-cache-dtype float16]
        [--chunks 4x256 1x512+512 2x128+384] [--rounds 5] [--out PATH]
"""

from __future__ import annotations

import os

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")  # as the other CPU benchmarks; see throughput.py

import argparse

import torch
from decode_attention import (
    BLOCK_SIZE,
    HEAD_DIM,
    LAYERS,
    NUM_HEADS,
    NUM_KV_HEADS,
    _Config,
    add_dtype_args,
    dtypes_and_blocks,
    time_step,
)
from machine import load_average, machine_facts, write_json

from engine.attention.base import AttentionMetadata
from engine.attention.torch_backend import TorchAttentionBackend
from engine.model.loader import allocate_kv_caches


def parse_chunks(spec: str) -> list[tuple[int, int]]:
    """"NxQ[+P]" -> N times (seq_len, query_len)."""
    count, _, rest = spec.partition("x")
    query, _, prefix = rest.partition("+")
    q, p = int(query), int(prefix or 0)
    return [(p + q, q)] * int(count)


def chunk_meta(seqs: list[tuple[int, int]], num_blocks: int, gen: torch.Generator) -> AttentionMetadata:
    """Chunks over blocks drawn from the whole pool; the new tokens' slots are the last query_len."""
    blocks_per_seq = [-(-n // BLOCK_SIZE) for n, _ in seqs]
    pool = torch.randperm(num_blocks, generator=gen)[: sum(blocks_per_seq)].tolist()
    width = max(blocks_per_seq)
    tables, slots, start = [], [], 0
    for (n, q), nb in zip(seqs, blocks_per_seq, strict=True):
        row = pool[start : start + nb]
        start += nb
        slots += [row[p // BLOCK_SIZE] * BLOCK_SIZE + p % BLOCK_SIZE for p in range(n - q, n)]
        tables.append(row + [0] * (width - nb))
    query_lens = [q for _, q in seqs]
    return AttentionMetadata(
        slot_mapping=torch.tensor(slots, dtype=torch.int64),
        query_start_loc=torch.tensor([0, *torch.tensor(query_lens).cumsum(0).tolist()], dtype=torch.int32),
        seq_lens=torch.tensor([n for n, _ in seqs], dtype=torch.int32),
        block_tables=torch.tensor(tables, dtype=torch.int32),
        query_lens_host=query_lens,
        seq_lens_host=[n for n, _ in seqs],
        block_size=BLOCK_SIZE,
    )


def causal_gflop(seqs: list[tuple[int, int]]) -> float:
    """Per step: each query sees the prefix and the chunk's tokens up to its own."""
    visible = sum(q * (n - q) + q * (q + 1) // 2 for n, q in seqs)
    return 4 * HEAD_DIM * NUM_HEADS * visible * LAYERS / 1e9


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--chunks", nargs="+", default=["1x64", "4x256", "1x512+512", "2x128+384", "1x1024"],
                        help="a step's chunks: NxQ, or NxQ+P over a cached prefix of P")
    add_dtype_args(parser)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--out", default=None, help="default: benchmarks/results/prefill_attention-<dtype>.json")
    args = parser.parse_args()
    dtype, cache_dtype, num_blocks = dtypes_and_blocks(parser, args)
    result = {"machine": machine_facts(), "dtype": args.dtype, "kv_cache_dtype": str(cache_dtype)[6:],
              "threads": torch.get_num_threads(), "num_blocks": num_blocks, "load_before": load_average(),
              "steps": {}}
    caches = allocate_kv_caches(_Config, num_blocks, BLOCK_SIZE, cache_dtype, torch.device("cpu"))
    gen = torch.Generator().manual_seed(0)
    for cache in caches:
        for t in cache:
            t.normal_(generator=gen)
    backends = {"kernel": TorchAttentionBackend(prefill_kernel=True),
                "twin": TorchAttentionBackend(prefill_kernel=False)}
    print(f"{args.dtype} over a {result['kv_cache_dtype']} cache, {num_blocks} blocks, "
          f"{torch.get_num_threads()} threads")
    for spec in args.chunks:
        seqs = parse_chunks(spec)
        meta = chunk_meta(seqs, num_blocks, gen)
        t = meta.slot_mapping.shape[0]
        q = torch.randn(t, NUM_HEADS, HEAD_DIM, generator=gen).to(dtype)
        k = torch.randn(t, NUM_KV_HEADS, HEAD_DIM, generator=gen).to(dtype)
        v = torch.randn(t, NUM_KV_HEADS, HEAD_DIM, generator=gen).to(dtype)
        gflop = causal_gflop(seqs)
        row = {"seq_len": seqs[0][0], "query_len": seqs[0][1], "num_chunks": len(seqs),
               "gflop_per_step": round(gflop, 2)}
        outs = {}
        for name, backend in backends.items():
            ms, outs[name] = time_step(backend, caches, meta, q, k, v, args.rounds)
            row[name] = {"ms_per_step": round(ms, 2), "gflop_s": round(gflop / ms * 1e3, 1)}
        row["speedup"] = round(row["twin"]["ms_per_step"] / row["kernel"]["ms_per_step"], 2)
        row["max_abs_diff"] = (outs["kernel"].float() - outs["twin"].float()).abs().max().item()
        result["steps"][spec] = row
        print(f"{spec:>10}: kernel {row['kernel']['ms_per_step']:8.2f} ms ({row['kernel']['gflop_s']:5.1f} GFLOP/s), "
              f"twin {row['twin']['ms_per_step']:8.2f} ms ({row['twin']['gflop_s']:5.1f} GFLOP/s): "
              f"{row['speedup']}x, max |diff| {row['max_abs_diff']:.4f}")
    result["load_after"] = load_average()
    print(f"load before {result['load_before']}, after {result['load_after']}")
    suffix = f"-{args.kv_cache_dtype}-cache" if args.kv_cache_dtype else ""
    write_json(result, args.out or f"benchmarks/results/prefill_attention-{args.dtype}{suffix}.json")


if __name__ == "__main__":
    main()
