"""Weight-only quantized linears on the CPU, against our float skinny kernel.

Which int8 / int4 path to use for decode is decided here, on SmolLM2-135M's
shapes: for each weight shape, each row count and each path, the time of one
call, streaming the weight from memory as a decode step does (30 copies of
each per-layer shape, one per layer; the LM head alone is 113 MB), the best
of `--rounds` interleaved rounds (the best is the least disturbed on a
shared host). Paths:

  float_kernel   our float skinny kernel (engine/model/cpu_linear.py): the baseline
  float_torch    F.linear on the float weight (MKL in float32, oneDNN in bfloat16)
  float_packed   oneDNN's linear on its packed copy of the weight
                 (cpu_linear.pack), the engine's torch path where packing
                 pays, in float32 as in bfloat16
  int8_ours      engine/csrc/quant_linear.cpp, int8 per channel
  int8_torch     torch._weight_int8pack_mm (the CPU int8 weight-only op)
  int8_torchao   torchao Int8WeightOnlyConfig on an nn.Linear
  int4_ours      engine/csrc/quant_linear.cpp, Q4_1 (group 32, d and m)
  int4_rows      the same without the copy of the rows interleaved 8 at a time
                 that its float32 calls read on an AVX2 build: the path a
                 weight whose rows are not a multiple of 8 takes there, and
                 every Q4_1 weight did before the copy
  q8_0_ours      the same file, Q8_0 (group 32, d): the LM head's GGUF format
  int4_act8      float32 on an AVX2 build: Q4_1 with the activations rounded
                 to int8 per block of 32 (the engine's int8 activations)
  q8_0_act8      the same for Q8_0
  int4_torchao   torchao's CPU int4 (PrototypeInt4WeightOnlyConfig, group 32:
                 torch._weight_int4pack_mm_for_cpu)
  int4_twin      our torch twin: dequantize for the call, then F.linear
  int4_baseline  with --baseline-source: Q4_1 (and q8_0_baseline, Q8_0) on
                 another quant_linear.cpp, an older commit's say, built
                 beside the current one (with the current shared headers,
                 called through the current Python wrappers: a source with
                 other bindings shows as "fails") and timed in the same
                 rounds; each row says whether its outputs equal int4_ours'
                 (q8_0_ours') bit for bit

Figures are microseconds per call. torchao is optional (pip install
torchao==0.18.0 --no-deps); its paths are skipped without it.

    python benchmarks/quant_linear.py [--rows 1 4 16 64] [--dtype float32] [--rounds 7]
        [--paths int4_ours int4_rows] [--baseline-source OLD.cpp] [--out PATH]

A change to the kernel, before and after in one process (the older
source under its own name, quant_linear.cpp, with its headers,
quant_linear_*.h, beside it; a commit from before those headers has the
whole kernel in the .cpp):

    rm -rf /tmp/old && mkdir -p /tmp/old && git archive HEAD~1 engine/csrc | tar -x -C /tmp/old
    python benchmarks/quant_linear.py --baseline-source /tmp/old/engine/csrc/quant_linear.cpp \
        --paths int4_ours int4_baseline
"""

from __future__ import annotations

import os

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")  # as the other CPU benchmarks; see throughput.py

import argparse
import dataclasses
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from machine import load_average, machine_facts, write_json

HIDDEN, INTERMEDIATE, KV, VOCAB, LAYERS = 576, 1536, 192, 49152, 30
SHAPES = {"q/o 576x576": (HIDDEN, HIDDEN), "k/v 192x576": (KV, HIDDEN), "gate 1536x576": (INTERMEDIATE, HIDDEN),
          "down 576x1536": (HIDDEN, INTERMEDIATE), "lm_head 49152x576": (VOCAB, HIDDEN)}


def torchao_linears(weights: list[torch.Tensor], dtype: torch.dtype) -> dict[str, list]:
    """name -> quantized nn.Linear per weight, for the torchao paths that build here."""
    try:
        from torchao.prototype.quantization.int4 import PrototypeInt4WeightOnlyConfig
        from torchao.quantization import Int8WeightOnlyConfig, quantize_
    except ImportError:
        return {}
    found = {}
    for name, config in (("int8_torchao", Int8WeightOnlyConfig()),
                         ("int4_torchao", PrototypeInt4WeightOnlyConfig(group_size=32, set_inductor_config=False))):
        mods = []
        for w in weights:
            lin = torch.nn.Linear(w.shape[1], w.shape[0], bias=False, dtype=dtype)
            lin.weight.data = w.clone()
            quantize_(lin, config)
            mods.append(lin)
        found[name] = mods
    return found


def baseline_kernel(source: Path):
    """`source` built as an extension of its own, beside the current kernel."""
    import native
    from engine.model import cpu_linear

    kernel = native.Kernel("loragw_quant_linear_baseline", source.resolve(), "baseline quantized linear kernel",
                           cpu_linear.ENV_SWITCH).load()
    if kernel is None:
        raise SystemExit(f"--baseline-source: {source} did not build (the log above says why), "
                         "or the kernels are switched off")
    return kernel


def paths_for(weights: list[torch.Tensor], dtype: torch.dtype, baseline=None) -> dict:
    """name -> fn(x, i) computing x @ weights[i]^T on that path; `baseline`,
    another build of the quantized kernel, adds its Q4_1 and Q8_0 paths."""
    from engine.model import cpu_linear, quant_linear

    fk, qk = cpu_linear.load_kernel(), quant_linear.load_kernel()
    i8 = [quant_linear.quantize_int8(w) for w in weights]
    q4 = [quant_linear.quantize_q4_1(w) for w in weights]
    q8 = [quant_linear.quantize(w, "q8_0") for w in weights]

    def kernel_call(fn):
        def run(x, i):
            out = torch.empty(x.shape[0], weights[i].shape[0], dtype=dtype)
            assert fn(x, i, out)
            return out
        return run

    paths = {
        "float_kernel": kernel_call(lambda x, i, out: fk.skinny_linear(x, weights[i], None, out)),
        "float_torch": lambda x, i: F.linear(x, weights[i]),
        "int8_ours": kernel_call(lambda x, i, out: i8[i].run_kernel(qk, x, None, out)),
        "int8_torch": lambda x, i: torch._weight_int8pack_mm(x, i8[i].q, i8[i].scale.to(dtype)),
        "int4_ours": kernel_call(lambda x, i, out: q4[i].run_kernel(qk, x, None, out)),
        "q8_0_ours": kernel_call(lambda x, i, out: q8[i].run_kernel(qk, x, None, out)),
        "int4_twin": lambda x, i: quant_linear.twin(x, q4[i]),
    }
    if dtype == torch.float32 and qk.q4_1_interleaves():
        q4r = [dataclasses.replace(w) for w in q4]  # replace starts without a copy
        for w in q4r:
            w.interleaved_copy = []  # [] is "none to read"; None would make one
        paths["int4_rows"] = kernel_call(lambda x, i, out: q4r[i].run_kernel(qk, x, None, out))
    if dtype == torch.float32 and qk.int8_activations_built():
        q4a = [dataclasses.replace(w, int8_activations=True) for w in q4]
        q8a = [dataclasses.replace(w, int8_activations=True) for w in q8]
        paths["int4_act8"] = kernel_call(lambda x, i, out: q4a[i].run_kernel(qk, x, None, out))
        paths["q8_0_act8"] = kernel_call(lambda x, i, out: q8a[i].run_kernel(qk, x, None, out))
    if baseline is not None:
        # Weights of their own: each build makes its own interleaved copy.
        q4b, q8b = [dataclasses.replace(w) for w in q4], [dataclasses.replace(w) for w in q8]
        paths["int4_baseline"] = kernel_call(lambda x, i, out: q4b[i].run_kernel(baseline, x, None, out))
        paths["q8_0_baseline"] = kernel_call(lambda x, i, out: q8b[i].run_kernel(baseline, x, None, out))
    if torch.backends.mkldnn.is_available():
        packed = [cpu_linear.packed_copy(w) for w in weights]
        paths["float_packed"] = lambda x, i: cpu_linear.linear(None, x, weights[i], None, packed[i])
    for name, mods in torchao_linears(weights, dtype).items():
        paths[name] = lambda x, i, mods=mods: mods[i](x)
    return paths


def time_shape(paths: dict, n_weights: int, k: int, rows: int, dtype, rounds: int) -> dict[str, float | bool | str]:
    """path -> best microseconds per call over the rounds (each round runs
    every path once over all the shape's weights, paths interleaved, the
    order rotated a place each round), or
    why it failed; `int4_same_bits` and `q8_0_same_bits` where both builds
    of that format ran."""
    x = torch.randn(rows, k, dtype=dtype)
    ref = paths["float_torch"](x, 0).float()
    best, outputs = {}, {}
    for name, fn in paths.items():
        try:
            got = outputs[name] = fn(x, 0).float()
        except Exception as exc:  # noqa: BLE001 - a library path that does not run here is a finding
            best[name] = f"fails: {type(exc).__name__}: {str(exc)[:120]}"
            continue
        err = ((got - ref).norm() / ref.norm()).item()
        assert err < 0.1, f"{name} disagrees with F.linear by {err:.3f} (relative)"
        best[name] = float("inf")
    live = [name for name, v in best.items() if v == float("inf")]
    for fmt in ("int4", "q8_0"):
        ours, base = outputs.get(f"{fmt}_ours"), outputs.get(f"{fmt}_baseline")
        if ours is not None and base is not None:
            best[f"{fmt}_same_bits"] = torch.equal(ours, base)
    for r in range(rounds):
        # Each round starts one path further on, so that no path always runs
        # in the same place: with the order fixed, the build in the
        # baseline's place ran code both builds share up to 13% faster
        # (docs/engine.md, "The panel on AVX-512").
        for name in live[r % len(live):] + live[:r % len(live)]:
            fn = paths[name]
            t0 = time.perf_counter()
            for i in range(n_weights):
                fn(x, i)
            best[name] = min(best[name], (time.perf_counter() - t0) / n_weights * 1e6)
    return {name: round(v, 1) if isinstance(v, float) else v for name, v in best.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rows", type=int, nargs="+", default=[1, 4, 16, 64])
    parser.add_argument("--prefill-rows", type=int, nargs="*", default=[256, 1024],
                        help="longer chunks, on the gate shape only")
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--paths", nargs="+", default=None,
                        help="time these paths only (float_torch, the reference, always runs)")
    parser.add_argument("--baseline-source", default=None,
                        help="another quant_linear.cpp to time beside this one (int4_baseline, q8_0_baseline)")
    parser.add_argument("--out", default="benchmarks/results/quant_linear.json")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    dtype = getattr(torch, args.dtype)
    result: dict = {"args": vars(args), "machine": machine_facts(), "load_before": load_average(),
                    "unit": "us per call, best of rounds", "shapes": {}}
    from engine.model import quant_linear

    kernel = quant_linear.load_kernel()
    if kernel is not None:  # the row count at which float32 Q4_1 calls leave the tiles for the panel here
        result["machine"]["q4_1_panel_min_rows"] = kernel.q4_1_panel_min_rows()
    baseline = baseline_kernel(Path(args.baseline_source)) if args.baseline_source else None
    gen = torch.Generator().manual_seed(0)
    for label, (n, k) in SHAPES.items():
        copies = 1 if n == VOCAB else LAYERS
        weights = [(torch.randn(n, k, generator=gen) * k**-0.5).to(dtype) for _ in range(copies)]
        paths = paths_for(weights, dtype, baseline)
        if args.paths:
            unknown = set(args.paths) - set(paths)
            if unknown:  # a misspelt path, or one this host does not have (int4_rows without the copy)
                parser.error(f"--paths: no {', '.join(sorted(unknown))} here; the paths are {', '.join(paths)}")
            paths = {name: fn for name, fn in paths.items() if name in args.paths or name == "float_torch"}
        rows_list = args.rows + (args.prefill_rows if label.startswith("gate") else [])
        result["shapes"][label] = {}
        for rows in rows_list:
            row = time_shape(paths, copies, k, rows, dtype, args.rounds)
            result["shapes"][label][rows] = row
            print(f"{label} M={rows}: " + "  ".join(f"{p}={v}" for p, v in row.items()), flush=True)
    result["load_after"] = load_average()
    write_json(result, args.out)


if __name__ == "__main__":
    main()
