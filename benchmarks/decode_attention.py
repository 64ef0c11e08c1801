"""The CPU decode attention kernel (engine/attention/cpu_decode.py) against
its torch twin (the bucketed SDPA path), on decode steps as the engine runs
them: SmolLM2-135M's 30 layers (9 query heads, 3 KV heads, head_dim 64), a
KV cache as large as `LLM()` allocates by default here (11,650 blocks of 16
in bfloat16, 5,825 in float32: 4.3 GB, far past the caches), and sequences
whose blocks are scattered over a shuffled pool, as after a while of
serving.

Each figure is the median over --rounds of one whole decode step's
attention (every layer's `TorchAttentionBackend.forward`: the new K/V
written, then attention), in milliseconds, with the K/V bytes read per
second and the kernel's speedup over the twin. The KV cache lies where the
engine puts it (`allocate_kv_caches`).

`--kv-cache-dtype float16` keeps float32 queries over a float16 cache (a
float32 model's default cache on the CPU), as many blocks as the same bytes
hold.

`--hot` gives every sequence the same blocks, the pool's first, all but its
last (its own, where its new K/V is written), so that a layer's K/V
(hundreds of KiB; about 1 MiB over a float32 cache) stay in the caches: the
kernel's arithmetic, where the default measures it reading from memory. The
two together say which one bounds it.

    python benchmarks/decode_attention.py [--dtype bfloat16] [--kv-cache-dtype float16] [--hot]
        [--batches 1x512 4x300 16x450 64x500] [--rounds 5] [--out PATH]
"""

from __future__ import annotations

import os

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")  # as the other CPU benchmarks; see throughput.py

import argparse
import statistics
import time

import torch
from machine import load_average, machine_facts, write_json

from engine.attention.base import AttentionMetadata
from engine.attention.torch_backend import TorchAttentionBackend
from engine.model.loader import allocate_kv_caches

NUM_HEADS, NUM_KV_HEADS, HEAD_DIM, BLOCK_SIZE, LAYERS = 9, 3, 64, 16, 30
CACHE_BYTES = 11650 * 2 * LAYERS * BLOCK_SIZE * NUM_KV_HEADS * HEAD_DIM * 2  # LLM()'s bfloat16 cache here


class _Config:  # what allocate_kv_caches reads of an HF config
    num_hidden_layers, num_attention_heads, num_key_value_heads, head_dim = LAYERS, NUM_HEADS, NUM_KV_HEADS, HEAD_DIM
    hidden_size = NUM_HEADS * HEAD_DIM


def decode_meta(lens: list[int], num_blocks: int, gen: torch.Generator, hot: bool = False) -> AttentionMetadata:
    """One decode token per sequence over blocks drawn from the whole pool,
    or with `hot` over the pool's first blocks, shared by every sequence,
    but for its last block: its own, so that no sequence writes into
    another's context."""
    blocks_per_seq = [-(-n // BLOCK_SIZE) for n in lens]
    pool = torch.randperm(num_blocks, generator=gen)[: sum(blocks_per_seq)].tolist()
    width = max(blocks_per_seq)
    assert not hot or width + len(lens) <= num_blocks, "more blocks than the pool holds"
    tables, slots, start = [], [], 0
    for i, (n, nb) in enumerate(zip(lens, blocks_per_seq, strict=True)):
        row = [*range(nb - 1), width + i] if hot else pool[start : start + nb]
        start += nb
        slots.append(row[(n - 1) // BLOCK_SIZE] * BLOCK_SIZE + (n - 1) % BLOCK_SIZE)
        tables.append(row + [0] * (width - nb))
    return AttentionMetadata(
        slot_mapping=torch.tensor(slots, dtype=torch.int64),
        query_start_loc=torch.arange(len(lens) + 1, dtype=torch.int32),
        seq_lens=torch.tensor(lens, dtype=torch.int32),
        block_tables=torch.tensor(tables, dtype=torch.int32),
        query_lens_host=[1] * len(lens),
        seq_lens_host=list(lens),
        block_size=BLOCK_SIZE,
    )


def add_dtype_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--dtype", default="bfloat16", choices=["float32", "bfloat16"])
    parser.add_argument("--kv-cache-dtype", default=None, choices=["float16"],
                        help="the cache's element type (default: --dtype); float16 needs --dtype float32")


def dtypes_and_blocks(parser: argparse.ArgumentParser, args) -> tuple[torch.dtype, torch.dtype, int]:
    """The queries' and the cache's dtypes, and as many cache blocks as CACHE_BYTES hold of the latter."""
    dtype = getattr(torch, args.dtype)
    cache_dtype = getattr(torch, args.kv_cache_dtype or args.dtype)
    if cache_dtype != dtype and dtype != torch.float32:
        parser.error("--kv-cache-dtype float16 needs --dtype float32")
    return dtype, cache_dtype, CACHE_BYTES // (2 * LAYERS * BLOCK_SIZE * NUM_KV_HEADS * HEAD_DIM * cache_dtype.itemsize)


def time_step(backend, caches, meta, q, k, v, rounds: int) -> tuple[float, torch.Tensor]:
    """Median milliseconds of one step's attention over every layer, and the last layer's output."""
    scale = HEAD_DIM**-0.5

    def step() -> torch.Tensor:
        backend.prepare(meta)
        for k_cache, v_cache in caches:
            out = backend.forward(q, k, v, k_cache, v_cache, meta, scale)
        return out

    out = step()
    times = []
    for _ in range(rounds):
        t0 = time.perf_counter()
        out = step()
        times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times), out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_dtype_args(parser)
    parser.add_argument("--batches", nargs="+", default=["1x512", "4x300", "16x450", "64x500"],
                        help="NxL: N sequences of mean context L (uniform in L/2 .. 3L/2)")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--hot", action="store_true",
                        help="every sequence over the same blocks but its last: K/V in cache")
    parser.add_argument("--out", default=None,
                        help="default: benchmarks/results/decode_attention-<dtype>[-float16-cache][-hot].json")
    args = parser.parse_args()
    dtype, cache_dtype, num_blocks = dtypes_and_blocks(parser, args)
    result = {"machine": machine_facts(), "dtype": args.dtype, "kv_cache_dtype": str(cache_dtype)[6:], "hot": args.hot,
              "threads": torch.get_num_threads(),
              "num_blocks": num_blocks, "load_before": load_average(), "batches": {}}
    caches = allocate_kv_caches(_Config, num_blocks, BLOCK_SIZE, cache_dtype, torch.device("cpu"))
    gen = torch.Generator().manual_seed(0)
    for cache in caches:
        for t in cache:
            t.normal_(generator=gen)
    backends = {"kernel": TorchAttentionBackend(decode_kernel=True), "twin": TorchAttentionBackend(decode_kernel=False)}
    hot = " (hot: shared by every sequence)" if args.hot else ""
    threads = torch.get_num_threads()
    print(f"{args.dtype} over a {str(cache_dtype)[6:]} cache, {num_blocks} blocks{hot}, {threads} threads")
    for spec in args.batches:
        n, mean = (int(x) for x in spec.split("x"))
        lens = torch.randint(mean // 2, mean * 3 // 2 + 1, (n,), generator=gen).tolist()
        meta = decode_meta(lens, num_blocks, gen, hot=args.hot)
        q = torch.randn(n, NUM_HEADS, HEAD_DIM, generator=gen).to(dtype)
        k = torch.randn(n, NUM_KV_HEADS, HEAD_DIM, generator=gen).to(dtype)
        v = torch.randn(n, NUM_KV_HEADS, HEAD_DIM, generator=gen).to(dtype)
        gb = 2 * sum(lens) * NUM_KV_HEADS * HEAD_DIM * cache_dtype.itemsize * LAYERS / 1e9
        row, outs = {"num_seqs": n, "positions": sum(lens), "kv_gb_per_step": round(gb, 3)}, {}
        for name, backend in backends.items():
            ms, outs[name] = time_step(backend, caches, meta, q, k, v, args.rounds)
            row[name] = {"ms_per_step": round(ms, 2), "kv_gb_s": round(gb / ms * 1e3, 1)}
        row["speedup"] = round(row["twin"]["ms_per_step"] / row["kernel"]["ms_per_step"], 2)
        row["max_abs_diff"] = (outs["kernel"].float() - outs["twin"].float()).abs().max().item()
        result["batches"][spec] = row
        print(f"{spec:>8}: kernel {row['kernel']['ms_per_step']:8.2f} ms ({row['kernel']['kv_gb_s']:5.1f} GB/s), "
              f"twin {row['twin']['ms_per_step']:8.2f} ms ({row['twin']['kv_gb_s']:5.1f} GB/s): "
              f"{row['speedup']}x")
    result["load_after"] = load_average()
    print(f"load before {result['load_before']}, after {result['load_after']}")
    suffix = (f"-{args.kv_cache_dtype}-cache" if args.kv_cache_dtype else "") + ("-hot" if args.hot else "")
    write_json(result, args.out or f"benchmarks/results/decode_attention-{args.dtype}{suffix}.json")


if __name__ == "__main__":
    main()
