"""Time the Triton paged-attention kernel against the torch backend.

Shapes are SmolLM2-135M's attention (9 query heads, 3 KV heads, head_dim 64,
block size 16), at two points of a serving step:

  decode   64 sequences, one new token each, context 512
  prefill  one 512-token chunk over a 1024-token cached prefix

Both backends run in the same process on the same inputs; each time covers
a whole `forward` (the K/V cache write plus attention). The Triton side
needs a CUDA GPU; elsewhere only the torch backend is timed.

    python benchmarks/attention_kernel.py [--dtype bfloat16] [--out PATH]
"""

from __future__ import annotations

import argparse
import platform
import statistics
import time
from dataclasses import dataclass

import torch
from machine import write_json

from engine.attention.base import AttentionBackend, AttentionMetadata

NUM_HEADS, NUM_KV_HEADS, HEAD_DIM, BLOCK_SIZE = 9, 3, 64, 16
SHAPES = {  # name: (num_seqs, context already cached, new tokens per sequence)
    "decode_b64_ctx512": (64, 511, 1),
    "prefill_512_over_1024": (1, 1024, 512),
}


@dataclass
class Inputs:
    query: torch.Tensor  # [T, NUM_HEADS, HEAD_DIM]
    key: torch.Tensor  # [T, NUM_KV_HEADS, HEAD_DIM]
    value: torch.Tensor  # [T, NUM_KV_HEADS, HEAD_DIM]
    k_cache: torch.Tensor  # [num_blocks, BLOCK_SIZE, NUM_KV_HEADS, HEAD_DIM]
    v_cache: torch.Tensor
    meta: AttentionMetadata


def build_inputs(
    num_seqs: int, context_len: int, query_len: int, dtype: torch.dtype, device: torch.device
) -> Inputs:
    """A batch over a shuffled block pool, so block tables are not contiguous."""
    seq_len = context_len + query_len
    blocks_per_seq = -(-seq_len // BLOCK_SIZE)
    num_blocks = num_seqs * blocks_per_seq + 16
    gen = torch.Generator().manual_seed(0)
    pool = torch.randperm(num_blocks, generator=gen)[: num_seqs * blocks_per_seq]
    block_tables = pool.view(num_seqs, blocks_per_seq).to(torch.int32)
    positions = torch.arange(context_len, seq_len)
    slots = block_tables[:, positions // BLOCK_SIZE].long() * BLOCK_SIZE + positions % BLOCK_SIZE
    num_tokens = num_seqs * query_len

    def randn(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=gen).to(dtype=dtype, device=device)

    meta = AttentionMetadata(
        slot_mapping=slots.reshape(-1).to(device),
        query_start_loc=(torch.arange(num_seqs + 1, dtype=torch.int32) * query_len).to(device),
        seq_lens=torch.full((num_seqs,), seq_len, dtype=torch.int32, device=device),
        block_tables=block_tables.to(device),
        query_lens_host=[query_len] * num_seqs,
        seq_lens_host=[seq_len] * num_seqs,
        block_size=BLOCK_SIZE,
    )
    return Inputs(
        query=randn(num_tokens, NUM_HEADS, HEAD_DIM),
        key=randn(num_tokens, NUM_KV_HEADS, HEAD_DIM),
        value=randn(num_tokens, NUM_KV_HEADS, HEAD_DIM),
        k_cache=randn(num_blocks, BLOCK_SIZE, NUM_KV_HEADS, HEAD_DIM),
        v_cache=randn(num_blocks, BLOCK_SIZE, NUM_KV_HEADS, HEAD_DIM),
        meta=meta,
    )


def time_forward(backend: AttentionBackend, x: Inputs, warmup: int, iters: int) -> tuple[float, torch.Tensor]:
    """Median milliseconds of one `forward`, and its output."""
    scale = HEAD_DIM**-0.5
    backend.prepare(x.meta)

    def step() -> torch.Tensor:
        return backend.forward(x.query, x.key, x.value, x.k_cache, x.v_cache, x.meta, scale)

    for _ in range(warmup):
        out = step()
    times = []
    cuda = x.query.is_cuda
    for _ in range(iters):
        if cuda:
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            out = step()
            end.record()
            torch.cuda.synchronize()
            times.append(start.elapsed_time(end))
        else:
            t0 = time.perf_counter()
            out = step()
            times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times), out


def kv_bytes_read(num_seqs: int, context_len: int, query_len: int, dtype: torch.dtype) -> int:
    """K and V bytes a kernel must read at least once: every cached position."""
    element = torch.empty((), dtype=dtype).element_size()
    return 2 * num_seqs * (context_len + query_len) * NUM_KV_HEADS * HEAD_DIM * element


def get_backends(device: torch.device) -> dict[str, AttentionBackend]:
    from engine.attention import get_attention_backend

    backends = {"torch": get_attention_backend("torch", device)}
    if device.type == "cuda":
        backends["triton"] = get_attention_backend("triton", device)
    return backends


def run(dtype: torch.dtype, warmup: int, iters: int) -> dict:
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if device.type != "cuda":
        print("no CUDA device: the Triton kernel needs a GPU to be timed; timing the torch backend only")
    backends = get_backends(device)
    result = {
        "device": torch.cuda.get_device_name() if device.type == "cuda" else platform.processor() or "cpu",
        "dtype": str(dtype).removeprefix("torch."),
        "torch": torch.__version__,
        "model_shape": {
            "num_heads": NUM_HEADS,
            "num_kv_heads": NUM_KV_HEADS,
            "head_dim": HEAD_DIM,
            "block_size": BLOCK_SIZE,
        },
        "cases": {},
    }
    for name, (num_seqs, context_len, query_len) in SHAPES.items():
        x = build_inputs(num_seqs, context_len, query_len, dtype, device)
        case = {"num_seqs": num_seqs, "context_len": context_len, "query_len": query_len}
        outputs = {}
        for backend_name, backend in backends.items():
            ms, outputs[backend_name] = time_forward(backend, x, warmup, iters)
            case[f"{backend_name}_ms"] = round(ms, 4)
            gbps = kv_bytes_read(num_seqs, context_len, query_len, dtype) / (ms * 1e-3) / 1e9
            case[f"{backend_name}_kv_gb_per_s"] = float(f"{gbps:.3g}")
        if "triton" in outputs:
            case["speedup_triton_over_torch"] = round(case["torch_ms"] / case["triton_ms"], 2)
            diff = (outputs["triton"].float() - outputs["torch"].float()).abs().max().item()
            case["max_abs_diff_triton_vs_torch"] = diff
        result["cases"][name] = case
        line = "  ".join(f"{k}={v}" for k, v in case.items())
        print(f"{name}: {line}")
    return result


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--out", default="benchmarks/results/attention_kernel.json")
    parser.add_argument("--dtype", default="bfloat16", choices=["float32", "bfloat16", "float16"])
    parser.add_argument("--warmup", type=int, default=10)
    parser.add_argument("--iters", type=int, default=50)
    args = parser.parse_args()
    result = run(getattr(torch, args.dtype), args.warmup, args.iters)
    write_json(result, args.out)


if __name__ == "__main__":
    main()
