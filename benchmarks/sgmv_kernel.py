"""Time the SGMV LoRA ops against a dense per-token-gather baseline.

Shapes are one SmolLM2-135M layer's LoRA projections (hidden 576, 9 heads x
64, 3 KV heads x 64, intermediate 1536), grouped as the model fuses them:

  qkv      576 -> 576 | 192 | 192   (one 960-wide output)
  o        576 -> 576
  gate_up  576 -> 1536 | 1536       (one 3072-wide output)
  down     1536 -> 576

Batches (every segment has its own slot, as after the runner's sort):

  mixed_256x32   256 tokens in 32 segments of 8 (prefill chunks and decodes)
  decode_32x32   32 tokens, one per segment

Variants of each group, all adding the LoRA delta into the group's output:

  gather        the baseline: gather every token's A and B, two batched
                matmuls (what a naive per-token LoRA does)
  sgmv          one shrink + one expand per projection
  sgmv_fused    one shrink over the group's stacked A, then `expand_slices`
  fused_blockdiag  (torch only) one shrink over the stacked A, then one
                expand over a block-diagonal B built ahead: a single matmul
                per segment, at n times the B memory

The torch twin is always timed; the Triton kernels need a CUDA GPU and are
timed only there, the C++ CPU kernel (`cpu`, whose calls are each a whole
projection) only without one. All variants run in the same process, on the same
inputs, interleaved round by round (so a noisy neighbour hits them alike);
each number is the median of the rounds.

    python benchmarks/sgmv_kernel.py [--dtype float32] [--ranks 8 64] [--threads 1] [--out PATH]
"""

from __future__ import annotations

import argparse
import platform
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch
from machine import write_json

from adapters.ops import LoraOps, SGMVMeta, build_sgmv_meta, get_lora_ops
from engine.builder import resolve_dtype

HIDDEN, KV_WIDTH, INTERMEDIATE = 576, 192, 1536
GROUPS = {  # name: (H_in, widths of the fused output's slices)
    "qkv": (HIDDEN, (HIDDEN, KV_WIDTH, KV_WIDTH)),
    "o": (HIDDEN, (HIDDEN,)),
    "gate_up": (HIDDEN, (INTERMEDIATE, INTERMEDIATE)),
    "down": (INTERMEDIATE, (HIDDEN,)),
}
BATCHES = {"mixed_256x32": (32, 8), "decode_32x32": (32, 1)}  # (segments, tokens per segment)


@dataclass
class Group:
    x: torch.Tensor  # [T, H_in]
    out: torch.Tensor  # [T, sum(widths)]
    lora_a: list[torch.Tensor]  # per slice [num_slots, R, H_in]
    lora_b: list[torch.Tensor]  # per slice [num_slots, H_out_i, R]
    lora_a_stacked: torch.Tensor  # [num_slots, n * R, H_in]
    lora_b_blockdiag: torch.Tensor  # [num_slots, sum(widths), n * R]
    offsets: list[int]
    token_slots: torch.Tensor  # [T] int64, for the gather baseline


def build_group(h_in, widths, rank, meta, token_slots, dtype, device, gen) -> Group:
    num_slots = max(meta.seg_slots_host) + 1

    def randn(*shape: int, scale: float) -> torch.Tensor:
        return (torch.randn(*shape, generator=gen) * scale).to(dtype=dtype, device=device)

    lora_a = [randn(num_slots, rank, h_in, scale=h_in**-0.5) for _ in widths]
    lora_b = [randn(num_slots, w, rank, scale=rank**-0.5) for w in widths]
    offsets = [sum(widths[:i]) for i in range(len(widths))]
    blockdiag = torch.zeros(num_slots, sum(widths), len(widths) * rank, dtype=dtype, device=device)
    for i, (b, off) in enumerate(zip(lora_b, offsets)):
        blockdiag[:, off : off + b.shape[1], i * rank : (i + 1) * rank] = b
    return Group(
        x=randn(meta.num_tokens, h_in, scale=1.0),
        out=torch.zeros(meta.num_tokens, sum(widths), dtype=dtype, device=device),
        lora_a=lora_a,
        lora_b=lora_b,
        lora_a_stacked=torch.cat(lora_a, dim=1).contiguous(),
        lora_b_blockdiag=blockdiag,
        offsets=offsets,
        token_slots=token_slots,
    )


def gather_baseline(g: Group) -> None:
    """Every token gathers its own A and B: [T, R, H] copies, two bmm."""
    x = g.x.unsqueeze(1)  # [T, 1, H_in]
    for a, b, off in zip(g.lora_a, g.lora_b, g.offsets):
        y = torch.bmm(x, a[g.token_slots].transpose(1, 2))  # [T, 1, R]
        delta = torch.bmm(y, b[g.token_slots].transpose(1, 2))  # [T, 1, H_out]
        g.out[:, off : off + b.shape[1]] += delta.squeeze(1)


def variants(ops: LoraOps, g: Group, meta: SGMVMeta, rank: int) -> dict[str, Callable[[], None]]:
    n = len(g.lora_a)
    y_one = torch.empty(meta.num_tokens, rank, dtype=g.x.dtype, device=g.x.device)
    y_all = torch.empty(meta.num_tokens, n * rank, dtype=g.x.dtype, device=g.x.device)

    def sgmv() -> None:
        for a, b, off in zip(g.lora_a, g.lora_b, g.offsets):
            ops.shrink(g.x, a, meta, y_one)
            ops.expand(y_one, b, meta, g.out, off)

    def fused() -> None:
        ops.shrink(g.x, g.lora_a_stacked, meta, y_all)
        ops.expand_slices(y_all, g.lora_b, meta, g.out, g.offsets)

    def blockdiag() -> None:
        ops.shrink(g.x, g.lora_a_stacked, meta, y_all)
        ops.expand(y_all, g.lora_b_blockdiag, meta, g.out, 0)

    if ops.rank_major_b:  # the CPU kernel: every call is a whole projection (`apply`)
        return _apply_variants(ops, g, meta, rank)
    found = {"sgmv": sgmv}
    if n > 1:
        found["sgmv_fused"] = fused
        if ops.name == "torch":
            found["fused_blockdiag"] = blockdiag
    return found


def _apply_variants(ops: LoraOps, g: Group, meta: SGMVMeta, rank: int) -> dict[str, Callable[[], None]]:
    """sgmv: one `apply` per slice; sgmv_fused: one over the stacked A."""
    lora_b = [b.transpose(1, 2).contiguous().transpose(1, 2) for b in g.lora_b]  # rank-major memory

    def sgmv() -> None:
        for a, b, off in zip(g.lora_a, lora_b, g.offsets):
            ops.apply(g.x, a, [b], meta, g.out, [off])

    def fused() -> None:
        ops.apply(g.x, g.lora_a_stacked, lora_b, meta, g.out, g.offsets)

    return {"sgmv": sgmv, "sgmv_fused": fused} if len(lora_b) > 1 else {"sgmv": sgmv}


def time_interleaved(fns: dict[str, Callable[[], None]], cuda: bool, warmup: int, rounds: int) -> dict[str, float]:
    """Median milliseconds of each function, timed round-robin."""
    for fn in fns.values():
        for _ in range(warmup):
            fn()
    if cuda:
        torch.cuda.synchronize()
    times: dict[str, list[float]] = {name: [] for name in fns}
    for _ in range(rounds):
        for name, fn in fns.items():
            if cuda:
                start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                start.record()
                fn()
                end.record()
                torch.cuda.synchronize()
                times[name].append(start.elapsed_time(end))
            else:
                t0 = time.perf_counter()
                fn()
                times[name].append((time.perf_counter() - t0) * 1e3)
    return {name: statistics.median(ts) for name, ts in times.items()}


def run_case(batch: str, rank: int, dtype, device, backends, warmup: int, rounds: int) -> dict:
    num_segments, seg_len = BATCHES[batch]
    meta = build_sgmv_meta([seg_len] * num_segments, list(range(num_segments)), device)
    token_slots = torch.arange(num_segments, device=device).repeat_interleave(seg_len)
    gen = torch.Generator().manual_seed(0)
    case: dict = {"num_tokens": meta.num_tokens, "num_segments": num_segments, "rank": rank, "groups": {}}
    totals: dict[str, float] = {}
    for group_name, (h_in, widths) in GROUPS.items():
        g = build_group(h_in, widths, rank, meta, token_slots, dtype, device, gen)
        fns = {"gather": lambda g=g: gather_baseline(g)}
        for backend_name, ops in backends.items():
            for name, fn in variants(ops, g, meta, rank).items():
                fns[f"{backend_name}_{name}"] = fn
        ms = time_interleaved(fns, device.type == "cuda", warmup, rounds)
        row = {f"{name}_ms": round(t, 4) for name, t in ms.items()}
        for name, t in ms.items():
            if name != "gather":
                row[f"speedup_{name}_over_gather"] = round(ms["gather"] / t, 2)
        for backend_name in backends:
            if f"{backend_name}_sgmv_fused" in ms:
                row[f"speedup_{backend_name}_fused_over_sgmv"] = round(
                    ms[f"{backend_name}_sgmv"] / ms[f"{backend_name}_sgmv_fused"], 2
                )
        case["groups"][group_name] = row
        print(f"  {batch} R={rank} {group_name}: " + "  ".join(f"{k}={v}" for k, v in row.items()))
        for name, t in ms.items():
            totals[name] = totals.get(name, 0.0) + t
    # A whole layer: groups without a fused variant count their plain sgmv.
    layer = {}
    for backend_name in backends:
        plain = sum(case["groups"][gn][f"{backend_name}_sgmv_ms"] for gn in GROUPS)
        best = sum(
            min(v for k, v in case["groups"][gn].items() if k.startswith(backend_name) and k.endswith("_ms"))
            for gn in GROUPS
        )
        layer[f"{backend_name}_sgmv_ms"] = round(plain, 4)
        layer[f"{backend_name}_best_ms"] = round(best, 4)
        layer[f"speedup_{backend_name}_best_over_gather"] = round(totals["gather"] / best, 2)
    layer["gather_ms"] = round(totals["gather"], 4)
    case["layer"] = layer
    print(f"  {batch} R={rank} layer: " + "  ".join(f"{k}={v}" for k, v in layer.items()))
    return case


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default="benchmarks/results/sgmv_kernel.json")
    parser.add_argument("--dtype", default=None, choices=["float32", "bfloat16", "float16"],
                        help="default: the engine's --dtype auto on this host")
    parser.add_argument("--ranks", type=int, nargs="+", default=[8, 64])
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--rounds", type=int, default=40)
    parser.add_argument("--threads", type=int, default=None,
                        help="torch CPU threads; 1 keeps a shared machine's neighbours from stalling parallel ops")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)

    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    dtype = getattr(torch, args.dtype) if args.dtype else resolve_dtype("auto", device)
    backends = {"torch": get_lora_ops("torch", device)}
    if device.type == "cuda":
        backends["triton"] = get_lora_ops("triton", device)
    else:
        backends["cpu"] = get_lora_ops("cpu", device)
        print("no CUDA device: the Triton kernels need a GPU to be timed; timing the torch twin and the CPU kernel")
    result = {
        "device": torch.cuda.get_device_name() if device.type == "cuda" else platform.processor() or "cpu",
        "torch_threads": torch.get_num_threads(),
        "dtype": str(dtype).removeprefix("torch."),
        "torch": torch.__version__,
        "rounds": args.rounds,
        "cases": {},
    }
    for batch in BATCHES:
        for rank in args.ranks:
            result["cases"][f"{batch}_r{rank}"] = run_case(
                batch, rank, dtype, device, backends, args.warmup, args.rounds
            )
    write_json(result, args.out)


if __name__ == "__main__":
    main()
