"""The skinny CPU linear kernel (engine/model/cpu_linear.py) against torch's
F.linear, on every weight of SmolLM2-135M's 30 layers plus its LM head, as
a decode step reads them: the weights are far bigger than the caches, so
each call streams its weight from memory, as in the engine.

For each row count M (token rows of the step), both paths run over the
whole model interleaved, round by round; each figure is the median of the
rounds, in milliseconds per step, with the kernel's speedup. Where torch's
GEMM wins again depends on the host (cpu_linear.row_limit measures it when
the engine first starts on a host, and later starts read what it kept); the
JSON also records that limit. LORAGW_CPU_CALIBRATION_CACHE=0 measures it in
this run instead.

    python benchmarks/linear_kernel.py [--rows 1 2 4 8 16 32 64 128 512 1024] [--dtype float32]
        [--threads N] [--rounds 7] [--out PATH]
"""

from __future__ import annotations

import os

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")  # as the other CPU benchmarks; see throughput.py

import argparse
import statistics
import time

import torch
import torch.nn.functional as F
from machine import load_average, machine_facts, write_json

HIDDEN, INTERMEDIATE, QKV, VOCAB, LAYERS = 576, 1536, 960, 49152, 30


def model_weights(dtype: torch.dtype) -> list[torch.Tensor]:
    shapes = [(QKV, HIDDEN), (HIDDEN, HIDDEN), (2 * INTERMEDIATE, HIDDEN), (HIDDEN, INTERMEDIATE)] * LAYERS
    return [torch.randn(*s, dtype=dtype) * s[1] ** -0.5 for s in shapes + [(VOCAB, HIDDEN)]]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rows", type=int, nargs="+", default=[1, 2, 4, 8, 16, 32, 64, 128, 512, 1024])
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--out", default="benchmarks/results/linear_kernel.json")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    from engine.model import cpu_linear

    kernel = cpu_linear.load_kernel()
    if kernel is None:
        raise SystemExit("the CPU linear kernel cannot be built here")
    dtype = getattr(torch, args.dtype)
    weights = model_weights(dtype)
    inputs = {w.shape[1]: None for w in weights}
    result: dict = {"args": vars(args), "machine": machine_facts(), "load_before": load_average(),
                    "weights_mb": round(sum(w.numel() * w.element_size() for w in weights) / 1e6), "rows": {}}

    def step_torch(xs) -> None:
        for w in weights:
            F.linear(xs[w.shape[1]], w)

    def step_kernel(xs) -> None:
        for w in weights:
            out = torch.empty(xs[w.shape[1]].shape[0], w.shape[0], dtype=dtype)
            kernel.skinny_linear(xs[w.shape[1]], w, None, out)

    for m in args.rows:
        xs = {k: torch.randn(m, k, dtype=dtype) for k in inputs}
        ref, got = F.linear(xs[HIDDEN], weights[0]), torch.empty(m, QKV, dtype=dtype)
        assert kernel.skinny_linear(xs[HIDDEN], weights[0], None, got)
        torch.testing.assert_close(got.float(), ref.float(), atol=1e-3, rtol=1e-3)
        times: dict[str, list[float]] = {"torch": [], "kernel": []}
        for _ in range(args.rounds):
            for name, fn in (("torch", step_torch), ("kernel", step_kernel)):
                t0 = time.perf_counter()
                fn(xs)
                times[name].append((time.perf_counter() - t0) * 1e3)
        row = {f"{name}_ms": round(statistics.median(ts), 2) for name, ts in times.items()}
        row["speedup"] = round(row["torch_ms"] / row["kernel_ms"], 2)
        row["kernel_gb_s"] = round(result["weights_mb"] / row["kernel_ms"], 1)
        result["rows"][m] = row
        print(f"M={m}: " + "  ".join(f"{k}={v}" for k, v in row.items()), flush=True)
    result["row_limit"] = cpu_linear.row_limit(dtype, torch.get_num_threads())
    result["load_after"] = load_average()
    write_json(result, args.out)


if __name__ == "__main__":
    main()
