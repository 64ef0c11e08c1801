"""Both LoRA ops backends against the naive per-token reference.

Shapes are SmolLM2-135M's projections with few tokens, because the Triton
kernels run under the interpreter on a CPU-only machine (tests/conftest.py
sets TRITON_INTERPRET=1 before anything imports triton). With a GPU and no
interpreter, the same tests run the real kernels on CUDA tensors.
"""

from __future__ import annotations

from dataclasses import dataclass

import pytest
import torch

from adapters.errors import AdapterError
from adapters.ops import LoraOps, build_sgmv_meta, get_lora_ops
from tests.adapters.ops.naive import naive_expand, naive_shrink, per_token_slots
from tests.triton_env import KERNEL_DEVICE as DEVICE
from tests.triton_env import assert_runs_without_triton

BACKENDS = ["torch", "triton"]
TOLERANCE = {  # (atol, rtol) against the float64 reference, on values of order 1
    torch.float32: (2e-5, 1e-5),
    torch.bfloat16: (3e-2, 2e-2),
    torch.float16: (4e-3, 4e-3),
}
HIDDEN, KV_WIDTH, INTERMEDIATE = 576, 192, 1536  # SmolLM2-135M: 9 heads x 64, 3 KV heads x 64
MODULES = {  # name: (H_in, H_out)
    "q": (HIDDEN, HIDDEN),
    "k": (HIDDEN, KV_WIDTH),
    "v": (HIDDEN, KV_WIDTH),
    "o": (HIDDEN, HIDDEN),
    "gate": (HIDDEN, INTERMEDIATE),
    "up": (HIDDEN, INTERMEDIATE),
    "down": (INTERMEDIATE, HIDDEN),
}
BATCHES = {  # (new tokens, slot) per request in batch order; None = no adapter
    "skew_1x7": [(1, 0), (7, 1)],
    "skew_7x1": [(7, 2), (1, 0)],
    "three_of_3": [(3, 1), (3, 0), (3, 2)],
    "base_first": [(2, None), (3, 0), (2, 1)],
    "base_middle": [(3, 2), (2, None), (3, 1)],
    "base_last": [(3, 1), (2, 0), (2, None)],
    "all_base": [(3, None), (2, None)],
    "merged_runs": [(2, 1), (3, 1), (1, None), (2, 1), (0, 0), (1, 1)],
    "decode": [(1, 0), (1, 2), (1, None), (1, 1), (1, 0)],
    "long_segment": [(70, 1), (2, 0)],  # two row tiles of 64 in one segment
    # Short segments batched into one padded bmm beside long ones done alone.
    "short_and_long": [(1, 0), (3, 1), (40, 2), (1, None), (2, 0), (1, 1), (5, 2), (12, 1), (8, 0)],
    # One short segment per slot over most of a slot range: the torch twin
    # reads the stacks in place, slot 2 (only a long segment) a padding group.
    "dense_slots_with_gap": [(1, None), (2, 0), (1, 1), (20, 2), (3, 3), (1, 4), (2, None)],
    # Few slots spread wide: the torch twin gathers their stacks instead.
    "sparse_slots": [(1, 0), (2, 4), (1, None), (1, 7), (3, 9)],
}


def _ops(name: str) -> LoraOps:
    if name == "triton":
        pytest.importorskip("triton")
    return get_lora_ops(name, DEVICE)


@dataclass
class Stack:
    """One module's LoRA weights for every slot: the true per-slot matrices
    (what the reference uses) and the zero-padded stacks (what the ops use)."""

    a: dict[int, torch.Tensor]  # slot -> [r, H_in]
    b: dict[int, torch.Tensor]  # slot -> [H_out, r]
    lora_a: torch.Tensor  # [num_slots, R, H_in]
    lora_b: torch.Tensor  # [num_slots, H_out, R]


def make_stack(
    h_in: int, h_out: int, ranks: list[int], max_rank: int, dtype: torch.dtype, gen: torch.Generator,
    rank_major_b: bool = False,
) -> Stack:
    """Slot i has rank ranks[i]; values of order 1 after each product. With
    rank_major_b, B is the [num_slots, H_out, R] view of [num_slots, R, H_out]
    memory, as the slot manager stores it for the CPU kernel."""
    a, b = {}, {}
    lora_a = torch.zeros(len(ranks), max_rank, h_in, dtype=dtype)
    if rank_major_b:
        lora_b = torch.zeros(len(ranks), max_rank, h_out, dtype=dtype).transpose(1, 2)
    else:
        lora_b = torch.zeros(len(ranks), h_out, max_rank, dtype=dtype)
    for slot, r in enumerate(ranks):
        a[slot] = (torch.randn(r, h_in, generator=gen) / h_in**0.5).to(dtype)
        b[slot] = (torch.randn(h_out, r, generator=gen) / r**0.5).to(dtype)
        lora_a[slot, :r] = a[slot]
        lora_b[slot, :, :r] = b[slot]
    return Stack(a, b, lora_a.to(DEVICE), lora_b.to(DEVICE))


def _batch(name: str):
    counts = [c for c, _ in BATCHES[name]]
    slots = [s for _, s in BATCHES[name]]
    return build_sgmv_meta(counts, slots, DEVICE), per_token_slots(counts, slots)


def _randn(*shape: int, dtype: torch.dtype, gen: torch.Generator) -> torch.Tensor:
    return torch.randn(*shape, generator=gen).to(dtype=dtype, device=DEVICE)


def check_shrink(ops: LoraOps, stack: Stack, batch: str, dtype: torch.dtype, gen: torch.Generator) -> None:
    meta, token_slots = _batch(batch)
    h_in, rank = stack.lora_a.shape[2], stack.lora_a.shape[1]
    x = _randn(meta.num_tokens, h_in, dtype=dtype, gen=gen)
    # out is the left part of a wider buffer of stale values (NaN): shrink
    # must overwrite every row of it and write nothing to its right.
    buffer = torch.full((meta.num_tokens, rank + 8), float("nan"), dtype=dtype, device=DEVICE)
    out = buffer[:, :rank]
    ops.shrink(x, stack.lora_a, meta, out)
    expected = naive_shrink(x.cpu(), stack.a, token_slots, rank)
    atol, rtol = TOLERANCE[dtype]
    torch.testing.assert_close(out.cpu().double(), expected, atol=atol, rtol=rtol)
    assert buffer[:, rank:].isnan().all(), "shrink wrote right of its output"


def check_expand(
    ops: LoraOps,
    stack: Stack,
    batch: str,
    dtype: torch.dtype,
    gen: torch.Generator,
    offset: int = 0,
    extra: int = 0,
) -> None:
    """Expand into columns offset:offset + H_out of a non-zero out that is
    `extra` columns wider than needed."""
    meta, token_slots = _batch(batch)
    h_out, rank = stack.lora_b.shape[1], stack.lora_b.shape[2]
    y = _randn(meta.num_tokens, rank, dtype=dtype, gen=gen)
    before = _randn(meta.num_tokens, offset + h_out + extra, dtype=dtype, gen=gen)
    out = before.clone()
    ops.expand(y, stack.lora_b, meta, out, offset)
    cols = slice(offset, offset + h_out)
    expected = before.cpu().double()
    expected[:, cols] += naive_expand(y.cpu(), stack.b, token_slots, h_out)
    atol, rtol = TOLERANCE[dtype]
    torch.testing.assert_close(out.cpu().double(), expected, atol=atol, rtol=rtol)
    assert torch.equal(out[:, :offset], before[:, :offset]), "expand wrote left of its slice"
    assert torch.equal(out[:, offset + h_out :], before[:, offset + h_out :]), "expand wrote right of its slice"
    base_rows = [t for t, slot in enumerate(token_slots) if slot is None]
    assert torch.equal(out[base_rows], before[base_rows]), "expand touched a token without adapter"


@pytest.mark.parametrize("batch", list(BATCHES))
@pytest.mark.parametrize("backend", BACKENDS)
def test_batch_layouts(backend, batch):
    """Skewed segments, base tokens first/middle/last, merged runs, decode."""
    ops, gen = _ops(backend), torch.Generator().manual_seed(1)
    stack = make_stack(HIDDEN, HIDDEN, [16, 8, 16] + [8, 16] * 4, 16, torch.float32, gen)
    check_shrink(ops, stack, batch, torch.float32, gen)
    check_expand(ops, stack, batch, torch.float32, gen, offset=64, extra=32)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("module", list(MODULES))
@pytest.mark.parametrize("backend", BACKENDS)
def test_smollm2_modules(backend, module, dtype):
    ops, gen = _ops(backend), torch.Generator().manual_seed(2)
    h_in, h_out = MODULES[module]
    stack = make_stack(h_in, h_out, [8, 16, 8], 16, dtype, gen)
    check_shrink(ops, stack, "base_middle", dtype, gen)
    check_expand(ops, stack, "base_middle", dtype, gen)


@pytest.mark.parametrize("module", ["k", "down"])
@pytest.mark.parametrize("backend", BACKENDS)
def test_fp16(backend, module):
    ops, gen = _ops(backend), torch.Generator().manual_seed(3)
    h_in, h_out = MODULES[module]
    stack = make_stack(h_in, h_out, [16, 8, 16], 16, torch.float16, gen)
    check_shrink(ops, stack, "skew_1x7", torch.float16, gen)
    check_expand(ops, stack, "skew_7x1", torch.float16, gen, offset=16, extra=16)


@pytest.mark.parametrize(
    "ranks,max_rank",
    [([8, 8, 8], 8), ([16, 16, 16], 16), ([64, 64, 64], 64), ([8, 64, 16], 64), ([8, 8, 16], 32)],
    ids=["r8", "r16", "r64", "mixed_in_64", "padded_to_32"],
)
@pytest.mark.parametrize("backend", BACKENDS)
def test_ranks_and_padding(backend, ranks, max_rank):
    """Rank 8 runs in a masked 16-wide tile; smaller ranks in a larger stack
    contribute exactly their own product (the padding adds zero)."""
    ops, gen = _ops(backend), torch.Generator().manual_seed(4)
    stack = make_stack(HIDDEN, KV_WIDTH, ranks, max_rank, torch.float32, gen)
    check_shrink(ops, stack, "three_of_3", torch.float32, gen)
    check_expand(ops, stack, "three_of_3", torch.float32, gen, offset=8)


@pytest.mark.parametrize("backend", BACKENDS)
def test_widths_off_the_tile_grid(backend):
    """SmolLM2's widths are multiples of 64; other models' need not be, nor
    ranks powers of two: every tile edge is masked."""
    ops, gen = _ops(backend), torch.Generator().manual_seed(9)
    stack = make_stack(100, 150, [12, 5, 9], 12, torch.float32, gen)
    check_shrink(ops, stack, "skew_7x1", torch.float32, gen)
    check_expand(ops, stack, "skew_7x1", torch.float32, gen, offset=7, extra=9)


def _fused_case(widths: list[int], ranks: list[int], max_rank: int, dtype: torch.dtype, seed: int):
    """Per-slice stacks for projections that share their input, as fused in
    one PackedLinear (q/k/v or gate/up)."""
    gen = torch.Generator().manual_seed(seed)
    stacks = [make_stack(HIDDEN, w, ranks, max_rank, dtype, gen) for w in widths]
    offsets = [sum(widths[:i]) for i in range(len(widths))]
    return gen, stacks, offsets


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("backend", BACKENDS)
def test_fused_qkv(backend, dtype):
    """One shrink over q/k/v's stacked A, then each slice's expand into its
    columns (0, 576, 768) of the 960-wide qkv output: the same as three
    separate LoRA projections."""
    ops = _ops(backend)
    gen, stacks, offsets = _fused_case([HIDDEN, KV_WIDTH, KV_WIDTH], [8, 16], 16, dtype, seed=5)
    assert offsets == [0, 576, 768]
    meta, token_slots = _batch("base_first")
    x = _randn(meta.num_tokens, HIDDEN, dtype=dtype, gen=gen)
    lora_a = torch.cat([s.lora_a for s in stacks], dim=1)  # [num_slots, 3R, H_in]
    y = torch.empty(meta.num_tokens, lora_a.shape[1], dtype=torch.float32, device=DEVICE)
    ops.shrink(x, lora_a, meta, y)
    before = _randn(meta.num_tokens, 960, dtype=dtype, gen=gen)
    out = before.clone()
    ops.expand_slices(y, [s.lora_b for s in stacks], meta, out, offsets)

    expected = before.cpu().double()
    for stack, offset in zip(stacks, offsets):
        h_out = stack.lora_b.shape[1]
        delta_in = naive_shrink(x.cpu(), stack.a, token_slots, 16)
        expected[:, offset : offset + h_out] += naive_expand(delta_in, stack.b, token_slots, h_out)
    atol, rtol = TOLERANCE[dtype]
    torch.testing.assert_close(out.cpu().double(), expected, atol=atol, rtol=rtol)


@pytest.mark.parametrize("backend", BACKENDS)
def test_fused_gate_up_matches_separate_projections(backend):
    ops = _ops(backend)
    gen, stacks, offsets = _fused_case([INTERMEDIATE, INTERMEDIATE], [16, 8, 16], 16, torch.float32, seed=6)
    meta, _ = _batch("decode")
    x = _randn(meta.num_tokens, HIDDEN, dtype=torch.float32, gen=gen)
    base = _randn(meta.num_tokens, 2 * INTERMEDIATE, dtype=torch.float32, gen=gen)

    fused, y = base.clone(), torch.empty(meta.num_tokens, 32, device=DEVICE)
    ops.shrink(x, torch.cat([s.lora_a for s in stacks], dim=1), meta, y)
    ops.expand_slices(y, [s.lora_b for s in stacks], meta, fused, offsets)

    separate = base.clone()
    for stack, offset in zip(stacks, offsets):
        y_one = torch.empty(meta.num_tokens, 16, device=DEVICE)
        ops.shrink(x, stack.lora_a, meta, y_one)
        ops.expand(y_one, stack.lora_b, meta, separate, offset)
    torch.testing.assert_close(fused, separate, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("backend", BACKENDS)
def test_low_precision_with_float32_intermediate(backend):
    """bf16 activations and weights, the shrink result kept in float32."""
    ops, gen = _ops(backend), torch.Generator().manual_seed(7)
    stack = make_stack(HIDDEN, KV_WIDTH, [16, 8, 16], 16, torch.bfloat16, gen)
    meta, token_slots = _batch("base_last")
    x = _randn(meta.num_tokens, HIDDEN, dtype=torch.bfloat16, gen=gen)
    y = torch.empty(meta.num_tokens, 16, dtype=torch.float32, device=DEVICE)
    ops.shrink(x, stack.lora_a, meta, y)
    y_ref = naive_shrink(x.cpu(), stack.a, token_slots, 16)
    torch.testing.assert_close(y.cpu().double(), y_ref, atol=1e-4, rtol=1e-4)  # no bf16 rounding of y

    out = torch.zeros(meta.num_tokens, KV_WIDTH, dtype=torch.bfloat16, device=DEVICE)
    ops.expand(y, stack.lora_b, meta, out, 0)
    expected = naive_expand(y.cpu().bfloat16(), stack.b, token_slots, KV_WIDTH)  # y meets B in bf16
    torch.testing.assert_close(out.cpu().double(), expected, atol=3e-2, rtol=2e-2)


@pytest.mark.parametrize("backend", BACKENDS)
def test_a_batch_without_adapters(backend):
    ops = _ops(backend)
    meta = build_sgmv_meta([4, 1], [None, None], DEVICE)
    x = torch.randn(5, HIDDEN, device=DEVICE)
    lora_a = torch.randn(2, 8, HIDDEN, device=DEVICE)
    y = torch.full((5, 8), float("nan"), device=DEVICE)
    ops.shrink(x, lora_a, meta, y)
    assert torch.equal(y, torch.zeros_like(y))
    out = torch.randn(5, HIDDEN, device=DEVICE)
    before = out.clone()
    ops.expand(torch.randn(5, 8, device=DEVICE), torch.randn(2, HIDDEN, 8, device=DEVICE), meta, out, 0)
    assert torch.equal(out, before)


@pytest.mark.parametrize("batch", ["skew_1x7", "base_middle", "long_segment"])
def test_triton_matches_the_torch_twin(batch):
    """The two backends side by side on one full LoRA projection."""
    gen = torch.Generator().manual_seed(8)
    stack = make_stack(HIDDEN, INTERMEDIATE, [64, 8, 16], 64, torch.float32, gen)
    meta, _ = _batch(batch)
    x = _randn(meta.num_tokens, HIDDEN, dtype=torch.float32, gen=gen)
    base = _randn(meta.num_tokens, INTERMEDIATE, dtype=torch.float32, gen=gen)
    outs = []
    for name in BACKENDS:
        ops = _ops(name)
        y, out = torch.empty(meta.num_tokens, 64, device=DEVICE), base.clone()
        ops.shrink(x, stack.lora_a, meta, y)
        ops.expand(y, stack.lora_b, meta, out, 0)
        outs.append(out)
    torch.testing.assert_close(outs[1], outs[0], atol=1e-5, rtol=1e-5)


# --- metadata ---------------------------------------------------------------


def test_meta_merges_adjacent_requests_of_one_slot():
    meta = build_sgmv_meta([2, 3, 1, 2, 0, 4, 1], [1, 1, None, 1, 3, 1, 0], "cpu")
    assert meta.seg_starts_host == [0, 6, 12]
    assert meta.seg_lens_host == [5, 6, 1]  # the empty slot-3 request does not break the run
    assert meta.seg_slots_host == [1, 1, 0]
    assert meta.num_tokens == 13 and meta.num_lora_tokens == 12 and meta.max_seg_len == 6
    for tensor, host in ((meta.seg_starts, meta.seg_starts_host), (meta.seg_lens, meta.seg_lens_host),
                         (meta.seg_slots, meta.seg_slots_host)):
        assert tensor.dtype == torch.int32 and tensor.is_contiguous() and tensor.tolist() == host


def test_meta_of_an_empty_or_base_only_batch():
    for counts, slots in (([], []), ([3, 2], [None, None])):
        meta = build_sgmv_meta(counts, slots, "cpu")
        assert not meta.has_lora and meta.num_segments == 0 and meta.max_seg_len == 0
        assert meta.seg_lens.shape == (0,) and meta.num_tokens == sum(counts)


@pytest.mark.parametrize("counts,slots", [([1, 2], [0]), ([-1], [0]), ([1], [-1])])
def test_meta_rejects_bad_input(counts, slots):
    with pytest.raises(ValueError):
        build_sgmv_meta(counts, slots, "cpu")


# --- registry -----------------------------------------------------------------


def test_registry_picks_backends():
    assert get_lora_ops("torch", "cpu").name == "torch"
    assert get_lora_ops("cpu", "cpu").name == "cpu"
    assert get_lora_ops("auto", "cpu").name == "cpu"
    with pytest.raises(AdapterError) as err:
        get_lora_ops("cutlass", "cpu")
    assert err.value.param == "lora_backend"


def test_importing_adapters_ops_does_not_import_triton():
    assert_runs_without_triton(
        "import torch, adapters.ops, adapters.ops.meta, adapters.ops.base\n"
        "ops = adapters.ops.get_lora_ops('auto', torch.device('cpu'))\n"
        "meta = adapters.ops.build_sgmv_meta([2], [0], 'cpu')\n"
        "ops.shrink(torch.ones(2, 4), torch.ones(1, 3, 4), meta, torch.empty(2, 3))\n"
    )
