"""The C++ CPU LoRA kernel (`CpuLoraOps.apply`) against the naive per-token
reference, and against its torch twin; plus the ways it steps aside.

`apply` is a whole packed projection: the shrink over the stacked A of its
slices, then each slice's expand into its columns of the output.
"""

from __future__ import annotations

import pytest
import torch

from adapters.ops import build_sgmv_meta
from adapters.ops import cpu_ops
from adapters.ops.cpu_ops import CpuLoraOps
from adapters.ops.torch_ops import TorchLoraOps
from tests.adapters.ops.naive import naive_expand, naive_shrink, per_token_slots
from tests.adapters.ops.test_sgmv import BATCHES, HIDDEN, INTERMEDIATE, KV_WIDTH, TOLERANCE, make_stack
from tests.native import built_or_skip, recording, torch_threads

PACKED = {  # SmolLM2-135M's packed projections: H_in, the slices' widths
    "qkv": (HIDDEN, [HIDDEN, KV_WIDTH, KV_WIDTH]),
    "o": (HIDDEN, [HIDDEN]),
    "gate_up": (HIDDEN, [INTERMEDIATE, INTERMEDIATE]),
    "down": (INTERMEDIATE, [HIDDEN]),
}


@pytest.fixture(scope="module")
def kernel():
    return built_or_skip(cpu_ops.load_kernel, "CPU LoRA kernel")


def run_apply(ops, h_in: int, widths: list[int], ranks: list[int], max_rank: int, batch, dtype, seed: int,
              extra: int = 24):
    """Applies one packed projection to a non-zero output `extra` columns
    wider than its slices; returns (out, expected float64, before)."""
    gen = torch.Generator().manual_seed(seed)
    stacks = [make_stack(h_in, w, ranks, max_rank, dtype, gen, rank_major_b=True) for w in widths]
    offsets = [sum(widths[:i]) for i in range(len(widths))]
    counts, slots = [c for c, _ in batch], [s for _, s in batch]
    meta, token_slots = build_sgmv_meta(counts, slots, "cpu"), per_token_slots(counts, slots)
    x = torch.randn(meta.num_tokens, h_in, generator=gen).to(dtype)
    before = torch.randn(meta.num_tokens, sum(widths) + extra, generator=gen).to(dtype)
    out = before.clone()
    ops.apply(x, torch.cat([s.lora_a for s in stacks], dim=1), [s.lora_b for s in stacks], meta, out, offsets)
    expected = before.double()
    for stack, offset, width in zip(stacks, offsets, widths):
        y = naive_shrink(x, stack.a, token_slots, max_rank)
        expected[:, offset : offset + width] += naive_expand(y, stack.b, token_slots, width)
    return out, expected, before, token_slots


@pytest.mark.parametrize("batch", list(BATCHES))
def test_batch_layouts(kernel, batch):
    """Skewed segments (1x7, 7x1, 3x3), tokens without an adapter first, in
    the middle and last, decodes, a long segment, sparse and dense slots."""
    out, expected, before, token_slots = run_apply(
        CpuLoraOps(kernel), HIDDEN, [HIDDEN, KV_WIDTH], [16, 8, 16] + [8, 16] * 4, 16, BATCHES[batch],
        torch.float32, seed=1)
    torch.testing.assert_close(out.double(), expected, atol=2e-5, rtol=1e-5)
    base_rows = [t for t, slot in enumerate(token_slots) if slot is None]
    assert torch.equal(out[base_rows], before[base_rows]), "a token without an adapter was touched"
    assert torch.equal(out[:, -24:], before[:, -24:]), "columns right of the slices were touched"


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("packed", list(PACKED))
def test_smollm2_projections(kernel, packed, dtype):
    h_in, widths = PACKED[packed]
    out, expected, _, _ = run_apply(CpuLoraOps(kernel), h_in, widths, [8, 16, 8], 16,
                                    BATCHES["short_and_long"], dtype, seed=2)
    atol, rtol = TOLERANCE[dtype]
    torch.testing.assert_close(out.double(), expected, atol=atol, rtol=rtol)


@pytest.mark.parametrize(
    "ranks,max_rank",
    [([8, 8, 8], 8), ([16, 16, 16], 16), ([64, 64, 64], 64), ([8, 64, 16], 64), ([5, 3, 7], 7)],
    ids=["r8", "r16", "r64", "mixed_in_64", "odd_ranks"],
)
def test_ranks_and_padding(kernel, ranks, max_rank):
    """Rank rows past a multiple of the 4-row tile (odd ranks) and zero
    padding up to the stack's rank contribute exactly their own product."""
    out, expected, _, _ = run_apply(CpuLoraOps(kernel), HIDDEN, [KV_WIDTH, KV_WIDTH], ranks, max_rank,
                                    BATCHES["three_of_3"], torch.float32, seed=4)
    torch.testing.assert_close(out.double(), expected, atol=2e-5, rtol=1e-5)


def test_widths_off_the_vector_grid(kernel):
    """Neither H_in nor the slice widths a multiple of 16: the tails take the scalar loops."""
    out, expected, _, _ = run_apply(CpuLoraOps(kernel), 100, [150, 37], [12, 5, 9], 12,
                                    BATCHES["short_and_long"], torch.float32, seed=9, extra=5)
    torch.testing.assert_close(out.double(), expected, atol=2e-5, rtol=1e-5)


@pytest.mark.parametrize("parallel_tokens", [0, 1_000], ids=["parallel", "serial"])
@pytest.mark.parametrize("threads", [1, 2])
def test_matches_the_torch_twin_on_a_step_of_many_adapters(kernel, threads, parallel_tokens):
    """32 adapters: a decode each, a few prefill chunks (past one 16-token
    work item), base tokens between; the kernel and the twin agree, whether
    the 93 tokens are split across threads or kept on the calling one."""
    batch = [(1, s) for s in range(32)] + [(40, 3), (3, None), (17, 30), (1, None)]
    cpu_ops = CpuLoraOps(kernel)
    cpu_ops.parallel_tokens = parallel_tokens
    with torch_threads(threads):
        outs = [run_apply(ops, HIDDEN, [INTERMEDIATE, INTERMEDIATE], [8] * 32, 8, batch, torch.float32, seed=5)[0]
                for ops in (cpu_ops, TorchLoraOps())]
    torch.testing.assert_close(outs[0], outs[1], atol=1e-5, rtol=1e-5)


def test_a_batch_without_adapters_is_left_alone(kernel):
    out, _, before, _ = run_apply(CpuLoraOps(kernel), HIDDEN, [HIDDEN], [8, 8, 8], 8, BATCHES["all_base"],
                                  torch.float32, seed=6)
    assert torch.equal(out, before)


@pytest.mark.parametrize("case", ["supported", "b_not_rank_major", "float16", "x_rows_strided"])
def test_unsupported_tensors_take_the_torch_twin(kernel, case):
    ops = CpuLoraOps(recording(kernel, "lora_apply"))
    gen = torch.Generator().manual_seed(7)
    dtype = torch.float16 if case == "float16" else torch.float32
    stack = make_stack(HIDDEN, KV_WIDTH, [8, 16, 8], 16, dtype, gen, rank_major_b=case != "b_not_rank_major")
    meta = build_sgmv_meta([2, 1], [0, 2], "cpu")
    x = torch.randn(3, HIDDEN, generator=gen).to(dtype)
    if case == "x_rows_strided":  # every other column: no longer one contiguous run per row
        x = torch.randn(3, 2 * HIDDEN, generator=gen)[:, ::2]
    out = torch.zeros(3, KV_WIDTH, dtype=dtype)
    ops.apply(x, stack.lora_a, [stack.lora_b], meta, out, [0])
    assert ops.kernel.handled == [case == "supported"]
    expected = naive_expand(naive_shrink(x, stack.a, [0, 0, 2], 16), stack.b, [0, 0, 2], KV_WIDTH)
    atol, rtol = TOLERANCE[dtype]
    torch.testing.assert_close(out.double(), expected, atol=atol, rtol=rtol)


@pytest.mark.parametrize("case,message", [
    ("offset_past_out", "overflows out"),
    ("slot_past_stack", "past the stack"),
    ("segment_past_batch", "outside the batch"),
    ("rank_mismatch", "slices of rank"),
])
def test_a_broken_contract_raises(kernel, case, message):
    """Arguments no caller should pass are an error, never a write out of bounds."""
    gen = torch.Generator().manual_seed(10)
    stack = make_stack(HIDDEN, KV_WIDTH, [8, 8], 8, torch.float32, gen, rank_major_b=True)
    lora_a, lora_b, offset = stack.lora_a, stack.lora_b, 0
    meta = build_sgmv_meta([2, 1], [0, 1], "cpu")
    x, out = torch.randn(3, HIDDEN), torch.zeros(3, KV_WIDTH)
    if case == "offset_past_out":
        offset = 1
    elif case == "slot_past_stack":
        meta = build_sgmv_meta([2, 1], [0, 2], "cpu")
    elif case == "segment_past_batch":
        x, out = x[:2], out[:2]
    else:
        lora_a = torch.cat([lora_a, lora_a], dim=1)
    with pytest.raises(RuntimeError, match=message):
        CpuLoraOps(kernel).apply(x, lora_a, [lora_b], meta, out, [offset])


def test_switched_off_by_environment(monkeypatch):
    monkeypatch.setenv(cpu_ops.ENV_SWITCH, "0")
    assert cpu_ops.load_kernel() is None
    assert CpuLoraOps().kernel is None


def test_a_failed_build_falls_back_to_the_twin(no_compiler, monkeypatch, caplog):
    assert cpu_ops._KERNEL.build() is None
    assert "CPU LoRA kernel unavailable" in caplog.text

    monkeypatch.setattr(cpu_ops, "load_kernel", lambda: None)
    out, expected, _, _ = run_apply(CpuLoraOps(), HIDDEN, [HIDDEN], [8, 8, 8], 8, BATCHES["decode"],
                                    torch.float32, seed=8)
    torch.testing.assert_close(out.double(), expected, atol=2e-5, rtol=1e-5)
