"""The quantized skinny kernels and their torch twin against a naive float64
reference that decodes every weight element by element from the stored
bytes (quant_reference.py), over SmolLM2-135M's shapes and skewed row
counts. The quantizers themselves: test_quantizers.py; float32
activations rounded to int8: test_quant_linear_int8_activations.py; the
kernels' row limits: test_quant_limits.py; the layout and rules of the
float32 Q4_1 path over interleaved rows: test_quant_linear_interleaved.py."""

from __future__ import annotations

import re

import pytest
import torch

from engine import host_cpu
from engine.model import quant_linear
from tests.engine.model.quant_reference import FORMATS, HIDDEN, SHAPES, naive_weight, quantized_weights
from tests.native import built_or_skip, recording

ROWS = [1, 3, 7, 16, 33, 64]
KERNELS = {"int8": "int8_linear", "int4": "q4_1_linear", "q8_0": "q8_0_linear"}
# Both paths sum in float32 (the kernel in its own order); bfloat16 output
# rounds to 8 bits of mantissa.
TOLERANCE = {torch.float32: dict(atol=1e-4, rtol=1e-4), torch.bfloat16: dict(atol=3e-2, rtol=2e-2)}


@pytest.fixture(scope="module")
def kernel():
    return built_or_skip(quant_linear.load_kernel, "CPU quantized linear kernel")


def _cancelling_rows(x: torch.Tensor) -> torch.Tensor:
    """x with a large first block that its second negates: against weights of
    twin blocks the two cancel, and what is left of a sum is mostly the
    rounding of its large partial sums, which another order of summation
    rounds differently. A row count that changed the order would show in
    the output, where random inputs mostly hide it below the output's own
    rounding."""
    x = x.clone()
    x[:, :32] *= 256
    x[:, 32:64] = -x[:, :32]
    return x


@pytest.fixture(scope="module")
def cases():
    """shape -> (quantized weights by format, their naive float64 decoding)."""
    found = {}
    for i, (name, shape) in enumerate(SHAPES.items()):
        qws, _ = quantized_weights(shape, seed=i)
        found[name] = (qws, {fmt: naive_weight(qw) for fmt, qw in qws.items()})
    return found


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("shape", list(SHAPES))
def test_kernel_and_twin_match_the_naive_reference(kernel, cases, shape, fmt, dtype):
    qws, ref_weights = cases[shape]
    qw, ref_w = qws[fmt], ref_weights[fmt]
    gen = torch.Generator().manual_seed(len(shape))
    for rows in ROWS:
        x = torch.randn(rows, qw.shape[1], generator=gen).to(dtype)
        expected = x.double() @ ref_w.T
        out = torch.empty(rows, qw.shape[0], dtype=dtype)
        assert qw.run_kernel(kernel, x, None, out)
        torch.testing.assert_close(out.double(), expected, **TOLERANCE[dtype])
        twin = quant_linear.twin(x, qw)
        assert twin.dtype == dtype
        torch.testing.assert_close(twin.double(), expected, **TOLERANCE[dtype])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("fmt", FORMATS)
# bfloat16's blocked formats: 9 rows take the dequantized tile; float32 Q4_1:
# 9 rows take the dequantized panel on AVX-512 but Zen 4, 20 elsewhere.
@pytest.mark.parametrize("rows", [3, 6, 9, 20])
def test_bias_and_strided_rows(kernel, fmt, dtype, rows):
    qws, gen = quantized_weights((80, 96), seed=9)
    qw = qws[fmt]
    x = torch.randn(rows, 200, generator=gen).to(dtype)[:, 7:103]  # rows 200 apart
    bias = torch.randn(80, generator=gen).to(dtype)
    rec = recording(kernel, KERNELS[fmt])
    got = quant_linear.linear(rec, x, qw, bias, limit=rows)
    assert rec.handled == [True]
    expected = x.double() @ naive_weight(qw).T + bias.double()
    torch.testing.assert_close(got.double(), expected, **TOLERANCE[dtype])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("rows", [13, 37])
@pytest.mark.parametrize("cancelling", [False, True], ids=["random", "cancelling"])
@pytest.mark.parametrize("n", [102, 120])
@pytest.mark.parametrize("k", [96, 320])
def test_a_row_comes_out_the_same_whatever_rows_share_its_call(kernel, fmt, dtype, rows, cancelling, n, k):
    """Bit for bit: a speculating sequence's verification (1 + K rows) must
    score a token as its plain one-row decode would, or greedy output would
    change with speculation on. 37 rows take three of AMX's 16-row tiles, in
    two passes; without AMX, calls of up to 8 rows skip the dequantized
    tile in bfloat16, and the splits put 1 to 8 rows against it.
    In float32 on AVX-512, calls past 4 rows go 4 at a time over a widened
    tile, then the last 1, 2 or 3 in one pass: 6, 7 and 31 rows reach those
    last passes. On AVX2 every float32 call goes 8 rows at a time, then the
    last 1 to 7 in one pass: the splits reach every group size from 1 to 8.
    On either, Q4_1 with 120 weight rows (15 groups of 8) reads them
    interleaved: on AVX2 in tiles of 1 to 4 groups, then single groups; on
    AVX-512 in tiles of 2 to 4 pairs of groups, then the pairs left one at
    a time, then the one group left. Calls of 9 rows or more on AVX-512
    (17 or more on Zen 4), 17 or more on AVX2, dequantize the groups into
    panels of 4 blocks of K instead (AVX-512: four groups, then a pair,
    then the one left; AVX2: pairs, then the one left) and continue each
    output's chain from panel to panel: K = 320 takes three panels, the
    last one short. The panel's row tiles: on AVX-512, 6 to 12 rows (13: 7
    and 6; 16: 8 and 8; 17: 9 and 8; 24: 12 and 12; 37: 10, 9, 9 and 9),
    on Zen 4, where only calls of 17 rows or more take the panel, 8 to 12;
    on AVX2, 4 to 6 (19: 5, 5, 5 and 4). A bias is added after the whole
    chain, on every path.
    102 rows, not a multiple of 8, keep the other paths."""
    # 102 weight rows: a partial 16-row tile, whose last group of 4 weight rows is partial too.
    qws, gen = quantized_weights((n, k), seed=4, twin_blocks=cancelling)
    qw = qws[fmt]
    x = torch.randn(rows, k, generator=gen).to(dtype)
    if cancelling:
        x = _cancelling_rows(x)
    bias = torch.randn(n, generator=gen).to(dtype)  # added once, after every chain
    together = torch.empty(rows, n, dtype=dtype)
    assert qw.run_kernel(kernel, x, bias, together)
    splits = [(1,) * rows, (2, 3, rows - 5), (4, rows - 4), (8, rows - 8), (6, rows - 6)]
    if rows > 24:
        splits += [(18, rows - 18), (16, rows - 16), (24, rows - 24), (17, rows - 17)]
    for split in splits:
        parts = [torch.empty(len(rows), n, dtype=dtype) for rows in x.split(split)]
        for rows, out in zip(x.split(split), parts):
            assert qw.run_kernel(kernel, rows, bias, out)
        assert torch.equal(torch.cat(parts), together), split


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("n", [300, 304])
def test_a_call_kept_on_the_calling_thread_sums_as_one_spread_over_the_threads(kernel, fmt, dtype, monkeypatch, n):
    """Where idle threads sleep, a call of fewer multiply-adds than
    `serial_macs` stays on the calling thread: that moves tiles between
    threads, never a sum. 300 weight rows make 19 tiles, more than one
    thread's share; 304 (38 groups of 8) take the interleaved Q4_1 path
    where the build has it, whose threads split the groups. (Which thread
    ran a tile does not show from here: this checks the sums and that every
    tile was done, not the split.)"""
    qws, gen = quantized_weights((n, 96), seed=5)
    qw = qws[fmt]
    for rows in (1, 6, 20):
        x = torch.randn(rows, 96, generator=gen).to(dtype)
        outs = []
        for threshold in (0, 1 << 62):  # over the threads, then all on this one
            limits = (threshold,) * len(quant_linear.SERIAL_MACS_WHEN_THREADS_SLEEP)
            monkeypatch.setattr(quant_linear, "serial_macs", lambda limits=limits: limits)
            outs.append(torch.empty(rows, n, dtype=dtype))
            assert qw.run_kernel(kernel, x, None, outs[-1])
        assert torch.equal(outs[0], outs[1]), rows
        torch.testing.assert_close(outs[1].double(), x.double() @ naive_weight(qw).T, **TOLERANCE[dtype])


@pytest.mark.skipif("avx512_bf16" not in host_cpu.cpu_flags(), reason="the host has no AVX512-BF16")
def test_bfloat16_tiles_stay_on_one_thread_by_the_limit_of_the_path_they_take(kernel):
    """Where idle threads sleep: on AMX a call's multiply-adds count its
    token rows padded to whole 16-row tiles, against the AMX limit; on the
    vector tiles its own rows, against theirs. With the limits as set, on
    AMX the model's layer shapes (the 576 x 576 o_proj the smallest) take
    both threads from one row, and a 192 x 576 weight stays on one."""
    one_thread = kernel.bf16_tiles_on_one_thread
    n, k = 192, 576
    if not kernel.uses_amx():
        assert one_thread(1, n, k, n * k + 1, 0) and not one_thread(1, n, k, n * k, 1 << 62)
        assert not one_thread(2, n, k, n * k + 1, 0)
        return
    padded = 16 * n * k
    assert one_thread(1, n, k, 0, padded + 1) and one_thread(16, n, k, 0, padded + 1)
    assert not one_thread(1, n, k, 1 << 62, padded) and not one_thread(17, n, k, 0, padded + 1)
    limits = quant_linear.SERIAL_MACS_WHEN_THREADS_SLEEP
    tiles, amx = limits["bfloat16 tiles"], limits["AMX tiles"]
    assert one_thread(1, *SHAPES["k/v"], tiles, amx)
    assert not any(one_thread(1, *SHAPES[name], tiles, amx) for name in ("q/o", "qkv", "gate_up", "down"))


def test_serial_macs_hands_each_limit_where_the_kernels_take_it(monkeypatch):
    """The kernels take the one-thread limits by position, in the order of
    quant_linear.cpp's SerialMacs and of every binding's parameters; a swap
    would put a path under another's limit with no output to show it."""
    monkeypatch.setenv("OMP_WAIT_POLICY", "PASSIVE")
    limits = quant_linear.SERIAL_MACS_WHEN_THREADS_SLEEP
    order = ("bfloat16 tiles", "widening", "AMX tiles", "16 lanes")
    assert set(order) == set(limits)
    assert quant_linear.serial_macs.__wrapped__() == tuple(limits[path] for path in order)
    source = quant_linear.SOURCE.read_text()
    assert "int64_t tiles, widening, amx, lanes16;" in source
    params = r",\s*".join(f"int64_t serial_macs_{name}" for name in ("tiles", "widening", "amx", "lanes16"))
    assert len(re.findall(params, source)) == 3  # int8_linear, q4_1_linear, q8_0_linear


@pytest.mark.skipif("avx512_bf16" not in host_cpu.cpu_flags(), reason="the host has no AVX512-BF16")
@pytest.mark.parametrize("fmt", ["int4", "q8_0"])
def test_blocked_formats_in_bfloat16_multiply_the_float_paths_bfloat16_weights(kernel, fmt):
    """With AVX512-BF16 the Q4_1 and Q8_0 kernels dequantize to bfloat16 (to
    the very weights quantization "auto" keeps for larger calls) and sum
    their products in float32: only the order of the float32 sum differs
    from multiplying those weights in float64."""
    qws, gen = quantized_weights(SHAPES["gate_up"], seed=5)
    qw = qws[fmt]
    weight = qw.dequantize(torch.float32).to(torch.bfloat16)
    for rows in ROWS:
        x = torch.randn(rows, HIDDEN, generator=gen).to(torch.bfloat16)
        out = torch.empty(rows, qw.shape[0], dtype=torch.bfloat16)
        assert qw.run_kernel(kernel, x, None, out)
        expected = (x.double() @ weight.double().T).to(torch.bfloat16)
        # One bfloat16 rounding step at most (the float32 sums differ by ~1e-6).
        torch.testing.assert_close(out.float(), expected.float(), atol=1e-5, rtol=2**-7)
    # The weights themselves, bit for bit: token rows of the identity read
    # one weight each (its product with 1 and a sum of zeros are exact), on
    # an even and an odd number of blocks a row (Q4_1 dequantizes pairs).
    for shape in (SHAPES["gate_up"], (100, 96)):
        qw = qws[fmt] if shape == SHAPES["gate_up"] else quantized_weights(shape, seed=6)[0][fmt]
        eye = torch.eye(shape[1], dtype=torch.bfloat16)
        out = torch.empty(shape[1], shape[0], dtype=torch.bfloat16)
        assert qw.run_kernel(kernel, eye, None, out)
        assert torch.equal(out, qw.dequantize(torch.float32).to(torch.bfloat16).T)


@pytest.mark.skipif(not {"amx_bf16", "avx512_bf16"} <= host_cpu.cpu_flags(), reason="the host has no AMX-BF16")
def test_the_bfloat16_tiles_run_on_amx_where_the_host_has_it(kernel):
    """So the bfloat16 tests above hold the AMX path to the reference on
    such a host (the kernel is built for the CPU it runs on)."""
    assert kernel.uses_amx()


@pytest.mark.parametrize("case", ["float16", "k_not_multiple_of_32"])
def test_inputs_the_kernel_does_not_take_go_to_the_twin(kernel, case):
    k = 48 if case == "k_not_multiple_of_32" else 64
    w = torch.randn(32, k)
    qw = quant_linear.quantize_int8(w)
    x = torch.randn(3, k).to(torch.float16 if case == "float16" else torch.float32)
    rec = recording(kernel, "int8_linear")
    got = quant_linear.linear(rec, x, qw, limit=3)  # offered to the kernel, which declines
    assert rec.handled == [False]
    assert torch.equal(got, quant_linear.twin(x, qw))


def test_a_shape_mismatch_raises(kernel):
    qw = quant_linear.quantize_q4_1(torch.randn(32, 64))
    with pytest.raises(RuntimeError, match="q4_1_linear"):
        kernel.q4_1_linear(torch.randn(2, 96), qw.q, qw.dm, None, torch.empty(2, 32), False, 0, 0, 0, 0, [])


def test_a_limit_given_to_linear_decides_which_path_a_call_takes(kernel):
    """The model passes its LM head's own limit: rows up to it go to the
    kernel, more to the float weights, whatever the environment's limit."""
    qws, gen = quantized_weights((96, HIDDEN), seed=8)
    qw = qws["q8_0"]
    weight = qw.dequantize(torch.float32)
    for rows, handled in ((2, [True]), (3, [])):
        x = torch.randn(rows, HIDDEN, generator=gen)
        rec = recording(kernel, KERNELS["q8_0"])
        got = quant_linear.linear(rec, x, qw, None, weight, None, None, limit=2)
        assert rec.handled == handled
        torch.testing.assert_close(got.double(), x.double() @ naive_weight(qw).T, **TOLERANCE[torch.float32])


@pytest.mark.parametrize("fmt", ["int4", "q8_0"])  # the blocked formats (int8's quantizer wants K > 0)
def test_an_empty_k_gives_the_bias_at_any_row_count(kernel, fmt):
    """K = 0: every sum is empty, so each output is its bias, whichever path
    the row count takes (in float32, 17 rows or more would take the panel,
    9 or more on AVX-512 but Zen 4, which has no panel of K to write from)."""
    qw = quant_linear.quantize(torch.zeros(16, 0), fmt)
    bias = torch.randn(16)
    for rows in (1, 8, 16, 17, 40):
        out = torch.full((rows, 16), float("nan"))
        assert qw.run_kernel(kernel, torch.empty(rows, 0), bias, out)
        assert torch.equal(out, bias.expand(rows, 16)), rows
